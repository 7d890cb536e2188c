"""The sampler draws exactly from softmax(logits / T) (restricted to top-k / top-p, without banned
tokens) and returns the policy's own log-probs log_softmax(logits / T)[token].

Distributions are checked with a chi-square goodness-of-fit test on seeded draws (deterministic),
at a critical value for p = 1e-6, and the test is shown to reject a slightly wrong distribution.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rollout.sampling import CHUNK, categorical, sample_next

DRAWS = 40_000


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 4.75 is the normal quantile of 1 - 1e-6."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic of drawn ``tokens`` against ``probs [V]`` and its degrees of freedom;
    bins expected under 5 counts are merged into one (the usual validity rule).
    """
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, banned: list[int]) -> torch.Tensor:
    """The intended distribution, written out token by token: ban, then top-k, then the nucleus."""
    scaled = (logits.double() / temperature).tolist()
    allowed = [i for i in range(len(scaled)) if i not in banned]
    allowed.sort(key=lambda i: -scaled[i])
    if top_k:
        allowed = allowed[:top_k]
    z = sum(math.exp(scaled[i]) for i in allowed)
    if top_p < 1:
        kept, mass = [], 0.0
        for i in allowed:  # keep a token while the mass before it is under top_p
            if mass >= top_p:
                break
            kept.append(i)
            mass += math.exp(scaled[i]) / z
        allowed = kept
    probs = torch.zeros(len(scaled), dtype=torch.float64)
    for i in allowed:
        probs[i] = math.exp(scaled[i])
    return probs / probs.sum()


@pytest.mark.parametrize("vocab", [5, 600])  # 600 = two full chunks and a partial one
def test_categorical_draws_the_weights(vocab):
    assert vocab > 2 * CHUNK or vocab < CHUNK
    g = torch.Generator().manual_seed(0)
    w = torch.rand(vocab, generator=g) ** 2
    w[::7] = 0.0  # zero weights are never drawn
    tokens = categorical(w.expand(DRAWS, vocab).contiguous(), torch.Generator().manual_seed(1))
    assert not (w[tokens] == 0).any()
    stat, df = chi2(tokens, w / w.sum())
    assert stat < chi2_critical(df), (stat, df)


def test_categorical_tiny_masses_far_out_in_the_vocabulary():
    # one token holds almost all the mass; a rare token in the last chunk keeps its exact share
    vocab = 3 * CHUNK
    w = torch.zeros(vocab)
    w[3], w[vocab - 2] = 1.0, 0.01
    tokens = categorical(w.expand(DRAWS, vocab).contiguous(), torch.Generator().manual_seed(2))
    assert set(tokens.unique().tolist()) == {3, vocab - 2}
    stat, df = chi2(tokens, w / w.sum())
    assert stat < chi2_critical(df)


CASES = [  # temperature, top_k, top_p, banned
    (1.0, 0, 1.0, []),
    (0.7, 0, 1.0, []),
    (1.3, 0, 1.0, [0, 5]),
    (0.8, 5, 1.0, []),
    (1.0, 0, 0.7, []),
    (0.9, 6, 0.8, [1]),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "banned"), CASES)
def test_sample_next_distribution_and_logprobs(temperature, top_k, top_p, banned):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=g) * 2
    logits[0] = logits.max() + 1  # a banned token that would otherwise be the likeliest
    rows = logits.expand(DRAWS, 40).contiguous()
    ban = torch.tensor(banned, dtype=torch.long) if banned else None
    tokens, logp = sample_next(rows, temperature, top_k, top_p, torch.Generator().manual_seed(4), banned=ban)
    probs = reference(logits, temperature, top_k, top_p, banned)
    assert not (probs[tokens] == 0).any()  # nothing outside the allowed set
    stat, df = chi2(tokens, probs)
    assert stat < chi2_critical(df), (stat, df)
    # the behaviour log-prob is the policy's own: before banning and filtering
    torch.testing.assert_close(logp, (logits / temperature).log_softmax(-1)[tokens], atol=1e-5, rtol=0)


def test_chi_square_rejects_a_slightly_wrong_distribution():
    # draws at temperature 1.0 against the temperature-0.9 distribution: the test must notice
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    tokens, _ = sample_next(logits.expand(DRAWS, 40).contiguous(), 1.0, 0, 1.0, torch.Generator().manual_seed(4))
    stat, df = chi2(tokens, reference(logits, 0.9, 0, 1.0, []))
    assert stat > chi2_critical(df)


def test_greedy_takes_the_argmax_and_honours_banned():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    tokens, logp = sample_next(logits, 0.0, 0, 1.0, None)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logp, logits.log_softmax(-1)[[0, 1], [1, 0]])
    tokens, logp = sample_next(logits, 0.0, 0, 1.0, None, banned=torch.tensor([1]))
    assert tokens.tolist() == [2, 0]
    torch.testing.assert_close(logp, logits.log_softmax(-1)[[0, 1], [2, 0]])


def test_seeded_draws_are_reproducible():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(5))
    a = sample_next(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(6))
    b = sample_next(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(6))
    c = sample_next(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_nan_logits_are_an_error():
    logits = torch.zeros(2, 10)
    logits[1, 3] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        sample_next(logits, 1.0, 0, 1.0, None)
