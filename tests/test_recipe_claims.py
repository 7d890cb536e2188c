"""Each preset does what its paper says: a two-step run on the tiny model shows the signal that sets it apart.

tests/test_recipes.py checks that every preset trains (finite loss); these tests check that a preset's
distinguishing part is live in its own setting, e.g. that Pass@k Training's advantage is not 0 everywhere.
"""

import json
import math
from pathlib import Path

import torch

from posttrain.algorithms import aggregation
from posttrain.config import load_config
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.train import rl
from posttrain.train.parts import Parts

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


def _train(recipe, tmp_path, quiet, *overrides):
    """Train ``recipe`` for 2 steps on the tiny model; return its config and the 2 rows of metrics.jsonl."""
    cfg = load_config(RECIPES / recipe, [
        f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0", "eval.every=0", *overrides,
    ])
    rl.train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    return cfg, rows


def _solved_by_prompt(prompt, completion, **_):
    # every sample of a prompt gets the same pass/fail, so groups are all correct or all wrong: the two homogeneous
    # cases NGRPO treats differently (about half the arithmetic prompts pass)
    return float(sum(map(ord, prompt)) % 2 == 0)


def test_ngrpo_clips_asymmetrically_and_drops_only_all_correct_groups(tmp_path, quiet, monkeypatch):
    # NGRPO (arXiv:2509.18851; the authors' train_qwen2.5-math-7b_ngrpo.sh, catalog 3.22): clip 0.16 / 0.24 and the
    # all_correct filter, which drops groups whose rewards are all max_reward (1.0) and keeps all-wrong ones, where
    # the virtual max-reward sample gives each of G = 4 samples (0 - 0.2) / std_u([0, 0, 0, 0, 1]) = -0.447214.
    monkeypatch.setitem(REWARDS._entries, "test_solved_by_prompt", _solved_by_prompt)
    cfg, seen = _run_recording("ngrpo.toml", tmp_path, quiet, monkeypatch, 'reward=[{name="test_solved_by_prompt"}]')
    a = cfg.algorithm
    assert (a.loss, a.loss_params) == ("ppo_clip", {"eps_low": 0.16, "eps_high": 0.24})
    assert Parts.from_config(cfg).clip_band == (0.16, 0.24)  # the band the loss and its clip_frac metrics use
    assert (a.group_filter, a.kl_coef) == ("all_correct", 0.0)
    rewards = torch.cat([r for r, _, _, _ in seen])
    adv = torch.cat([ad for _, ad, _, _ in seen])
    assert ((rewards == 0).all(dim=1) | (rewards == 1).all(dim=1)).all()
    # no all-correct group reaches the update; the all-wrong ones do, with NGRPO's negative advantage
    assert not (rewards == 1).all(dim=1).any(), "an all-correct group was trained on"
    assert (rewards == 0).all(dim=1).any()
    torch.testing.assert_close(adv, torch.full_like(adv, -0.447214), atol=1e-5, rtol=0)
    # ... and the run logs the filter's effect: about half of the generated groups were dropped
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    print(f"\nkept_frac {[r['selection/kept_frac'] for r in rows]}, gen_batches "
          f"{[r['selection/gen_batches'] for r in rows]}, trained groups {[len(r) for r, _, _, _ in seen]}")
    assert all(0 < r["selection/kept_frac"] < 1 for r in rows)


def test_rgra_averages_the_loss_per_sequence(tmp_path, quiet, monkeypatch):
    # RGRA (arXiv abstract at papers/004_f298e9ec572f7f27.txt:197; catalog L197): L = -(1/G) sum_i (1/|o_i|)
    # sum_t A_i log pi(o_it): each response counts once whatever its length (seq_mean_token_mean), not each token
    # (token_mean), with GRPO advantages and no ratio or clip.
    calls = []
    real = aggregation.reduce

    def spy(mode, loss, mask, **params):
        calls.append((mode, loss.detach().clone(), mask.detach().clone()))
        return real(mode, loss, mask, **params)

    monkeypatch.setattr(aggregation, "reduce", spy)
    cfg, _ = _train("rgra.toml", tmp_path, quiet)
    a = cfg.algorithm
    assert (a.advantage, a.loss, a.aggregation) == ("grpo", "reinforce", "seq_mean_token_mean")
    assert calls and {mode for mode, _, _ in calls} == {"seq_mean_token_mean"}
    # the loss the update took is the mean over responses of each response's token mean
    mode, loss_NT, mask_NT = calls[-1]
    m = mask_NT.to(loss_NT.dtype)
    per_seq = (loss_NT * m).sum(1) / m.sum(1).clamp(min=1)
    expected = per_seq[m.sum(1) > 0].mean()
    torch.testing.assert_close(real(mode, loss_NT, mask_NT), expected)


def test_hint_regularizes_toward_the_reference_with_kl_0_04(tmp_path, quiet, monkeypatch):
    # HINT (arXiv:2510.09388; catalog 3.1 from ViviqwerAsd/HINT lsrl_hint.py): beta = 0.04 on the k3 KL to a frozen
    # reference, in a loss averaged per sequence (GRPO_step's (sum_t l m / sum_t m).mean()). The stand-in verifier
    # gives mixed groups, so the first update moves the policy (the task's gives the untrained model 0 everywhere).
    monkeypatch.setitem(REWARDS._entries, "test_one_in_four", _one_in_four)
    cfg, rows = _train("hint.toml", tmp_path, quiet, 'reward=[{name="test_one_in_four"}]')
    a = cfg.algorithm
    assert (a.kl_coef, a.kl, a.aggregation) == (0.04, "k3", "seq_mean_token_mean")
    assert Parts.from_config(cfg).needs_reference
    kl = [r["policy/kl_ref"] for r in rows]
    print(f"\npolicy/kl_ref {kl}")
    # the reference was read at both steps, and after one update the policy has moved away from it
    assert all(x is not None and math.isfinite(x) for x in kl), f"no KL to a reference was computed: {kl}"  # NaN: null
    assert kl[1] > 0
