"""pass@k, maj@k, mean@k and calibration metrics: hand-computed values and brute force."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest

from posttrain.evaluation.metrics import (
    auroc,
    brier,
    ece,
    maj_at_k,
    mean_at_k,
    mean_pass_at_k,
    pass_at_k,
    reliability_bins,
)

# ---------------------------------------------------------------------------------- pass@k


def test_pass_at_k_catalog_value():
    # catalog L143: n=4, c=2, k=2 -> 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6, abs=1e-12)
    assert pass_at_k(4, 2, 2) == pytest.approx(0.8333, abs=5e-5)


def test_pass_at_k_matches_brute_force_over_subsets():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(5, 0, 3) == 0.0  # no correct sample
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset has a correct one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)  # large n, no overflow


def test_pass_at_k_vectorized():
    n = np.array([4, 4, 10])
    c = [2, 0, 3]
    out = pass_at_k(n, c, 2)
    assert isinstance(out, np.ndarray) and out.shape == (3,)
    expected = [pass_at_k(4, 2, 2), 0.0, pass_at_k(10, 3, 2)]
    np.testing.assert_allclose(out, expected)
    assert mean_pass_at_k(n, c, 2) == pytest.approx(np.mean(expected))
    # broadcasting a scalar n against per-problem c
    np.testing.assert_allclose(pass_at_k(4, [0, 4], 2), [0.0, 1.0])


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(3, 1, 4), (3, 4, 1), (-1, 0, 1), (3, -1, 1), (3, 1, 0), ([3, 2], [1, 1], 3), (3.5, 1, 1)],
)
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_at_k():
    # expected mean correctness of k samples is c / n whatever k
    assert mean_at_k(4, 1, 3) == 0.25
    np.testing.assert_allclose(mean_at_k([4, 8], [2, 8], 4), [0.5, 1.0])
    with pytest.raises(ValueError):
        mean_at_k(4, 1, 5)


# ----------------------------------------------------------------------------------- maj@k


def _brute_maj(answers, correct, k):
    klass = dict(zip(answers, correct, strict=True))
    scores = []
    for idx in itertools.combinations(range(len(answers)), k):
        counts = Counter(answers[i] for i in idx)
        top = max(counts.values())
        tied = [a for a, m in counts.items() if m == top]
        scores.append(sum(klass[a] for a in tied) / len(tied))
    return sum(scores) / len(scores)


def test_maj_at_k_hand_example():
    # [A, A, B, C], A correct, k=2: pairs {A,A} -> 1; {A,B} x2, {A,C} x2 tie 1-1 -> 1/2 each;
    # {B,C} -> 0 (tie of two wrong answers). (1 + 4 * 0.5 + 0) / 6 = 0.5
    answers, correct = ["A", "A", "B", "C"], [True, True, False, False]
    assert maj_at_k(answers, correct, 2) == pytest.approx(0.5)
    # k = n: A has 2 votes against 1 and 1 -> correct
    assert maj_at_k(answers, correct, 4) == pytest.approx(1.0)
    # k = 1: the majority of one sample is that sample, so maj@1 = c / n = 2 / 4
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5)
    # k = 3: triples (4): {A,A,B}, {A,A,C} -> 1; {A,B,C} x2 -> three-way tie, 1/3 each
    # (2 + 2/3) / 4 = 2/3
    assert maj_at_k(answers, correct, 3) == pytest.approx(2 / 3)


def test_maj_at_k_matches_brute_force():
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(1, 9)
        answers = [rng.choice("ABCD") for _ in range(n)]
        right = set(rng.sample("ABCD", rng.randint(0, 2)))  # zero, one or two correct answers
        correct = [a in right for a in answers]
        k = rng.randint(1, n)
        assert maj_at_k(answers, correct, k) == pytest.approx(_brute_maj(answers, correct, k), abs=1e-12)


def test_maj_at_k_none_is_a_wrong_class():
    # [None, None, None, 7], 7 correct, k=4: "no answer" wins 3-1 -> 0
    assert maj_at_k([None, None, None, 7], [False, False, False, True], 4) == 0.0
    with pytest.raises(ValueError):
        maj_at_k([None, 7], [True, True], 1)


def test_maj_at_k_first_mode():
    answers, correct = ["B", "A", "A", "B", "B"], [False, True, True, False, False]
    # first 3: B, A, A -> A wins 2-1 -> 1
    assert maj_at_k(answers, correct, 3, mode="first") == 1.0
    # first 4: A 2, B 2 -> tie, credit 1/2 (lighteval would keep B, seen first)
    assert maj_at_k(answers, correct, 4, mode="first") == 0.5
    assert maj_at_k(answers, correct, 5, mode="first") == 0.0


def test_maj_at_k_errors():
    with pytest.raises(ValueError):
        maj_at_k(["A", "A"], [True, False], 1)  # same answer, two verdicts
    with pytest.raises(ValueError):
        maj_at_k(["A"], [True, False], 1)
    with pytest.raises(ValueError):
        maj_at_k(["A", "B"], [True, False], 3)
    with pytest.raises(ValueError):
        maj_at_k(["A", "B"], [True, False], 1, mode="last")


def test_maj_at_k_larger_n_is_fast_and_bounded():
    rng = random.Random(2)
    answers = [rng.choice("ABCDEFGH") for _ in range(64)]
    correct = [a == "A" for a in answers]
    value = maj_at_k(answers, correct, 16)
    assert 0.0 <= value <= 1.0


# ------------------------------------------------------------------------------ calibration

CONF = [0.9, 0.8, 0.3, 0.6]
CORRECT = [1, 0, 0, 1]


def test_brier_and_ece_catalog_values():
    # Brier: (0.1^2 + 0.8^2 + 0.3^2 + 0.4^2) / 4 = (0.01 + 0.64 + 0.09 + 0.16) / 4 = 0.225
    assert brier(CONF, CORRECT) == pytest.approx(0.225)
    # ECE: one sample per bin -> (0.1 + 0.8 + 0.3 + 0.4) / 4 = 0.40
    assert ece(CONF, CORRECT) == pytest.approx(0.40)


def test_ece_pools_within_a_bin():
    # bin [0.7, 0.8): 0.7, 0.75 with y = 1, 0 -> |0.725 - 0.5| = 0.225, weight 2/3
    # bin [0.2, 0.3): 0.25 with y = 0 -> 0.25, weight 1/3.  ECE = 0.15 + 0.08333 = 0.23333
    assert ece([0.7, 0.75, 0.25], [1, 0, 0]) == pytest.approx(0.15 + 0.25 / 3)


def test_reliability_bins_decimal_confidences_land_in_their_own_bin():
    # q = b / 10 belongs to bin b (linspace edges would put 0.3, 0.6, 0.7 one bin low)
    table = reliability_bins([b / 10 for b in range(10)], [1] * 10)
    assert [t.count for t in table] == [1] * 10


def test_reliability_bins_edges_and_contents():
    table = reliability_bins([0.0, 0.05, 1.0, 0.95], [0, 1, 1, 1], bins=10)
    assert len(table) == 10
    first, last = table[0], table[-1]
    assert (first.count, first.mean_conf, first.accuracy) == (2, pytest.approx(0.025), 0.5)
    assert (last.count, last.mean_conf, last.accuracy) == (2, pytest.approx(0.975), 1.0)
    assert (first.lower, last.upper) == (0.0, 1.0)
    assert all(b.count == 0 and math.isnan(b.accuracy) for b in table[1:-1])


def test_auroc_hand_example_and_ties():
    # pairs (pos q, neg q): (0.9,0.8) win, (0.9,0.3) win, (0.6,0.8) loss, (0.6,0.3) win -> 3/4
    assert auroc(CONF, CORRECT) == pytest.approx(0.75)
    # a tie counts 1/2: pos [0.5], neg [0.5, 0.2] -> (0.5 + 1) / 2 = 0.75
    assert auroc([0.5, 0.5, 0.2], [1, 0, 0]) == pytest.approx(0.75)
    assert auroc([0.2, 0.9], [0, 1]) == 1.0
    assert math.isnan(auroc([0.2, 0.9], [1, 1]))


def test_auroc_matches_pairwise_definition():
    rng = np.random.default_rng(3)
    q = rng.integers(0, 5, size=40) / 4  # many ties
    y = rng.integers(0, 2, size=40)
    pos, neg = q[y == 1], q[y == 0]
    pairs = [(p > m) + 0.5 * (p == m) for p in pos for m in neg]
    assert auroc(q, y) == pytest.approx(np.mean(pairs))


@pytest.mark.parametrize(
    ("conf", "correct"),
    [([0.5], [1, 0]), ([1.2], [1]), ([float("nan")], [1]), ([0.5], [2]), ([], [])],
)
def test_calibration_rejects_bad_input(conf, correct):
    with pytest.raises(ValueError):
        brier(conf, correct)
