"""Each preset does what its paper says: a two-step run on the tiny model shows the signal that sets it apart.

tests/test_recipes.py checks that every preset trains (finite loss); these tests check that a preset's
distinguishing part is live in its own setting, e.g. that Pass@k Training's advantage is not 0 everywhere.
"""

import math
from pathlib import Path

import torch

from posttrain.config import load_config
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.train import rl

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _one_in_four(prompt, completion, **_):
    # a pass/fail stand-in verifier that the untrained tiny model passes about a quarter of the time (the
    # arithmetic task's own verifier gives it 0 everywhere): the hard-problem regime pass@k training targets
    return float(sum(map(ord, completion)) % 4 == 0)


def _run_recording(recipe, tmp_path, quiet, monkeypatch, *overrides):
    """Train ``recipe`` for 2 steps on the tiny model; return each step's (rewards [P, G], advantages [P, G],
    loss mask [N, T] and advantages [N] of the trained rows)."""
    monkeypatch.setitem(REWARDS._entries, "test_one_in_four", _one_in_four)
    seen = []
    real = rl.prepare

    def spy(ctx, selector, batch, live, step):
        prep = real(ctx, selector, batch, live, step)
        seen.append((batch.rewards_PG.clone(), prep.adv.clone(), prep.chosen.mask_NT.clone(),
                     prep.chosen.adv_N.clone()))
        return prep

    monkeypatch.setattr(rl, "prepare", spy)
    cfg = load_config(RECIPES / recipe, [
        f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0", "eval.every=0", 'reward=[{name="test_one_in_four"}]',
        *overrides,
    ])
    rl.train(cfg, console=quiet)
    assert len(seen) == 2
    return cfg, seen


def test_passk_trains_on_nonzero_pass_at_k_advantages(tmp_path, quiet, monkeypatch):
    # Pass@k Training (arXiv:2508.10751): a group of n samples with c correct has pass@k rho = 1 - C(n-c, k) / C(n, k)
    # and its samples get (1 - rho) / sigma (correct) and -(c / n) C(n-c-1, k-1) / C(n-1, k-1) / sigma (wrong),
    # sigma = sqrt(rho (1 - rho)). Both are nonzero exactly when 1 <= c <= n - k: a group of n = k (the old preset,
    # k = 4 with tiny's group of 4) has rho in {0, 1} and trains on nothing. E.g. n = 8, c = 2, k = 4:
    # rho = 1 - 15/70 = 0.785714, A_pos = 0.522232, A_neg = -0.174077 (catalog 3.18).
    cfg, seen = _run_recording("passk.toml", tmp_path, quiet, monkeypatch)
    k, n = cfg.algorithm.advantage_params["k"], cfg.rollout.group_size
    rewards = torch.cat([r for r, _, _, _ in seen])
    adv = torch.cat([a for _, a, _, _ in seen])
    # a nonzero share of samples and of trained tokens carries a nonzero advantage
    sample_share = float((adv != 0).float().mean())
    trained = sum(float((m * (a != 0).reshape(a.shape[0], -1)).sum()) for _, _, m, a in seen)
    token_share = trained / sum(float(m.sum()) for _, _, m, _ in seen)
    c = (rewards > 0.5).sum(dim=1)
    informative = (c >= 1) & (c <= n - k)  # the groups pass@k has a gradient for
    print(f"\npass@{k}, group {n}: nonzero advantages on {sample_share:.3f} of samples, {token_share:.3f} of trained "
          f"tokens; groups with 1..{n - 1} correct: {int(((c >= 1) & (c < n)).sum())}/{len(c)}, "
          f"with 1..{n - k}: {int(informative.sum())}/{len(c)}")
    assert sample_share > 0 and token_share > 0, f"pass@{k} with a group of {n} trains on nothing"
    # groups with some correct answers get nonzero advantages: every sample of a group with 1..n-k correct,
    # correct ones up, wrong ones down
    assert informative.any(), f"no group with 1..{n - k} correct of {n}: correct counts {c.tolist()}"
    assert (adv[informative] != 0).all()
    assert (adv[informative][rewards[informative] > 0.5] > 0).all()
    assert (adv[informative][rewards[informative] <= 0.5] < 0).all()
    # ... with the analytic values (checked for each correct count seen)
    for ci in c[informative].unique().tolist():
        rho = 1 - math.comb(n - ci, k) / math.comb(n, k)
        sigma = math.sqrt(rho * (1 - rho))
        a_pos = (1 - rho) / (sigma + 1e-6)
        a_neg = (1 - rho - math.comb(n - ci - 1, k - 1) / math.comb(n - 1, k - 1)) / (sigma + 1e-6)
        group = adv[c == ci]
        expected = torch.where(rewards[c == ci] > 0.5, a_pos, a_neg)
        torch.testing.assert_close(group, expected.to(group.dtype), atol=1e-5, rtol=1e-5)
    # the groups pass@k ignores (none correct, or fewer than k wrong so that pass@k = 1 surely) get 0
    assert (adv[~informative] == 0).all()
