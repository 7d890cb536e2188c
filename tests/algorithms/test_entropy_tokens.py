"""80/20 (arXiv:2506.01939): the policy loss only on the batch's high-entropy tokens (the loss weight
``top_entropy``, ``algorithm.loss_weights = [{ name = "top_entropy", params = { rho = 0.2 } }]``)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.algorithms.selection.entropy_tokens import high_entropy_mask


def test_hand_computed_mask():
    # masked entropies [0.1, 0.5, 0.9] (the 0.3 is padding); their 0.5 quantile is 0.5: keep 0.5 and 0.9
    h = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert high_entropy_mask(h, m, 0.5).tolist() == [[0.0, 1.0, 1.0, 0.0]]
    # rho = 0.2 over [0.1, 0.5, 0.9]: quantile(0.8) = 0.5 + 0.6 * (0.9 - 0.5) = 0.74 -> only 0.9
    assert high_entropy_mask(h, m, 0.2).tolist() == [[0.0, 0.0, 1.0, 0.0]]
    assert high_entropy_mask(h, m, 1.0).tolist() == [[1.0, 1.0, 1.0, 0.0]]  # every masked token
    with pytest.raises(ValueError, match=r"top_entropy: rho must be in \(0, 1\]"):
        high_entropy_mask(h, m, 0.0)


def test_invariants_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    h = torch.rand(16, 40, generator=gen)
    m = (torch.rand(16, 40, generator=gen) > 0.3).float()
    for rho in (0.1, 0.2, 0.5, 0.8):
        keep = high_entropy_mask(h, m, rho)
        assert (keep <= m).all()  # never outside the loss mask
        share = float(keep.sum() / m.sum())
        assert abs(share - rho) < 0.02  # the top-rho share of the tokens (distinct entropies)
        assert h[keep.bool()].min() >= h[(m - keep).bool()].max()  # every kept token above every dropped one


def test_a_run_trains_on_the_high_entropy_fifth(tiny_cfg, quiet, tmp_path, test_entries):
    # the same seed with top_entropy (rho = 0.2) and without it: the first batch is the same (same samples, same
    # rewards), the update differs: a fifth of the tokens carry the policy gradient
    from posttrain.train.rl import train

    def run(name: str, *weights: str) -> list[dict]:
        cfg = tiny_cfg(*weights, "train.steps=2", "checkpoint.every=0",
                       "eval.every=0", "eval.prompts=4", 'reward=[{name="test_length"}]', out=str(tmp_path / name))
        train(cfg, console=quiet)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    fifth = run("fifth", 'algorithm.loss_weights=[{name="top_entropy", params={rho=0.2}}]')
    every = run("every")
    assert all(0.15 < r["policy/entropy_kept_frac"] < 0.3 and r["optim/grad_norm"] > 0 for r in fifth), fifth
    assert all(r["loss_weight/top_entropy_mean"] == pytest.approx(r["policy/entropy_kept_frac"]) for r in fifth)
    assert "policy/entropy_kept_frac" not in every[0]
    assert fifth[0]["reward/mean"] == every[0]["reward/mean"]
    assert fifth[0]["optim/grad_norm"] != pytest.approx(every[0]["optim/grad_norm"], rel=1e-3)


def test_rorecomp_replay_and_the_entropy_mask_are_refused_together(tiny_cfg):
    with pytest.raises(ValueError, match=r"'rorecomp' replays stored rows, and algorithm.loss_weights\[0\] = "
                                         r"'top_entropy' keeps per-row state they lose"):
        tiny_cfg('algorithm.loss_weights=[{name="top_entropy"}]', "algorithm.batch_selector=rorecomp")
