"""Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, Eq. 9; the loss weight ``opsm``,
``algorithm.loss_weights = [{ name = "opsm", params = { threshold = ... } }]``, ``offpolicy.off_policy_sequence_mask``):
hand example, invariants, TRL 1.16's own ``GRPOTrainer.get_off_policy_mask`` on random inputs, and a two-step run where
a small threshold masks negative-advantage rows."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.algorithms.offpolicy import off_policy_sequence_mask
from posttrain.config import ConfigError

# --- (a) hand-computed example ----------------------------------------------------------------------


def test_hand_example():
    # threshold 0.1. KL_i = mean over the response's tokens of log mu - log pi_theta:
    # row 0: mu [-1, -2], pi [-1.05, -2.05] -> (0.05 + 0.05) / 2 = 0.05 <= 0.1, kept (A = -1)
    # row 1: mu [-1, -1], pi [-1.3, -1.3]   -> 0.3 > 0.1 and A = -1: masked
    # row 2: as row 1 but A = +1                                      -> kept (positive advantage)
    # row 3: mu [-1, ·], pi [-1.3, ·] with the second token padding (its 40.0 gap never counts) -> 0.3, A = -1: masked
    # row 4: mu [-1, -1], pi [-1.5, -0.5] -> (0.5 - 0.5) / 2 = 0, kept (the mean, not |.|, as in the paper and TRL)
    mu = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, 40.0], [-1.0, -1.0]])
    pi = torch.tensor([[-1.05, -2.05], [-1.3, -1.3], [-1.3, -1.3], [-1.3, 0.0], [-1.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -1.0])
    keep = off_policy_sequence_mask(pi, mu, adv, mask, threshold=0.1)
    assert keep.shape == (5, 1)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]


# --- (b) invariants ------------------------------------------------------------------------------------


def _random(seed: int, n: int = 16, t: int = 10):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, t, generator=g) * 3
    pi = mu + 0.3 * torch.randn(n, t, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.25).float()
    return pi, mu, torch.randn(n, generator=g), mask, g


def test_never_masks_a_non_negative_advantage_and_grows_with_a_smaller_threshold():
    for seed in range(5):
        pi, mu, adv, mask, g = _random(seed)
        adv[:3] = 0.0  # A = 0 counts as non-negative (TRL's advantages >= 0)
        prev = torch.ones(len(adv), 1)
        for delta in (10.0, 0.1, 0.01, 1e-4):
            keep = off_policy_sequence_mask(pi, mu, adv, mask, threshold=delta)
            assert (keep[adv >= 0] == 1).all()
            assert (keep <= prev).all()  # a smaller delta keeps a subset
            prev = keep
        assert (prev[adv < 0] == 0).any()  # and some negative rows do go
        # on-policy (pi = mu) nothing is masked; NaN sampler log-probs count as no drift
        assert (off_policy_sequence_mask(mu, mu, adv, mask, threshold=1e-6) == 1).all()
        nan_mu = mu.clone()
        nan_mu[:, 0] = float("nan")
        assert torch.isfinite(off_policy_sequence_mask(pi, nan_mu, adv, mask, threshold=0.1)).all()


def test_no_gradient_and_token_advantages_give_a_token_mask():
    pi, mu, _, mask, g = _random(7)
    x = pi.clone().requires_grad_(True)
    adv_NT = torch.randn(pi.shape, generator=g)
    keep = off_policy_sequence_mask(x, mu, adv_NT, mask, threshold=0.01)
    assert keep.shape == pi.shape and not keep.requires_grad
    assert (keep[adv_NT >= 0] == 1).all()


def _opsm(threshold: float) -> str:
    return f'algorithm.loss_weights=[{{name="opsm", params={{threshold={threshold}}}}}]'


def test_threshold_must_be_positive(tiny_cfg):
    with pytest.raises(ConfigError, match=r"loss_weights\[0\]\.params: opsm: threshold must be > 0; got 0"):
        tiny_cfg(_opsm(0))
    assert tiny_cfg(_opsm(0.5)).algorithm.loss_weights[0].params == {"threshold": 0.5}
    assert tiny_cfg().algorithm.loss_weights == []  # off by default, as in TRL


# --- (c) TRL 1.16's own code --------------------------------------------------------------------------


@pytest.mark.parametrize("token_advantages", [False, True])
def test_matches_trl_get_off_policy_mask_on_random_inputs(token_advantages):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    worst, masked = 0.0, 0
    for seed in range(10):
        pi, mu, adv, mask, g = _random(100 + seed)
        mu[seed % 16, 2] = float("nan")  # a token vLLM could not score
        adv_in = torch.randn(pi.shape, generator=g) if token_advantages else adv
        for delta in (0.5, 0.05, 0.005):
            ours = off_policy_sequence_mask(pi, mu, adv_in, mask, threshold=delta)
            theirs = trl_grpo.GRPOTrainer.get_off_policy_mask(
                advantages=adv_in if token_advantages else adv_in[:, None], per_token_logps=pi,
                sampling_per_token_logps=mu, mask=mask, off_policy_threshold=delta,
            )
            assert ours.shape == theirs.shape
            worst = max(worst, float((ours - theirs).abs().max()))
            masked += int((theirs == 0).sum())
    print(f"\nOPSM vs TRL (token advantages {token_advantages}): max abs difference {worst:.3g}, {masked} masked")
    assert worst <= 1e-5 and masked > 0


# --- (d) the real loop --------------------------------------------------------------------------------


def test_a_small_threshold_masks_negative_rows_in_a_run(tiny_cfg, quiet, tmp_path, test_entries, monkeypatch):
    # two minibatches: on the second the policy has moved from the sampler, so a small delta masks some
    # negative-advantage responses; offpolicy/masked_frac reports it; a huge delta masks none; off, no metric
    import posttrain.algorithms.loss_weights as loss_weights
    from posttrain.train.rl import train

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = loss_weights.off_policy_sequence_mask

    def spy(logp, behaviour, adv, mask, *, threshold):
        keep = real(logp, behaviour, adv, mask, threshold=threshold)
        seen.append((adv.detach().clone(), keep.clone()))
        return keep

    monkeypatch.setattr(loss_weights, "off_policy_sequence_mask", spy)

    def run(name: str, *overrides: str) -> list[dict]:
        cfg = tiny_cfg("train.steps=2", "train.minibatches=2", "checkpoint.every=0", "eval.every=0",
                       'reward=[{name="test_length"}]', "train.lr=1e-2", *overrides, out=str(tmp_path / name))
        seen.clear()  # the config's check of the parameters runs the entry on a probe
        train(cfg, console=quiet)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    small = run("small", _opsm(1e-4))
    assert len(seen) == 4 and max(r["offpolicy/masked_frac"] for r in small) > 0
    dropped = 0
    for adv, keep in seen:
        assert (keep[adv >= 0] == 1).all()  # never a non-negative advantage
        dropped += int((keep == 0).sum())
    assert dropped > 0
    huge = run("huge", _opsm(1e3))
    assert all(r["offpolicy/masked_frac"] == 0 for r in huge) and len(seen) == 4
    off = run("off")
    assert "offpolicy/masked_frac" not in off[0]
    assert small[0]["reward/mean"] == off[0]["reward/mean"]  # the same first batch
    assert small[0]["optim/grad_norm"] != pytest.approx(off[0]["optim/grad_norm"], rel=1e-4)
