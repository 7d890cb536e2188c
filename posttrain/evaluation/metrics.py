"""Sampling metrics (pass@k, maj@k, mean@k) and calibration metrics (Brier, ECE, AUROC).

Pure numpy; no model, no I/O. Conventions:

- pass@k is the unbiased estimator of Chen et al. 2021 (HumanEval, arXiv:2107.03374) from n
  samples of which c are correct, computed in its product form (as in RLCR's
  ``estimate_pass_at_k``, catalog L143) so no large binomials are formed.
- maj@k is the *expected* accuracy of the majority answer of k samples drawn without replacement
  from the n, ties split uniformly at random; computed exactly, see :func:`maj_at_k`.
- Calibration follows RLCR (damanimehul/RLCR @8904bed ``eval/eval_utils.py``, catalog L143):
  10 equal-width bins, ``np.digitize`` with the outer edges replaced by -inf / +inf, so 0 lands in
  the first bin and 1 in the last (edges exact multiples of 1 / bins, see :func:`reliability_bins`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

_MAX_MAJ_N = 1000  # float64 holds C(1000, 500) ~ 2.7e299; above that the exact sum overflows


# --------------------------------------------------------------------------- pass@k / mean@k


def _counts(n: ArrayLike, c: ArrayLike, k: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"k must be an int; got {k!r}")
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n), np.asarray(c))
    for name, arr in (("n", n_arr), ("c", c_arr)):
        if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.all(np.mod(arr, 1) == 0)):
            raise ValueError(f"{name} must hold integers; got {arr!r}")
    n_arr, c_arr = n_arr.astype(np.int64), c_arr.astype(np.int64)
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    if np.any(n_arr < 0) or np.any(c_arr < 0):
        raise ValueError(f"n and c must be >= 0; got n={n_arr.tolist()}, c={c_arr.tolist()}")
    if np.any(c_arr > n_arr):
        raise ValueError(f"c must be <= n; got n={n_arr.tolist()}, c={c_arr.tolist()}")
    if np.any(k > n_arr):
        raise ValueError(f"k={k} exceeds the number of samples n={n_arr.tolist()}")
    return n_arr, c_arr


def _pass_at_k_one(n: int, c: int, k: int) -> float:
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float | np.ndarray:
    """Unbiased pass@k: 1 - C(n - c, k) / C(n, k), the chance a k-subset holds a correct sample.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al. 2021, arXiv:2107.03374; RLCR's
    ``estimate_pass_at_k``), exact up to float rounding and free of overflow. Catalog L143:
    n = 4, c = 2, k = 2 -> 1 - C(2,2)/C(4,2) = 1 - 1/6 = 0.8333.

    Scalars ``n``, ``c`` give a float. Arrays (or lists) give one value per problem, shape
    ``broadcast(n, c)``; average them with :func:`mean_pass_at_k`. Raises ``ValueError`` for
    k < 1, k > n, c > n or negative counts.
    """
    n_arr, c_arr = _counts(n, c, k)
    out = np.array([_pass_at_k_one(int(ni), int(ci), k) for ni, ci in zip(n_arr.ravel(), c_arr.ravel(), strict=True)])
    if n_arr.ndim == 0:
        return float(out[0])
    return out.reshape(n_arr.shape)


def mean_pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float:
    """Mean of :func:`pass_at_k` over problems (the benchmark's pass@k)."""
    return float(np.mean(pass_at_k(n, c, k)))


def mean_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float | np.ndarray:
    """mean@k: expected mean correctness of k samples drawn without replacement from the n.

    By linearity this is c / n for every k (the unbiased estimate of per-sample accuracy that
    "avg@k" reports); k only has to satisfy 1 <= k <= n. Same shapes and errors as
    :func:`pass_at_k`. Example: n = 4, c = 1 -> 0.25.
    """
    n_arr, c_arr = _counts(n, c, k)
    out = c_arr / np.maximum(n_arr, 1)
    if n_arr.ndim == 0:
        return float(out)
    return out.astype(np.float64)


# --------------------------------------------------------------------------------- maj@k


def _answer_classes(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> dict[Hashable | None, bool]:
    if len(answers) != len(correct):
        raise ValueError(f"answers ({len(answers)}) and correct ({len(correct)}) differ in length")
    classes: dict[Hashable | None, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        ok = bool(ok)
        if answer is None and ok:
            raise ValueError("a sample with no answer (None) cannot be correct")
        if classes.setdefault(answer, ok) != ok:
            raise ValueError(f"answer {answer!r} is marked both correct and incorrect")
    return classes


def _tie_credit(n_correct_tied: int, n_wrong_tied: int) -> float:
    return n_correct_tied / (n_correct_tied + n_wrong_tied)


def _maj_first(answers: Sequence[Hashable | None], classes: dict[Hashable | None, bool], k: int) -> float:
    counts = Counter(answers[:k])
    top = max(counts.values())
    tied = [a for a, m in counts.items() if m == top]
    return _tie_credit(sum(classes[a] for a in tied), sum(not classes[a] for a in tied))


def _maj_expected(counts: list[int], flags: list[bool], n: int, k: int) -> float:
    """Exact E[credit of the majority of a uniform k-subset] by a DP over answer classes.

    The k-subset draws x_i samples of class i (multivariate hypergeometric, weight
    prod_i C(m_i, x_i) / C(n, k)). Split by the winning count v = max_i x_i: classes with
    m_i < v cannot reach v and enter through the polynomial Q(z) = prod_i sum_x C(m_i, x) z^x;
    for the others ("candidates") D[s, a, b] sums the weights of draws with x_i <= v, total s,
    a correct and b wrong classes at exactly v. The credit of such a draw is a / (a + b).
    """
    total = 0.0
    for v in range(1, k + 1):
        cand = [i for i, m in enumerate(counts) if m >= v]
        if not cand:
            break
        q = np.zeros(k + 1)
        q[0] = 1.0
        for m in (m for m in counts if m < v):
            q = np.convolve(q, [math.comb(m, x) for x in range(m + 1)])[: k + 1]
        n_c = sum(flags[i] for i in cand)
        d = np.zeros((k + 1, n_c + 1, len(cand) - n_c + 1))
        d[0, 0, 0] = 1.0
        for i in cand:
            m, new = counts[i], np.zeros_like(d)
            for x in range(min(v, k + 1)):  # below the winning count
                new[x:] += math.comb(m, x) * d[: k + 1 - x]
            if flags[i]:  # exactly v: one more class tied at the top
                new[v:, 1:, :] += math.comb(m, v) * d[: k + 1 - v, :-1, :]
            else:
                new[v:, :, 1:] += math.comb(m, v) * d[: k + 1 - v, :, :-1]
            d = new
        a = np.arange(n_c + 1)[:, None]
        b = np.arange(len(cand) - n_c + 1)[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            credit = np.where(a + b > 0, a / np.maximum(a + b, 1), 0.0)
        # draws of total s among candidates pair with draws of k - s among the others
        total += float(np.einsum("sab,ab,s->", d, credit, q[::-1]))
    return total / math.comb(n, k)


def maj_at_k(
    answers: Sequence[Hashable | None],
    correct: Sequence[bool],
    k: int,
    *,
    mode: Literal["expected", "first"] = "expected",
) -> float:
    """maj@k for one problem: accuracy of the most frequent answer among k samples.

    ``answers[i]`` is sample i's extracted final answer (any hashable; ``None`` = no answer, a
    class of its own that is always wrong); ``correct[i]`` whether it verified. Samples with
    equal answers must agree on correctness (``ValueError`` otherwise); distinct answers may both
    be correct (e.g. "1/2" and "0.5" if not normalized), each then votes separately.

    - ``mode="expected"`` (default): the expectation over the C(n, k) subsets of k samples drawn
      without replacement, computed exactly (a DP over answer classes, no enumeration; n <= 1000).
      For k = n it is the majority of all samples. Unbiased for the maj@k of k fresh samples.
    - ``mode="first"``: the majority of ``answers[:k]``, as lighteval's ``MajAtN`` does
      (``final_text[: self.n]``); cheaper, but depends on sample order.

    Ties: split uniformly at random, so a draw whose top count is shared by a correct classes and
    b wrong ones scores a / (a + b). (lighteval instead keeps the tied answer seen first.)

    Example: answers [A, A, B, C], A correct, k = 2. Of the 6 pairs, {A, A} scores 1, the four
    pairs {A, B}, {A, C} tie 1-1 and score 1/2, {B, C} scores 0: (1 + 4/2) / 6 = 0.5.
    """
    classes = _answer_classes(answers, correct)
    n = len(answers)
    _counts(n, 0, k)  # validates k in [1, n]
    if mode == "first":
        return _maj_first(answers, classes, k)
    if mode != "expected":
        raise ValueError(f"mode must be 'expected' or 'first'; got {mode!r}")
    if n > _MAX_MAJ_N:
        raise ValueError(f"maj_at_k(mode='expected') supports n <= {_MAX_MAJ_N}; got n={n}")
    counts = Counter(answers)
    keys = list(counts)
    return _maj_expected([counts[a] for a in keys], [classes[a] for a in keys], n, k)


# ------------------------------------------------------------------------------ calibration


def _calibration_inputs(conf: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    q = np.asarray(conf, dtype=np.float64).ravel()
    y = np.asarray(correct, dtype=np.float64).ravel()
    if q.shape != y.shape:
        raise ValueError(f"conf ({q.size}) and correct ({y.size}) differ in length")
    if q.size == 0:
        raise ValueError("calibration metrics need at least one sample")
    if np.any(~np.isfinite(q)) or np.any((q < 0) | (q > 1)):
        raise ValueError("confidences must lie in [0, 1]")
    if np.any((y != 0) & (y != 1)):
        raise ValueError("correct must hold 0/1 (or bool) values")
    return q, y


def brier(conf: ArrayLike, correct: ArrayLike) -> float:
    """Brier score: mean_i (q_i - y_i)^2, lower is better.

    Catalog L143: q = [0.9, 0.8, 0.3, 0.6], y = [1, 0, 0, 1] ->
    (0.01 + 0.64 + 0.09 + 0.16) / 4 = 0.225.
    """
    q, y = _calibration_inputs(conf, correct)
    return float(np.mean((q - y) ** 2))


@dataclass(frozen=True)
class ReliabilityBin:
    """One bin of a reliability diagram: edges, mean confidence, accuracy, sample count.

    ``mean_conf`` and ``accuracy`` are NaN for an empty bin (``count == 0``).
    """

    lower: float
    upper: float
    mean_conf: float
    accuracy: float
    count: int


def reliability_bins(conf: ArrayLike, correct: ArrayLike, bins: int = 10) -> list[ReliabilityBin]:
    """Equal-width bins over [0, 1] with each bin's mean confidence, accuracy and count.

    Bin b holds b / bins <= q < (b + 1) / bins; q = 1 goes to the last bin (RLCR's ``np.digitize``
    with -inf / +inf outer edges). One departure: edges are ``arange(bins + 1) / bins``, not
    RLCR's ``linspace(0, 1, bins + 1)``, whose float edges (0.6000000000000001, 0.7000000000000001)
    put verbalized confidences 0.6 and 0.7 one bin low while 0.8 stays put. Only values exactly on
    an edge differ. Feed the result to a calibration diagram.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1; got {bins}")
    q, y = _calibration_inputs(conf, correct)
    edges = np.arange(bins + 1) / bins
    search = edges.copy()
    search[0], search[-1] = -np.inf, np.inf
    idx = np.digitize(q, search) - 1
    out = []
    for b in range(bins):
        sel = idx == b
        count = int(sel.sum())
        mean_conf = float(q[sel].mean()) if count else math.nan
        accuracy = float(y[sel].mean()) if count else math.nan
        out.append(ReliabilityBin(float(edges[b]), float(edges[b + 1]), mean_conf, accuracy, count))
    return out


def ece(conf: ArrayLike, correct: ArrayLike, bins: int = 10) -> float:
    """Expected calibration error: sum_b (n_b / n) |mean conf_b - accuracy_b| over non-empty bins.

    Bins as in :func:`reliability_bins` (RLCR's ``get_ece``). Catalog L143: q = [0.9, 0.8, 0.3,
    0.6], y = [1, 0, 0, 1]: every sample sits alone in its bin, so
    ECE = (|0.9-1| + |0.8-0| + |0.3-0| + |0.6-1|) / 4 = (0.1 + 0.8 + 0.3 + 0.4) / 4 = 0.40.
    """
    table = reliability_bins(conf, correct, bins)
    n = sum(b.count for b in table)
    return float(sum(b.count / n * abs(b.mean_conf - b.accuracy) for b in table if b.count))


def auroc(conf: ArrayLike, correct: ArrayLike) -> float:
    """AUROC of confidence as a detector of correct answers (Mann-Whitney U / (n_pos n_neg)).

    AUROC = P(q_pos > q_neg) + P(q_pos = q_neg) / 2 over (correct, incorrect) pairs, equal to
    sklearn's ``roc_auc_score`` (and RLCR's ``roc_curve`` + ``auc``). NaN when every sample is
    correct or every sample is wrong (undefined). Example: q = [0.9, 0.8, 0.3, 0.6],
    y = [1, 0, 0, 1]: pairs (pos, neg) 0.9>0.8, 0.9>0.3, 0.6<0.8, 0.6>0.3 -> 3/4 = 0.75.
    """
    q, y = _calibration_inputs(conf, correct)
    pos, neg = q[y == 1], q[y == 0]
    if pos.size == 0 or neg.size == 0:
        return math.nan
    # midranks give ties 1/2: U = sum of positive ranks - n_pos (n_pos + 1) / 2
    order = np.argsort(q, kind="mergesort")
    ranks = np.empty(q.size)
    sorted_q = q[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_q)) + 1]
    ends = np.r_[starts[1:], q.size]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # mean of 1-based ranks s+1 .. e
    u = ranks[y == 1].sum() - pos.size * (pos.size + 1) / 2.0
    return float(u / (pos.size * neg.size))
