import math

import pytest
import torch

from posttrain.diagnostics import entropy_stats, token_entropies


def test_uniform_policy_has_entropy_log_v():
    logits = torch.zeros(3, 4, 7)  # uniform over V = 7 everywhere
    mask = torch.ones(3, 4)
    stats = entropy_stats(logits, mask)
    assert stats["entropy_mean"] == pytest.approx(math.log(7), abs=1e-6)
    assert stats["entropy_top_mean"] == pytest.approx(math.log(7), abs=1e-6)


def test_top_q_mean_and_mask():
    ninf = float("-inf")
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [5.0, ninf, ninf, ninf], [0.0, ninf, ninf, ninf]],
            [[1.0, ninf, ninf, ninf], [2.0, ninf, ninf, ninf], [0.0, 0.0, 0.0, 0.0]],
        ]
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last (uniform) position is padding
    # entropies on the 5 masked tokens: [log 4, 0, 0, 0, 0]
    # mean = log 4 / 5; top 20 %: ceil(0.2 * 5) = 1 token -> log 4
    stats = entropy_stats(logits, mask, top_q=0.2)
    assert stats["entropy_mean"] == pytest.approx(math.log(4) / 5, abs=1e-6)
    assert stats["entropy_top_mean"] == pytest.approx(math.log(4), abs=1e-6)
    # top 50 %: ceil(2.5) = 3 tokens -> (log 4 + 0 + 0) / 3
    assert entropy_stats(logits, mask, top_q=0.5)["entropy_top_mean"] == pytest.approx(math.log(4) / 3, abs=1e-6)


def test_chunking_does_not_change_values():
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16)
    torch.testing.assert_close(token_entropies(logits, chunk_tokens=2), token_entropies(logits))
    p = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(token_entropies(logits), -(p * p.log()).sum(-1))


def test_empty_mask_gives_nan_and_bad_q_raises():
    stats = entropy_stats(torch.zeros(1, 2, 3), torch.zeros(1, 2))
    assert math.isnan(stats["entropy_mean"]) and math.isnan(stats["entropy_top_mean"])
    with pytest.raises(ValueError):
        entropy_stats(torch.zeros(1, 2, 3), torch.ones(1, 2), top_q=0.0)
