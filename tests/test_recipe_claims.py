"""Each preset does what its paper says: a two-step run on the tiny model shows the signal that sets it apart.

tests/test_recipes.py checks that every preset trains (finite loss); these tests check that a preset's
distinguishing part is live in its own setting, e.g. that Pass@k Training's advantage is not 0 everywhere.
"""

import inspect
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import advantages, aggregation, losses, preference
from posttrain.config import load_config
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.train import rl
from posttrain.train.loop_state import Phases
from posttrain.trainers.dpo import dpo_train

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _one_in_four(prompt, completion, **_):
    # a pass/fail stand-in verifier that the untrained tiny model passes about a quarter of the time (the
    # arithmetic task's own verifier gives it 0 everywhere): the hard-problem regime pass@k training targets
    return float(sum(map(ord, completion)) % 4 == 0)


def _record(recipe, tmp_path, quiet, monkeypatch, *overrides):
    """Train ``recipe`` for 2 steps on the tiny model with the stand-in verifier (``overrides`` may replace it);
    return its config, each step's (batch, prepared) as ``rl.prepare`` saw and made them, and the 2 rows of
    metrics.jsonl."""
    monkeypatch.setitem(REWARDS._entries, "test_one_in_four", _one_in_four)
    seen = []
    real = rl.prepare

    def spy(ctx, selector, batch, live, step):
        prep = real(ctx, selector, batch, live, step)
        seen.append((batch, prep))
        return prep

    monkeypatch.setattr(rl, "prepare", spy)
    cfg = load_config(RECIPES / recipe, [
        f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0", "eval.every=0", 'reward=[{name="test_one_in_four"}]',
        *overrides,
    ])
    rl.train(cfg, console=quiet)
    assert len(seen) == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    return cfg, seen, rows


def _run_recording(recipe, tmp_path, quiet, monkeypatch, *overrides):
    """Train ``recipe`` for 2 steps on the tiny model; return each step's (rewards [P, G], advantages [P, G],
    loss mask [N, T] and advantages [N] of the trained rows)."""
    cfg, seen, _ = _record(recipe, tmp_path, quiet, monkeypatch, *overrides)
    return cfg, [(b.rewards_PG, p.adv, p.chosen.mask_NT, p.chosen.adv_N) for b, p in seen]


def _trained(prep):
    """The loss mask [n, T] and token advantages [n, T] of the rows the update trained on (a batch selector's
    minibatches, repeats included; else every row)."""
    c = prep.chosen
    rows = torch.cat(c.minibatches) if c.minibatches is not None else torch.arange(c.mask_NT.shape[0])
    mask = c.mask_NT[rows].float()
    adv = c.adv_N[rows]
    return mask, (adv[:, None].expand_as(mask) if adv.dim() == 1 else adv[:, : mask.shape[1]])


def _signal_share(seen):
    """The share of trained tokens (over both steps) that carry a nonzero advantage."""
    hit = total = 0.0
    for _, prep in seen:
        mask, adv = _trained(prep)
        hit += float((mask * (adv != 0)).sum())
        total += float(mask.sum())
    return hit / total


def _spy(monkeypatch, owner, name):
    """Record every call of ``owner.name`` (its arguments and result, tensors detached and copied) without
    changing what it does; returns the list of (args, kwargs, result)."""
    calls = []
    real = getattr(owner, name)

    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        return x

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((copy(args), copy(kwargs), copy(out)))
        return out

    monkeypatch.setattr(owner, name, spy)
    return calls


def _grpo(r, eps=1e-6):
    """GRPO's advantage with the unbiased std (catalog B1), written out."""
    return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)


def _whiten(x, mask):
    """verl's masked_whiten: (x - mean) / sqrt(var + 1e-8) over the masked entries, unbiased variance."""
    m = mask.bool()
    return (x - x[m].mean()) / torch.sqrt(x[m].var() + 1e-8) * mask


# the base and real-model runs, and mechanisms rather than a paper's method (outside agents, an environment's tools)
NOT_METHODS = {"tiny", "smollm2_math", "reasoning_gym", "textarena_guess", "agent_openai", "agent_json_tools",
               "agent_verifiers", "agent_openai_tools"}


def test_every_preset_states_its_claim_and_has_a_test_here():
    # issue 15: each method preset names, in its header, the paper's claim it stands for (one "# Claim (...):"
    # line, continued on the next comment lines), and a test of this file runs it and checks its signature
    source = Path(__file__).read_text()
    for recipe in sorted(RECIPES.glob("*.toml")):
        if recipe.stem in NOT_METHODS:
            continue
        lines = recipe.read_text().splitlines()
        header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
        claims = [line for line in header if line.startswith("# Claim (")]
        assert len(claims) == 1, f"{recipe.name}: {len(claims)} claim lines in its header"
        assert "arXiv:" in claims[0] or "papers/" in claims[0], f"{recipe.name}: the claim names no paper"
        assert f'"{recipe.name}"' in source, f"{recipe.name}: no test in {Path(__file__).name} runs it"


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
    assert Phases.from_config(cfg).learn.clip_band == (0.16, 0.24)  # the band the loss and its clip_frac metrics use
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
    assert Phases.from_config(cfg).learn.needs_reference
    kl = [r["policy/kl_ref"] for r in rows]
    print(f"\npolicy/kl_ref {kl}")
    # the reference was read at both steps, and after one update the policy has moved away from it
    assert all(x is not None and math.isfinite(x) for x in kl), f"no KL to a reference was computed: {kl}"  # NaN: null
    assert kl[1] > 0


# ---- group baselines: what each estimator subtracts and what it divides by ----


def test_grpo_normalizes_each_group_by_its_std_and_pulls_toward_the_reference(tmp_path, quiet, monkeypatch):
    # GRPO (arXiv:2402.03300; catalog B1): A_i = (r_i - mean) / (std_u + 1e-6), so every group with a spread has
    # advantages of unit std whatever its solve rate; the k3 KL to the frozen start model (beta 0.04) is in the loss.
    cfg, seen, rows = _record("grpo.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.loss, a.aggregation, a.kl, a.kl_coef) == ("grpo", "ppo_clip", "seq_mean_token_mean", "k3",
                                                                      0.04)
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        r = batch.rewards_PG
        torch.testing.assert_close(prep.adv, _grpo(r))
        mixed = r.std(1) > 0
        assert mixed.any()
        torch.testing.assert_close(prep.adv[mixed].std(1), torch.ones(int(mixed.sum())), atol=1e-4, rtol=0)
    kl = [x["policy/kl_ref"] for x in rows]
    print(f"\npolicy/kl_ref {kl}")
    assert abs(kl[0]) < 1e-6 < kl[1]  # the policy starts at the reference, then moves away from it


def test_dr_grpo_centres_without_the_std_and_sums_tokens_over_a_constant(tmp_path, quiet, monkeypatch):
    # Dr.GRPO (arXiv:2503.20783; catalog B2, B6): A_i = r_i - mean (no std division, so a group's scale is its
    # reward spread), and the loss is sum_{i,t} l / L with a constant L (verl: the padded length), not / |o_i|.
    calls = _spy(monkeypatch, aggregation, "reduce")
    cfg, seen, _ = _record("dr_grpo.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.algorithm.advantage, cfg.algorithm.kl_coef) == ("dr_grpo", 0.0)
    assert _signal_share(seen) > 0
    stds = []
    for batch, prep in seen:
        r = batch.rewards_PG
        torch.testing.assert_close(prep.adv, r - r.mean(1, keepdim=True))
        stds += prep.adv[r.std(1) > 0].std(1).tolist()
    print(f"\nstd of the advantages of mixed groups: {sorted(round(x, 3) for x in stds)}")
    assert max(abs(x - 1) for x in stds) > 0.1  # GRPO would make every one of them 1
    assert calls and {args[0] for args, _, _ in calls} == {"seq_mean_token_sum_norm"}
    (mode, loss_NT, mask_NT), _, out = calls[-1]
    torch.testing.assert_close(out, (loss_NT * mask_NT).sum() / loss_NT.shape[-1])


def test_rloo_subtracts_the_mean_of_the_other_samples(tmp_path, quiet, monkeypatch):
    # RLOO (arXiv:2402.14740; catalog B3): A_i = r_i - mean_{j != i} r_j, with a plain REINFORCE loss.
    cfg, seen, _ = _record("rloo.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.algorithm.advantage, cfg.algorithm.loss) == ("rloo", "reinforce")
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        r, G = batch.rewards_PG, batch.rewards_PG.shape[1]
        leave_one_out = (r.sum(1, keepdim=True) - r) / (G - 1)
        torch.testing.assert_close(prep.adv, r - leave_one_out)


def test_reinforce_pp_whitens_group_centred_scores_over_the_batch(tmp_path, quiet, monkeypatch):
    # REINFORCE++ with a group baseline (arXiv:2501.03262; catalog B4): A = whiten(r_i - mean_g r) over every
    # response token of the batch, once, instead of GRPO's per-group std: batch mean 0, batch std 1.
    cfg, seen, _ = _record("reinforce_pp.toml", tmp_path, quiet, monkeypatch)
    assert cfg.algorithm.advantage == "reinforce_pp_baseline"
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        r, mask = batch.rewards_PG, prep.inputs["mask"]
        centred = (r - r.mean(1, keepdim=True))[..., None].expand_as(mask)
        torch.testing.assert_close(prep.adv, _whiten(centred, mask), atol=1e-5, rtol=1e-5)
        m = mask.bool()
        assert abs(float(prep.adv[m].mean())) < 1e-5 and abs(float(prep.adv[m].std()) - 1) < 1e-4


def test_mapo_mixes_the_percent_deviation_in_by_certainty(tmp_path, quiet, monkeypatch):
    # MAPO (arXiv:2509.18849; catalog 3.13): p = share correct, lambda = 1 - 4 p (1 - p),
    # A = (1 - lambda) GRPO + lambda (r - mean) / (mean + 1e-6): GRPO on a 50/50 group, more percent deviation the
    # more certain the group.
    cfg, seen, _ = _record("mapo.toml", tmp_path, quiet, monkeypatch)
    assert cfg.algorithm.advantage == "mapo"
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        r = batch.rewards_PG
        p = (r > 0.5).float().mean(1, keepdim=True)
        lam = 1 - 4 * p * (1 - p)
        mean = r.mean(1, keepdim=True)
        torch.testing.assert_close(prep.adv, (1 - lam) * _grpo(r) + lam * (r - mean) / (mean + 1e-6))
        uneven = (p > 0) & (p < 1) & (p != 0.5)
        assert uneven.any()
        assert (prep.adv - _grpo(r))[uneven[:, 0]].abs().amax(1).min() > 1e-3  # not GRPO there
        torch.testing.assert_close(prep.adv[(p == 0.5)[:, 0]], _grpo(r)[(p == 0.5)[:, 0]])


def test_qae_takes_the_group_quantile_as_baseline_and_zeroes_the_majority(tmp_path, quiet, monkeypatch):
    # QAE (arXiv:2509.22611; catalog 3.24): A = (r - Q_K(r)) / (std_u + 1e-6), K = 0.4. A hard group (1 of 4 right,
    # p <= 1 - K) reinforces only its success, an easy one (3 of 4) only penalizes its failure: the others get 0.
    cfg, seen, _ = _record("qae.toml", tmp_path, quiet, monkeypatch)
    K = cfg.algorithm.advantage_params["quantile"]
    assert K == 0.4
    assert _signal_share(seen) > 0
    gated = 0
    for batch, prep in seen:
        r, adv = batch.rewards_PG, prep.adv
        q = torch.quantile(r, K, dim=1, keepdim=True)
        torch.testing.assert_close(adv, (r - q) / (r.std(1, keepdim=True) + 1e-6))
        c = (r > 0.5).sum(1)
        hard, easy = c == 1, c == r.shape[1] - 1
        assert (adv[hard][r[hard] < 0.5] == 0).all() and (adv[hard][r[hard] > 0.5] > 0).all()
        assert (adv[easy][r[easy] > 0.5] == 0).all() and (adv[easy][r[easy] < 0.5] < 0).all()
        gated += int(hard.sum() + easy.sum())
    print(f"\ngroups with 1 or G-1 correct (most advantages 0 under QAE, none under GRPO): {gated}")
    assert gated > 0


def test_f_grpo_scales_each_group_by_its_failure_rate(tmp_path, quiet, monkeypatch):
    # F-GRPO (arXiv:2602.06717; catalog L165): A' = (1 - p)^gamma GRPO, p the group's share correct: the more a
    # prompt is already solved, the less it moves the policy. gamma is the entry's (a placeholder, see its docstring).
    cfg, seen, _ = _record("f_grpo.toml", tmp_path, quiet, monkeypatch)
    gamma = cfg.algorithm.advantage_params.get(
        "gamma", inspect.signature(advantages.REGISTRY.get("f_grpo")).parameters["gamma"].default)
    assert gamma > 0
    assert _signal_share(seen) > 0
    rates = set()
    for batch, prep in seen:
        r = batch.rewards_PG
        p = (r > 0.5).float().mean(1, keepdim=True)
        torch.testing.assert_close(prep.adv, (1 - p) ** gamma * _grpo(r))
        rates |= set(p[(p > 0) & (p < 1)].tolist())
    print(f"\nsolve rates of mixed groups: {sorted(rates)}")
    assert len(rates) >= 2  # groups of different solve rates got different weights


def test_remax_subtracts_the_greedy_response_reward(tmp_path, quiet, monkeypatch):
    # ReMax (arXiv:2310.10505): A_i = r_i - b, b the reward of the prompt's greedy response (one more decode), not
    # a statistic of the group: a group whose samples agree still learns when the greedy answer scores otherwise.
    cfg, seen, _ = _record("remax.toml", tmp_path, quiet, monkeypatch)
    assert cfg.algorithm.advantage == "remax"
    assert _signal_share(seen) > 0
    off_mean = uniform_signal = 0
    for batch, prep in seen:
        r, b = batch.rewards_PG, prep.inputs["baseline_rewards"]
        assert b.shape == (r.shape[0],)
        torch.testing.assert_close(prep.adv, r - b[:, None])
        assert set(b.tolist()) <= {0.0, 1.0}  # one response's pass/fail, not a group average
        off_mean += int((b != r.mean(1)).sum())
        uniform_signal += int(((r.std(1) == 0) & (prep.adv.abs().amax(1) > 0)).sum())
    print(f"\ngroups whose baseline is not their mean: {off_mean}; uniform groups with a signal: {uniform_signal}")
    assert off_mean > 0


def test_noisy_verifier_weights_each_sample_without_a_baseline(tmp_path, quiet, monkeypatch):
    # Forward correction (arXiv:2510.00915; catalog 3.3; issue 38, D1): each score-function term is weighted by
    # w = rho1 (verifier says 1) or rho1 - 1 (says 0), no baseline; rho1 = 0.2 -> w / (1 - rho1) = [0.25, -1], which
    # is w_reinforce with lam = 0.2 / 0.8 = 0.25. E.g. a group [1, 0, 0, 0] -> [0.25, -1, -1, -1], where RLOO on the
    # same rewards gives [1, -1/3, -1/3, -1/3] and an all-wrong group [0, 0, 0, 0] gives 0 under RLOO but -1 here.
    # The old preset (backward correction under RLOO) was 1 / 0.7 x RLOO: one constant factor, cancelled by Adam
    # and clipping. These advantages are no constant multiple of the uncorrected ones on the same samples.
    cfg, seen, _ = _record("noisy_verifier.toml", tmp_path, quiet, monkeypatch)
    rho1 = 0.2
    assert (cfg.algorithm.advantage, cfg.algorithm.shapers) == ("w_reinforce", [])
    assert cfg.algorithm.advantage_params["lam"] == pytest.approx(rho1 / (1 - rho1))
    assert _signal_share(seen) > 0
    advs, rloos, raws = [], [], []
    for batch, prep in seen:
        raw, G = batch.rewards_PGK.sum(-1), batch.rewards_PG.shape[1]
        w = torch.where(raw > 0.5, torch.tensor(rho1), torch.tensor(rho1 - 1))  # the paper's weights
        torch.testing.assert_close(prep.adv, w / (1 - rho1))
        advs.append(prep.adv.reshape(-1))
        rloos.append((raw - (raw.sum(1, keepdim=True) - raw) / (G - 1)).reshape(-1))  # uncorrected RLOO
        raws.append(raw.reshape(-1))  # uncorrected REINFORCE without a baseline
    adv = torch.cat(advs)
    assert (adv > 0).any() and (adv < 0).any(), "both a correct and a wrong answer are needed to tell a factor"
    for name, unc in (("rloo", torch.cat(rloos)), ("reinforce", torch.cat(raws))):
        c = float(adv @ unc) / max(float(unc @ unc), 1e-12)  # the best constant factor, least squares
        residual = float((adv - c * unc).norm() / adv.norm())
        print(f"\nvs uncorrected {name}: best factor {c:.3f}, relative residual {residual:.3f}")
        assert residual > 0.1, f"the corrected advantages are {c} x the uncorrected {name} ones"


# ---- token-level advantages ----


def _returns(outcome_PG, token_rewards_PGT, mask_PGT):
    """Undiscounted returns G_t = sum_{t' >= t} r_t', with r_t the token rewards plus the outcome on the last
    response token."""
    m = mask_PGT.float()
    last = torch.zeros_like(m)
    last.scatter_(-1, (m.sum(-1, keepdim=True).long() - 1).clamp(min=0), 1.0)
    r_t = (token_rewards_PGT + outcome_PG[..., None] * last) * m
    return r_t.flip(-1).cumsum(-1).flip(-1) * m


def _varies_along_a_response(adv_PGT, mask_PGT):
    """How many responses have token advantages that are not all equal."""
    m = mask_PGT.bool()
    hi = torch.where(m, adv_PGT, torch.full_like(adv_PGT, -torch.inf)).amax(-1)
    lo = torch.where(m, adv_PGT, torch.full_like(adv_PGT, torch.inf)).amin(-1)
    return int(((hi - lo) > 1e-6)[m.any(-1)].sum())


def test_reinforce_pp_kl_puts_the_kl_in_token_rewards_and_whitens_the_returns(tmp_path, quiet, monkeypatch):
    # REINFORCE++ (arXiv:2501.03262; catalog B4): r_t = -beta k1_t on every response token plus the outcome on the
    # last, G_t = sum_{t' >= t} r_t' (gamma 1), whitened over the batch; no critic, no group baseline. At step 1
    # the policy is the reference (k1 = 0); once it has moved, the advantages differ along a response.
    cfg, seen, rows = _record("reinforce_pp_kl.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.kl_reward, a.kl_reward_coef, a.kl_coef) == ("reinforce_pp", "k1", 0.01, 0.0)
    assert _signal_share(seen) > 0
    varying = []
    for batch, prep in seen:
        mask, tr = prep.inputs["mask"], prep.inputs["token_rewards"]
        expected = _whiten(_returns(batch.rewards_PG, tr, mask), mask)
        torch.testing.assert_close(prep.adv, expected, atol=1e-5, rtol=1e-5)
        varying.append(_varies_along_a_response(prep.adv, mask))
    print(f"\nresponses whose token advantages vary: {varying}; kl_reward/kl {[x['kl_reward/kl'] for x in rows]}")
    assert seen[0][1].inputs["token_rewards"].abs().max() < 1e-7 and varying[0] == 0
    assert rows[1]["kl_reward/kl"] != 0 and varying[1] > 0


def test_ppo_gae_advantages_follow_the_critic_along_each_response(tmp_path, quiet, monkeypatch):
    # PPO with GAE (arXiv:1707.06347, 1506.02438; catalog B10), gamma = lam = 1: A_t = sum_l delta_{t+l} = R - V(s_t),
    # whitened over the batch. The critic starts flat (V = 0: every token of a response gets the same advantage);
    # after one update it has learned, so step 2's advantages vary along a response, token by token.
    cfg, seen, rows = _record("ppo.toml", tmp_path, quiet, monkeypatch)
    p = cfg.algorithm.advantage_params
    assert (cfg.algorithm.advantage, p["gamma"], p["lam"], p["whiten"]) == ("gae", 1.0, 1.0, True)
    assert _signal_share(seen) > 0
    varying = []
    for batch, prep in seen:
        mask, values = prep.inputs["mask"], prep.inputs["values"]
        expected = _whiten((batch.rewards_PG[..., None] - values) * mask, mask)
        torch.testing.assert_close(prep.adv, expected, atol=1e-5, rtol=1e-5)
        varying.append(_varies_along_a_response(prep.adv, mask))
    print(f"\nresponses whose token advantages vary: {varying}; critic/value_loss "
          f"{[x['critic/value_loss'] for x in rows]}")
    assert varying[1] > 0
    assert all(math.isfinite(x["critic/value_loss"]) for x in rows)


def test_entropy_adv_adds_a_capped_entropy_bonus_per_token(tmp_path, quiet, monkeypatch):
    # Entropy-based advantage (arXiv:2506.14758; catalog 3.12): A'_t = A + min(alpha H_t, |A| / kappa), H_t the
    # policy's token entropy, alpha 0.4, kappa 2. The cap keeps the sign; where alpha H_t < |A| / kappa the bonus
    # follows the entropy, so advantages differ along a response.
    cfg, seen, _ = _record("entropy_adv.toml", tmp_path, quiet, monkeypatch)
    alpha, kappa = cfg.algorithm.advantage_params["alpha"], cfg.algorithm.advantage_params["kappa"]
    assert (alpha, kappa) == (0.4, 2.0)
    assert _signal_share(seen) > 0

    def check(seen, alpha, kappa):
        varying, capped, total = 0, 0, 0
        for batch, prep in seen:
            mask, H = prep.inputs["mask"], prep.inputs["entropies"]
            A = _grpo(batch.rewards_PG)[..., None].expand_as(mask)
            torch.testing.assert_close(prep.adv, (A + torch.minimum(alpha * H, A.abs() / kappa)) * mask)
            assert (torch.sign(prep.adv) == torch.sign(A) * mask).all()  # never flips a sign
            live = mask.bool() & (A != 0)
            capped += int((alpha * H >= A.abs() / kappa)[live].sum())
            total += int(live.sum())
            varying += _varies_along_a_response(prep.adv, mask)
        return varying, capped, total

    varying, capped, total = check(seen, alpha, kappa)
    # The untrained tiny model is near uniform (H_t ~ 2.9 nats, alpha H_t ~ 1.2 > |A| / 2 <= 0.75): every bonus is
    # the cap |A| / kappa, constant along a response. The preset's per-token part is idle here (recipe header).
    print(f"\npreset: bonus capped on {capped}/{total} signal tokens, responses varying along tokens: {varying}")
    assert capped == total and varying == 0
    # ... with alpha = 0.1 the same run's entropies fall under the cap and the bonus varies token by token
    cfg, seen, _ = _record("entropy_adv.toml", tmp_path / "alpha", quiet, monkeypatch,
                           "algorithm.advantage_params={alpha=0.1, kappa=2.0}")
    varying, capped, total = check(seen, 0.1, 2.0)
    print(f"alpha 0.1: bonus capped on {capped}/{total} signal tokens, responses varying along tokens: {varying}")
    assert varying > 0


def test_canon_compares_the_high_and_low_entropy_halves_of_each_group(tmp_path, quiet, monkeypatch):
    # CANON (arXiv:2509.23962; catalog 3.19), inter_weight mu = 1: sort each group by its responses' mean token
    # entropy; the high half C+ gets r - mean(C-), the low half C- gets r - mean(C+) (which trend pays), divided by
    # nothing (the aggregation's constant plays the authors' L_max). The same rewards split by another metric give
    # other advantages; mu = 0.5 would be Dr.GRPO.
    cfg, seen, _ = _record("canon.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.advantage_metric, a.advantage_params["inter_weight"]) == ("canon", "entropy", 1.0)
    assert _signal_share(seen) > 0

    def canon(r, metric):
        G = r.shape[1]
        order = torch.sort(metric, dim=1, stable=True).indices
        low = torch.zeros_like(r, dtype=torch.bool).scatter(1, order[:, : G // 2], True)
        m_low = (r * low).sum(1, keepdim=True) / low.sum(1, keepdim=True)
        m_high = (r * ~low).sum(1, keepdim=True) / (~low).sum(1, keepdim=True)
        return torch.where(low, r - m_high, r - m_low)

    depends = 0
    for batch, prep in seen:
        r, mask, H = batch.rewards_PG, prep.inputs["mask"], prep.inputs["entropies"]
        m = batch.rollouts.loss_mask.view_as(mask).float()
        torch.testing.assert_close(prep.inputs["metric"], (H * m).sum(-1) / m.sum(-1).clamp(min=1))
        torch.testing.assert_close(prep.adv, canon(r, prep.inputs["metric"]))
        # inter-group comparison is symmetric in which half is high; what matters is the split: regroup by the
        # same values moved one place along each group and the advantages change
        other = canon(r, prep.inputs["metric"].roll(1, dims=1))
        depends += int(((prep.adv - other).abs().amax(1) > 1e-6).sum())
        assert not torch.allclose(prep.adv, r - r.mean(1, keepdim=True))  # not Dr.GRPO
    print(f"\ngroups whose advantages change under another split: {depends}")
    assert depends > 0


def test_aent_moves_its_entropy_coefficient_by_the_clamped_entropy(tmp_path, quiet, monkeypatch):
    # AEnt (arXiv:2509.03493; catalog L219): a bonus -coef H_c on the entropy H_c over the top (1 - clamp_p) of the
    # vocabulary, and coef <- clip(coef - coef_lr (min(0, H_c - low) + max(0, H_c - high)), coef_min, coef_max)
    # after each step (AReaL leaves the first step's alone). On the tiny model H_c ~ 2.6 is far above the band
    # [0.1, 0.5], so the coefficient falls, here to its floor.
    states = []  # the loop's entry_states after each step
    real = rl.advance_all

    def spy(*args):
        states.append(real(*args))
        return states[-1]

    monkeypatch.setattr(rl, "advance_all", spy)
    cfg, seen, rows = _record("aent.toml", tmp_path, quiet, monkeypatch)
    p = cfg.algorithm.entropy_params
    assert cfg.algorithm.entropy == "aent" and p["warmup_steps"] == 0
    assert _signal_share(seen) > 0
    coefs = [st["entropy"]["coef"] for st in states]
    h = rows[1]["entropy/regularized"]
    print(f"\nentropy/coef logged {[x['entropy/coef'] for x in rows]}, after each step {coefs}; H_c {h:.3f}, "
          f"H {rows[1]['policy/entropy']:.3f}")
    assert [x["entropy/coef"] for x in rows] == [p["coef"], p["coef"]] and coefs[0] == p["coef"]
    change = min(0.0, h - p["entropy_low"]) + max(0.0, h - p["entropy_high"])
    expected = min(max(p["coef"] - p["coef_lr"] * change, p["coef_min"]), p["coef_max"])
    assert coefs[1] == pytest.approx(expected) and coefs[1] != p["coef"]
    assert 0 < h < rows[1]["policy/entropy"]  # the clamped entropy leaves the low tail out


# ---- policy losses ----


def _loss_and_grad(name, logp, old, adv, mask, **params):
    """Loss ``name`` on recorded inputs, and its gradient with respect to the log-probs."""
    x = logp.clone().requires_grad_()
    loss = losses.compute(name, x, old, adv, mask, **params)
    return loss.detach(), torch.autograd.grad(loss.sum(), x)[0]


def test_cispo_keeps_the_gradient_of_tokens_ppo_would_clip(tmp_path, quiet, monkeypatch):
    # CISPO (arXiv:2506.13585; catalog B9): l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A log pi_t. On the
    # second (off-policy) minibatch some ratios leave PPO's band; PPO's clip zeroes those tokens' gradient, CISPO's
    # clipped weight keeps it: d l / d log pi_t = -clip(rho_t) A.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("cispo.toml", tmp_path, quiet, monkeypatch)
    calls = list(calls)  # the run's calls (the checks below call the loss again)
    lp = cfg.algorithm.loss_params
    assert (cfg.algorithm.loss, lp["eps_low"], lp["eps_high"], cfg.train.minibatches) == ("cispo", 1.0, 0.2, 2)
    assert _signal_share(seen) > 0
    assert calls and {args[0] for args, _, _ in calls} == {"cispo"}
    outside = 0
    for (_, logp, old, adv, mask), kw, out in calls:
        params = {k: v for k, v in kw.items() if k != "weights"}
        A = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        ratio = torch.exp(logp - old)
        ppo_clips = mask.bool() & (((ratio > 1.2) & (A > 0)) | ((ratio < 0.8) & (A < 0)))
        loss, g = _loss_and_grad("cispo", logp, old, adv, mask, **params)
        torch.testing.assert_close(loss, out)
        torch.testing.assert_close(g, -torch.clamp(ratio, 1 - lp["eps_low"], 1 + lp["eps_high"]) * A * mask)
        _, g_ppo = _loss_and_grad("ppo_clip", logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
        assert (g_ppo[ppo_clips] == 0).all() and (g[ppo_clips] != 0).all()
        outside += int(ppo_clips.sum())
    print(f"\ntokens PPO's 0.2 clip would have dropped, trained by CISPO: {outside}")
    assert outside > 0


def test_gspo_clips_one_sequence_ratio_per_response(tmp_path, quiet, monkeypatch):
    # GSPO (arXiv:2507.18071; catalog B8): s_i = exp(mean_t (log pi_t - log pi_old_t)), one ratio per response,
    # l_it = max(-A s_i, -A clip(s_i, 1 - 3e-4, 1 + 4e-4)): every token of a response has the same loss, and the
    # clip keeps or drops a response's gradient as a whole, where PPO's token ratios would split it.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("gspo.toml", tmp_path, quiet, monkeypatch)
    calls = list(calls)  # the run's calls (the checks below call the loss again)
    lp = cfg.algorithm.loss_params
    assert (cfg.algorithm.loss, lp["eps_low"], lp["eps_high"], cfg.algorithm.aggregation) == (
        "gspo", 3e-4, 4e-4, "seq_mean_token_mean")
    assert _signal_share(seen) > 0
    assert calls and {args[0] for args, _, _ in calls} == {"gspo"}
    kept = dropped = split_by_ppo = 0
    for (_, logp, old, adv, mask), _, out in calls:
        m = mask.float()
        s = torch.exp(((logp - old) * m).sum(1) / m.sum(1).clamp(min=1))
        A = adv if adv.dim() == 1 else adv[:, 0]
        expected = torch.maximum(-A * s, -A * s.clamp(1 - lp["eps_low"], 1 + lp["eps_high"]))
        torch.testing.assert_close(out, expected[:, None] * m)
        _, g = _loss_and_grad("gspo", logp, old, adv, mask, **lp)
        live = (m.sum(1) > 0) & (A != 0)
        on = (g != 0) & mask.bool()
        whole = on.sum(1) == m.sum(1)
        none = on.sum(1) == 0
        assert (whole | none)[live].all()  # all of a response's tokens, or none
        kept += int((whole & live).sum())
        dropped += int((none & live).sum())
        ratio = torch.exp(logp - old)
        ppo_on = mask.bool() & ~(((ratio > 1.2) & (A[:, None] > 0)) | ((ratio < 0.8) & (A[:, None] < 0)))
        split_by_ppo += int((live & (ppo_on.sum(1) > 0) & (ppo_on.sum(1) < m.sum(1))).sum())
    print(f"\nresponses trained whole: {kept}, clipped whole: {dropped}; responses PPO's clip would split: "
          f"{split_by_ppo}")
    assert kept > 0 and dropped > 0


# ---- shaping and what reaches the update ----


def test_dapo_keeps_only_groups_with_a_spread_and_penalizes_only_the_buffer_zone(tmp_path, quiet, monkeypatch):
    # DAPO (arXiv:2503.14476; catalog B7): dynamic sampling drops groups whose (shaped) rewards are all equal and
    # refills the batch from more generation batches, so no kept group has zero advantage; the soft overlong
    # penalty is 0 up to L_max - L_buf tokens and -(L - (L_max - L_buf)) / L_buf * penalty beyond (here 6, 2, 1.0);
    # clip-higher 0.2 / 0.28.
    cfg, seen, rows = _record("dapo.toml", tmp_path, quiet, monkeypatch)
    (shaper,) = cfg.algorithm.shapers
    L_max, buf, pen = shaper.params["max_length"], shaper.params["buffer"], shaper.params["penalty"]
    assert (cfg.algorithm.group_filter, shaper.name, L_max, cfg.rollout.max_new_tokens) == (
        "dynamic_sampling", "overlong", 6, 6)
    assert Phases.from_config(cfg).learn.clip_band == (0.2, 0.28)
    assert _signal_share(seen) > 0
    lengths = []
    for batch, prep in seen:
        r, raw = batch.rewards_PG, batch.rewards_PGK.sum(-1)
        L = batch.rollouts.lengths.view_as(r).float()
        penalty = r - raw
        torch.testing.assert_close(penalty, torch.clamp(-(L - (L_max - buf)) / buf * pen, max=0.0))
        assert (penalty[L <= L_max - buf] == 0).all() and (penalty[L > L_max - buf] < 0).all()
        lengths += L.flatten().tolist()
        assert r.shape[0] == cfg.rollout.prompts_per_step  # the batch was filled
        assert ((r.amax(1) - r.amin(1)) > 0).all() and (prep.adv.abs().amax(1) > 0).all()
    assert min(lengths) <= L_max - buf < max(lengths)  # both sides of the buffer's edge were sampled
    print(f"\nkept_frac {[x['selection/kept_frac'] for x in rows]}, gen_batches "
          f"{[x['selection/gen_batches'] for x in rows]}, adv/zero_group_frac "
          f"{[x['adv/zero_group_frac'] for x in rows]}")
    assert any(x["selection/kept_frac"] < 1 and x["selection/gen_batches"] > 1 for x in rows)  # dropped, refilled
    assert all(x["adv/zero_group_frac"] == 0 for x in rows)


def test_prm_clip_shaped_reward_never_exceeds_the_outcome(tmp_path, quiet, monkeypatch):
    # PRM Clip refinement (arXiv:2410.15115; catalog L149): r' = r + sum_k min(r_k - eta, 0), eta = 0.5, so every
    # step term is <= 0 and repeating steps never pays. The step scores are the arithmetic task's exact step labels
    # (reference_steps, 0 or 1), so each wrong step costs eta.
    cfg, seen, rows = _record("prm_clip.toml", tmp_path, quiet, monkeypatch)
    (shaper,) = cfg.algorithm.shapers
    assert (shaper.name, shaper.params["eta"], cfg.algorithm.step_reward) == ("prm_clip", 0.5, "reference_steps")
    assert _signal_share(seen) > 0
    below = 0
    for batch, prep in seen:
        r, raw = batch.rewards_PG, batch.rewards_PGK.sum(-1)
        assert (r <= raw + 1e-6).all()
        steps_cost = (raw - r) / 0.5  # how many steps fell short
        torch.testing.assert_close(steps_cost, steps_cost.round())
        torch.testing.assert_close(prep.adv, _grpo(r))
        below += int((r < raw).sum())
    print(f"\nresponses whose shaped reward is below the outcome: {below}; step_reward/mean "
          f"{[x['step_reward/mean'] for x in rows]}, steps a response {[x['step_reward/steps_mean'] for x in rows]}")
    assert below > 0 and all(x["step_reward/steps_mean"] > 0 for x in rows)


def test_par_centres_each_reward_on_ten_sampled_references(tmp_path, quiet, monkeypatch):
    # PAR (arXiv:2502.18770; catalog 3.29): r' = (1/M) sum_m sigmoid(k (r - r_ref,m)), k = 1, over M = 10 reference
    # responses sampled from the starting policy (the authors' reward_maxref), not the one demonstration (issue 38,
    # D13). With a 0/1 verifier and references scoring 0 or 1: r = 1, refs with 3 of 10 correct ->
    # (7 sigmoid(1) + 3 sigmoid(0)) / 10 = (7 * 0.731059 + 3 * 0.5) / 10 = 0.661741.
    from posttrain.produce.ref_samples import ReferenceRewards

    refs = []
    real = ReferenceRewards.__call__

    def spy(self, examples, m):
        out = real(self, examples, m)
        refs.append(out)
        return out

    monkeypatch.setattr(ReferenceRewards, "__call__", spy)
    cfg, seen, _ = _record("par.toml", tmp_path, quiet, monkeypatch)
    (shaper,) = cfg.algorithm.shapers
    assert (shaper.name, shaper.params["samples"], shaper.params["k"]) == ("par", 10, 1.0)
    assert len(refs) == 2 and all(r.shape == (cfg.rollout.prompts_per_step, 10) for r in refs)
    for (batch, prep), ref_PM in zip(seen, refs, strict=True):
        raw_PG = batch.rewards_PGK.sum(-1)
        want = torch.sigmoid(raw_PG.unsqueeze(-1) - ref_PM.unsqueeze(1)).mean(-1)  # written out, k = 1
        torch.testing.assert_close(batch.rewards_PG, want)
        assert ((batch.rewards_PG > 0) & (batch.rewards_PG < 1)).all()  # bounded
        torch.testing.assert_close(prep.adv, _grpo(batch.rewards_PG))
    # several references per prompt that disagree: one demonstration could not give a reference spread
    spread = torch.cat(refs).std(-1)
    print(f"\nprompts whose 10 references disagree: {int((spread > 0).sum())} of {spread.numel()}")
    assert (spread > 0).any()
    assert _signal_share(seen) > 0


def test_rest_grpo_drops_flat_groups_and_queues_partial_states(tmp_path, quiet, monkeypatch):
    # ReST-GRPO (arXiv:2508.19576; catalog 3.4): groups with population reward std < 0.05 are dropped; a kept group
    # whose best response scores >= 0.9 queues prompt + prefixes of that response, which the next step samples in
    # place of stream prompts.
    cfg, seen, rows = _record("rest_grpo.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.algorithm.group_filter, cfg.rollout.driver) == ("rest_grpo", "partial_states")
    assert _signal_share(seen) > 0
    for batch, _ in seen:
        assert (batch.rewards_PG.std(1, unbiased=False) >= 0.05).all()
    first, second = (b for b, _ in seen)
    assert (first.rewards_PG.amax(1) >= 0.9).any()
    print(f"\nkept_frac {[x['selection/kept_frac'] for x in rows]}; partial states pushed "
          f"{[x['selection/partial_pushed'] for x in rows]}, queued {[x['selection/partial_queue'] for x in rows]}, "
          f"sampled {[x['selection/partial_groups'] for x in rows]}")
    assert any(x["selection/kept_frac"] < 1 for x in rows)
    assert rows[0]["selection/partial_pushed"] > 0 and rows[0]["selection/partial_queue"] > 0
    assert rows[1]["selection/partial_groups"] > 0
    # a partial state is a step-1 question sampled again after a prefix of its best response
    again = {ex.prompt for ex in first.examples} & {ex.prompt for ex in second.examples}
    assert again


def test_rorecomp_trains_on_short_correct_and_long_wrong_responses(tmp_path, quiet, monkeypatch):
    # RoRecomp (arXiv:2509.25958; catalog L123): GRPO advantages on the whole group, then the update takes the
    # priority batch, correct responses no longer than the median of the group's correct ones and wrong ones no
    # shorter than the median of its wrong ones (a lone correct answer is its own median: kept); the rest goes to
    # the compensation buffer (replayed every 4 steps: not within these 2).
    cfg, seen, rows = _record("rorecomp.toml", tmp_path, quiet, monkeypatch)
    assert cfg.algorithm.batch_selector == "rorecomp"
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        r = batch.rewards_PG
        P, G = r.shape
        L = batch.rollouts.lengths.view(P, G).float()
        trained = torch.cat(prep.chosen.minibatches)
        assert 0 < len(trained) < P * G and len(set(trained.tolist())) == len(trained)
        priority = set()
        for g in range(P):
            right = [i for i in range(G) if r[g, i] > 0]
            wrong = [i for i in range(G) if r[g, i] <= 0]
            for rows_, short in ((right, True), (wrong, False)):
                if rows_:
                    med = statistics.median(float(L[g, i]) for i in rows_)
                    priority |= {g * G + i for i in rows_ if (L[g, i] <= med if short else L[g, i] >= med)}
        assert set(trained.tolist()) == priority
        torch.testing.assert_close(prep.chosen.adv_N[trained], _grpo(r).reshape(-1)[trained])
    print(f"\npriority_frac {[x['selection/priority_frac'] for x in rows]}, buffer "
          f"{[x['selection/buffer_size'] for x in rows]}")
    assert all(x["selection/buffer_size"] > 0 for x in rows)


def test_shuffle_r1_replays_the_most_contrastive_pairs(tmp_path, quiet, monkeypatch):
    # Shuffle-R1 (arXiv:2508.05612; catalog L139): per group of 8, keep the K = int(4 * (1 - 0.5)) = 2 outermost
    # (highest, lowest advantage) pairs, then draw pairs in 8 rounds with P ~ |A_hi| + |A_lo|: strong pairs recur,
    # pairs without signal never appear, and the middle of each group is not trained on.
    cfg, seen, rows = _record("shuffle_r1.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.algorithm.batch_selector, cfg.rollout.group_size) == ("shuffle_r1", 8)
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        P, G = batch.rewards_PG.shape
        adv = prep.adv.reshape(-1)
        drawn = torch.cat(prep.chosen.minibatches).view(-1, 2)
        unique = set(drawn.flatten().tolist())
        assert len(unique) < P * G and len(unique) < drawn.numel()  # a subset, with repeats
        assert (drawn[:, 0] // G == drawn[:, 1] // G).all()  # both of a pair from one group
        assert (adv[drawn[:, 0]].abs() + adv[drawn[:, 1]].abs() > 0).all()
        for hi, lo in drawn.tolist():
            desc = prep.adv[hi // G].sort(descending=True).values
            assert any(adv[hi] == desc[k] and adv[lo] == desc[G - 1 - k] for k in range(2)), (hi, lo)
    print(f"\ntrained rows {[x['selection/train_rows'] for x in rows]}, unique share "
          f"{[x['selection/unique_rows_frac'] for x in rows]}")


def test_hint_rerolls_all_wrong_groups_with_the_hint_and_trains_on_the_question(tmp_path, quiet, monkeypatch):
    # HINT (arXiv:2510.09388; catalog 3.1): a group whose rewards are all 0 is sampled again from question + hint and
    # replaces the original; the update trains its completions on the question alone, so they are off-policy and
    # the Affinity between sampler and learner drops below 1 on that step.
    cfg, seen, rows = _record("hint.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.rollout.driver, cfg.rollout.params().train_prompt) == ("hint_reroll", "question")
    assert _signal_share(seen) > 0
    rerolled = 0
    for (batch, _), row in zip(seen, rows, strict=True):
        for g, re in enumerate(batch.rerolled_P.tolist()):
            sampled, trained = batch.rollouts.prompt_ids[g], batch.prompt_ids[g]
            assert (sampled != trained and len(sampled) > len(trained)) if re else sampled == trained
        rerolled += int(batch.rerolled_P.sum())
        assert row["selection/hint_rerolls"] == int(batch.rerolled_P.sum())
        if batch.rerolled_P.any():
            assert row["policy/affinity"] < 0.99
    print(f"\nre-rolled groups {[x['selection/hint_rerolls'] for x in rows]}, policy/affinity "
          f"{[round(x['policy/affinity'], 4) for x in rows]}")
    assert rerolled > 0


def test_guide_grpo_takes_the_ratio_of_re_rolled_groups_against_the_guided_sampler(tmp_path, quiet, monkeypatch):
    # Guide-GRPO (arXiv:2506.13923; catalog L127): rho_t = pi_theta(o_t | q) / pi_old(o_t | q, h). A re-rolled
    # group's pi_old is the sampler's log-prob with the hint in context, so its ratio on the (on-policy) first
    # update is off 1 by the hint's shift; the other groups' ratio is 1 (sampler = learner up to rounding).
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("guide_grpo.toml", tmp_path, quiet, monkeypatch, "train.minibatches=1",
                           "train.micro_batch_tokens=0")
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    assert (cfg.rollout.driver, cfg.rollout.params().train_prompt, cfg.algorithm.old_logprobs) == (
        "hint_reroll", "question", "behaviour")
    assert _signal_share(seen) > 0 and len(calls) == len(seen)  # one loss call a step: every row, in order
    shifted = 0
    for (batch, _), ((_, logp, old, _, mask), _, _) in zip(seen, calls, strict=True):
        G, m = batch.rollouts.n, mask.bool()
        torch.testing.assert_close(old[m], batch.rollouts.behaviour_logprobs[m])  # pi_old is the sampler's
        for g, re in enumerate(batch.rerolled_P.tolist()):
            rows = slice(g * G, (g + 1) * G)
            gap = float((logp[rows] - old[rows])[m[rows]].abs().max())
            if re:  # sampled after q + h, trained after q: the ratio carries the hint's shift
                assert gap > 0.05
                shifted += 1
            else:
                assert gap < 1e-4
    print(f"\nre-rolled groups whose ratio is taken against the guided sampler: {shifted}")
    assert shifted > 0


def test_a_star_po_regresses_one_sample_per_prompt_onto_r_minus_v_star(tmp_path, quiet, monkeypatch):
    # A*-PO (arXiv:2505.20686; catalog 3.9): V*(x) = beta1 log mean_j exp(r_j / beta1) over 8 reference samples,
    # one online response per prompt with A = r - V*(x) (a group of one, where GRPO's advantage is 0), and the loss
    # (beta2 sum_t log(pi / pi_ref) - A)^2 on every token of the response.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("a_star_po.toml", tmp_path, quiet, monkeypatch)
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    ap = cfg.algorithm.advantage_params
    assert (cfg.rollout.group_size, cfg.algorithm.advantage, ap["beta1"], ap["samples"], cfg.algorithm.loss) == (
        1, "a_star", 0.5, 8, "a_star_po")
    assert _signal_share(seen) > 0
    for batch, prep in seen:
        refs = prep.inputs["reference_rewards"]
        assert refs.shape == (len(batch.examples), 8)
        v_star = 0.5 * torch.log(torch.exp(refs / 0.5).mean(-1))
        torch.testing.assert_close(prep.adv, batch.rewards_PG - v_star[:, None])
    beta = cfg.algorithm.loss_params["beta"]
    assert calls
    for (_, logp, _, adv, mask), kw, out in calls:
        m = mask.float()
        log_ratio = ((logp - kw["ref_logprobs"]) * m).sum(1)
        A = adv if adv.dim() == 1 else (adv * m).sum(1) / m.sum(1).clamp(min=1)
        on = m > 0
        torch.testing.assert_close(out[on], ((beta * log_ratio - A) ** 2)[:, None].expand_as(out)[on])


def test_aapo_momentum_keeps_a_signal_where_the_group_advantage_is_zero(tmp_path, quiet, monkeypatch):
    # AAPO (arXiv:2505.14264; catalog 3.20): A_i = GRPO_i + clamp(r_i - r_ref,i, -0.2, 0.28), r_ref,i the reward of
    # the frozen reference's response in slot i (4 a prompt, one per sample), trained with plain REINFORCE. Where a
    # group's rewards are all equal GRPO's advantage is 0; AAPO's is the margin over the reference wherever the
    # reference's response in that slot scored otherwise.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("aapo_momentum.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.advantage_params["samples"], a.loss) == ("aapo_momentum", cfg.rollout.group_size,
                                                                    "reinforce")
    flat_groups = flat_signal = 0
    for batch, prep in seen:
        r, refs = batch.rewards_PG, prep.inputs["reference_rewards"]
        assert refs.shape == r.shape
        grpo = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
        torch.testing.assert_close(prep.adv, grpo + (r - refs).clamp(-0.2, 0.28))
        flat = (r == r[:, :1]).all(1)  # GRPO's advantage is 0 on these groups
        flat_groups += int(flat.sum())
        flat_signal += int((prep.adv[flat] != 0).any(1).sum())
    print(f"\naapo_momentum: {flat_signal} of {flat_groups} all-equal groups still carry a signal")
    assert flat_groups and flat_signal, "no all-equal group kept a signal from the reference margin"
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    assert calls
    for (_, logp, _, adv, mask), _, out in calls:  # the cross-entropy loss: -A log pi on every token, no ratio
        on = mask > 0
        A = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        torch.testing.assert_close(out[on], (-A * logp)[on])


def test_ppo_hl_gauss_reads_its_values_off_a_histogram_and_fits_it_by_cross_entropy(tmp_path, quiet, monkeypatch):
    # HL-Gauss (arXiv:2403.03950; catalog L187): the critic has 51 logits a token over [-0.5, 1.5]; its head starts at
    # zero, a uniform histogram whose mean is the support's centre, 0.5 (a scalar head starts at V = 0); it is fit by
    # the cross-entropy to each return's Gaussian histogram, which is at least that histogram's entropy (> 0) where
    # a squared error could reach 0.
    from posttrain.algorithms.value import hl_gauss_target

    cfg, seen, rows = _record("ppo_hl_gauss.toml", tmp_path, quiet, monkeypatch, "checkpoint.every=2")
    c = cfg.critic
    assert (cfg.algorithm.advantage, c.head, c.head_params["bins"]) == ("gae", "hl_gauss", 51)
    (batch0, prep0), (_, prep1) = seen
    v0, v1 = prep0.inputs["values"], prep1.inputs["values"]
    mask = prep0.mask_NT.reshape(v0.shape) > 0
    torch.testing.assert_close(v0[mask], torch.full_like(v0[mask], 0.5))  # the uniform histogram's mean
    assert (v1[mask] - 0.5).abs().max() > 1e-4  # one critic step later the histograms have moved
    assert ((v1 >= -0.5) & (v1 <= 1.5)).all()  # an expectation over the support stays inside it
    # the returns of a 0/1 outcome with gamma = lam = 1 are 0 or 1, whose histograms have the same entropy H: the
    # loss (loss_coef 0.5 x the token-mean cross-entropy) cannot go below 0.5 H
    p = hl_gauss_target(torch.tensor(1.0), torch.linspace(-0.5, 1.5, 52), 0.75 * 2 / 51)
    floor = 0.5 * float(-(p * p.clamp(min=1e-30).log()).sum())
    for r in rows:
        assert floor <= r["critic/value_loss"] < math.inf, (r["critic/value_loss"], floor)
        assert r["critic/vf_clipfrac"] == 0  # a classification loss clips nothing
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "critic" / "config.json").read_text())
    assert len(saved["id2label"]) == 51  # the critic is saved with its 51 outputs, and resumes with them


def test_rl_plus_puts_the_demonstration_in_all_wrong_groups_and_raises_its_likelihood(tmp_path, quiet, monkeypatch):
    # RL-PLUS (arXiv:2508.00222; catalog 3.10): the last row of each group is the example's demonstration; the
    # advantage's mean and std come from the on-policy rows only, so where the (untrained) policy gets every sample
    # wrong, its rows get A = 0 and the correct demonstration A = (1 - 0) / (1 + 1e-6) (sigma 0 -> 1): the only
    # signal is the external one. The loss weighs it by r = 2 pi / (pi_old + (pi_old + 1) / 2) and (1 - pi)^0.5;
    # a second epoch over the batch sees the demonstrations' likelihood raised by the first.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, rows = _record("rl_plus.toml", tmp_path, quiet, monkeypatch, 'reward=[{name="task"}]',
                              "train.epochs=2")
    assert (cfg.rollout.driver, cfg.algorithm.advantage, cfg.algorithm.loss) == (
        "external_mix", "grpo_onpolicy_stats", "rl_plus")
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's calls (not the config's 1 x 1 parameter probe)
    assert len(calls) == 4 and {args[0] for args, _, _ in calls} == {"rl_plus"}  # 2 steps x 2 epochs
    for batch, prep in seen:
        ext = batch.external_PG
        assert ext[:, -1].all() and not ext[:, :-1].any()
        wrong = ~batch.correct_PG[:, :-1].any(1)  # groups whose on-policy samples all fail
        assert wrong.any() and batch.correct_PG[:, -1].all()
        torch.testing.assert_close(prep.adv[wrong], torch.tensor([0.0, 0.0, 0.0, 1 / (1 + 1e-6)]).expand(
            int(wrong.sum()), -1))
    raised = []
    for i, ((_, logp, old, adv, mask), kw, out) in enumerate(calls):
        e = kw["external"].bool()
        m = mask.float()
        assert (old[e][m[e] > 0] < 0).all()  # pi_old of the demonstration: the learner's, not the 0 placeholder
        p, p_old = logp.exp(), old.exp()
        A = adv[:, None] if adv.dim() == 1 else adv
        want = -(2 * p / (p_old + 0.5 * (p_old + 1))) * A * (1 - p).sqrt() * m
        torch.testing.assert_close(out[e], want[e])
        if i % 2 == 1:  # the second epoch: the first one's step moved the policy
            raised.append(((logp - old) * m).sum(1)[e])
    raised = torch.cat(raised)
    print(f"\ndemonstration log-likelihood change after one epoch: {[round(x, 4) for x in raised.tolist()]}")
    assert raised.mean() > 0 and (raised > 0).float().mean() >= 0.75


# ---- preference optimization (`posttrain dpo`) ----


def _dpo_record(recipe, tmp_path, quiet, monkeypatch, *overrides):
    """``posttrain dpo`` on ``recipe`` for 2 steps, pairs built from 16 task prompts; returns its config, every
    preference-loss call of the run (args, kwargs, per-pair loss) and the 2 rows of metrics.jsonl."""
    cfg = load_config(RECIPES / recipe, [
        f'out="{tmp_path / "run"}"', "dpo.steps=2", "dpo.eval_every=0", "dpo.prompts_per_refresh=16",
        "log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0", *overrides,
    ])
    calls = _spy(monkeypatch, preference, "compute")
    dpo_train(cfg, console=quiet)
    calls = list(calls)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(calls) == 2
    assert all(r["dpo/pairs"] > 0 and r["optim/grad_norm"] > 0 for r in rows)  # pairs were built and trained on
    return cfg, calls, rows


def _margin(args):
    """h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) of each pair."""
    chosen, rejected, ref_chosen, ref_rejected = args[1:5]
    return (chosen - ref_chosen) - (rejected - ref_rejected)


def test_dpo_raises_the_implicit_reward_margin_of_the_task_pairs(tmp_path, quiet, monkeypatch):
    # DPO (arXiv:2305.18290; catalog B12): L = -log sigmoid(beta h), beta = 0.1. At step 1 the policy is the
    # reference (h = 0, L = log 2); one step on pairs (a correct answer over a sampled wrong one) moves h up.
    cfg, calls, rows = _dpo_record("dpo.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.dpo.loss, cfg.dpo.loss_params["beta"], cfg.dpo.pairs) == ("dpo", 0.1, "task")
    for args, _, out in calls:
        assert args[0] == "dpo"
        torch.testing.assert_close(out, -torch.nn.functional.logsigmoid(0.1 * _margin(args)))
    assert _margin(calls[0][0]).abs().max() < 1e-4 and rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    print(f"\ndpo/reward_margin {[x['dpo/reward_margin'] for x in rows]}, dpo/loss {[x['dpo/loss'] for x in rows]}")
    assert _margin(calls[1][0]).mean() > 0 and rows[1]["dpo/loss"] < rows[0]["dpo/loss"]


def test_ra_dpo_subtracts_the_risk_gap_from_dpo_logit(tmp_path, quiet, monkeypatch):
    # Ra-DPO1 (arXiv:2505.20359; catalog L205): logit = h - (R_l - R_w), R the sequence sum of the CVaR part of the
    # token KL(pi_ref || pi), L = -log sigmoid(beta logit). R = 0 while the policy is the reference (step 1); once
    # it drifts (step 2) the risks are positive and the loss differs from DPO's on the same pairs.
    cfg, calls, rows = _dpo_record("ra_dpo.toml", tmp_path, quiet, monkeypatch)
    d = cfg.dpo
    assert (d.loss, d.loss_params["beta"], d.loss_params["variant"], d.risk_confidence) == ("ra_dpo", 0.1, 1, 0.95)
    for args, kw, out in calls:
        logit = _margin(args) - (kw["rejected_risk"] - kw["chosen_risk"])
        torch.testing.assert_close(out, -torch.nn.functional.logsigmoid(0.1 * logit))
    (_, kw1, _), (args2, kw2, out2) = calls
    assert kw1["chosen_risk"].abs().max() < 1e-6 and kw1["rejected_risk"].abs().max() < 1e-6
    assert (kw2["chosen_risk"] > 0).all() and (kw2["rejected_risk"] > 0).all()
    dpo_loss = -torch.nn.functional.logsigmoid(0.1 * _margin(args2))
    print(f"\nstep 2: Ra-DPO loss {float(out2.mean()):.6f}, DPO's on the same pairs {float(dpo_loss.mean()):.6f}; "
          f"risks {rows[1]['dpo/chosen_risk']:.4f} (chosen) {rows[1]['dpo/rejected_risk']:.4f} (rejected)")
    assert (out2 - dpo_loss).abs().max() > 1e-6


def test_inpo_anchors_each_iteration_to_the_previous_iterate(tmp_path, quiet, monkeypatch):
    # INPO (arXiv:2407.00617; catalog L203): L = (h_t - eta/2)^2, h_t = log pi/pi'(y_w, y_l) - eta tau log
    # pi_ref/pi_ref' - (1 - eta tau) log pi_t/pi_t', pi_t the previous iterate (the policy that sampled the pairs).
    # With a new iteration every step (dpo.refresh_every=1 here; the preset's 20 would keep pi_t = pi_ref for both
    # steps, where INPO is IPO), step 2's anchor is the policy after step 1, not the reference.
    cfg, calls, rows = _dpo_record("inpo.toml", tmp_path, quiet, monkeypatch, "dpo.refresh_every=1")
    eta, tau = cfg.dpo.loss_params["eta"], cfg.dpo.loss_params["tau"]
    assert (cfg.dpo.loss, eta, tau) == ("inpo", 1.0, 0.1)
    for args, kw, out in calls:
        chosen, rejected, ref_chosen, ref_rejected = args[1:5]
        h = ((chosen - rejected) - eta * tau * (ref_chosen - ref_rejected)
             - (1 - eta * tau) * (kw["prev_chosen_logps"] - kw["prev_rejected_logps"]))
        torch.testing.assert_close(out, (h - eta / 2) ** 2, atol=1e-5, rtol=1e-5)
    (args1, kw1, out1), (args2, kw2, out2) = calls
    torch.testing.assert_close(kw1["prev_chosen_logps"], args1[3], atol=1e-4, rtol=0)  # pi_1 = pi_ref
    anchor_gap = (kw2["prev_chosen_logps"] - args2[3]).abs().max()
    torch.testing.assert_close(out1, torch.full_like(out1, eta ** 2 / 4), atol=1e-5, rtol=0)
    print(f"\nstep 2: |log pi_t - log pi_ref| of the chosen up to {float(anchor_gap):.4f}; dpo/loss "
          f"{[x['dpo/loss'] for x in rows]}")
    assert anchor_gap > 1e-3
    chosen, rejected, ref_chosen, ref_rejected = args2[1:5]
    ipo = ((chosen - rejected) - (ref_chosen - ref_rejected) - eta / 2) ** 2  # the same pairs anchored at pi_ref
    assert (out2 - ipo).abs().max() > 1e-4


# ---- rejection-sampling fine-tuning (`posttrain rft`) ----


def test_rft_keeps_verified_samples_and_fine_tunes_the_starting_model_each_round(tmp_path, quiet, monkeypatch):
    # ReST-EM (arXiv:2312.06585): a round keeps the samples the verifier accepts (reward >= 1) and fine-tunes the
    # starting model on them, not the previous round's model: every round's first step starts from the starting
    # weights. tests/trainers/test_rft.py measures the held-out gain from an SFT-warmed model.
    from safetensors.torch import load_file

    from posttrain.trainers import rft as rft_module

    monkeypatch.setitem(REWARDS._entries, "test_one_in_four", _one_in_four)
    starts, real = [], rft_module.sft_update

    def spy(model, optimizer, scheduler, *args):
        if scheduler.last_epoch == 0:  # a round's first step (each round has a fresh schedule)
            starts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return real(model, optimizer, scheduler, *args)

    monkeypatch.setattr(rft_module, "sft_update", spy)
    cfg = load_config(RECIPES / "rft.toml", [
        f'out="{tmp_path / "run"}"', "rft.rounds=2", "rft.prompts_per_round=16", "rft.sft_steps=3", "eval.prompts=8",
        "scoring.workers=0", "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
        "checkpoint.every=0", 'reward=[{name="test_one_in_four"}]',
    ])
    assert (cfg.rft.keep_threshold, cfg.rft.restart_from_base) == (1.0, True)
    rft_module.rft(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kept = [json.loads(x) for x in (tmp_path / "run" / "rft_kept.jsonl").read_text().splitlines()]
    print(f"\nkept {[r['rft/kept'] for r in rows]} of {16 * cfg.rft.samples_per_prompt} samples a round")
    assert all(0 < r["rft/kept"] < 16 * cfg.rft.samples_per_prompt for r in rows)
    assert len(kept) == sum(r["rft/kept"] for r in rows)
    assert all(_one_in_four(k["prompt"], k["completion"]) == 1.0 for k in kept)
    base = load_file(tmp_path / "run" / "base_model" / "model.safetensors")
    assert len(starts) == 2 and all(torch.equal(s[k], base[k]) for s in starts for k in base)


def test_agent_guess_credits_each_turn_of_an_episode_apart(tmp_path, quiet, monkeypatch):
    # TRLOO (KernelGYM): A_{i,k} = G_{i,k} - mean of the other episodes' returns at turn k, so two turns of one
    # episode get different advantages when the episodes reaching each turn differ (GRPO: one number an episode);
    # the environment's replies (turn_ids -1) are never trained
    from posttrain.trainers.sft import sft

    base = [f'out="{tmp_path / "sft"}"', "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
            "sft.steps=40", "sft.eval_every=40", "sft.eval_prompts=16", "checkpoint.every=0"]
    start = sft(load_config(RECIPES / "agent_guess.toml", base), console=quiet)["checkpoint"]
    seen = []
    real = rl.prepare

    def spy(ctx, selector, batch, live, step):
        prep = real(ctx, selector, batch, live, step)
        seen.append((batch, prep))
        return prep

    monkeypatch.setattr(rl, "prepare", spy)
    cfg = load_config(RECIPES / "agent_guess.toml", [
        f'out="{tmp_path / "rl"}"', f'model.path="{start}"', "train.steps=2", "log.progress=false",
        "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0", "eval.every=0", "eval.prompts=16",
    ])
    rl.train(cfg, console=quiet)
    split = 0
    for batch, prep in seen:
        rollouts = batch.rollouts
        adv = prep.adv.reshape(rollouts.token_ids.shape)
        trained = prep.chosen.mask_NT > 0
        assert (adv[rollouts.turn_ids < 0] == 0).all() and (adv[trained] != 0).any()
        for n in range(adv.shape[0]):  # episodes whose turns carry different advantages
            per_turn = {round(float(adv[n][rollouts.turn_ids[n] == k][0]), 6)
                        for k in rollouts.turn_ids[n].unique().tolist()
                        if k >= 0}
            split += len(per_turn) > 1
    assert split > 0


@pytest.mark.slow
def test_agent_calc_answers_with_the_tool_what_it_cannot_without(tmp_path, quiet):
    # the claim: a model that learned to call the calculator solves 4-digit products it cannot do in its head;
    # the same weights with the tool taken away (a call gets "error: no calculator") score about 0.
    # Measured on the full recipe (150 SFT steps, then 60 GRPO steps): 0.65 -> 0.78 with the tool, 0.00 without
    from posttrain.evaluation.sampled import evaluate_samples
    from posttrain.models import load_model, load_tokenizer
    from posttrain.rollout import engine_for
    from posttrain.run.setup import build_task
    from posttrain.trainers.sft import sft

    base = [f'out="{tmp_path / "sft"}"', "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
            "sft.steps=100", "sft.eval_every=100", "sft.eval_prompts=16", "checkpoint.every=0"]
    start = sft(load_config(RECIPES / "agent_calc.toml", base), console=quiet)["checkpoint"]
    scores = {}
    for tool in ("true", "false"):
        cfg = load_config(RECIPES / "agent_calc.toml", [f"task.env.params.tool={tool}", f'model.path="{start}"'])
        task, tok = build_task(cfg), load_tokenizer(start)
        examples = task.examples("test", 48, seed=1)
        engine = engine_for(cfg, load_model(start), tok)
        scores[tool] = evaluate_samples(engine, tok, task, examples, max_new_tokens=cfg.rollout.max_new_tokens).metrics
    assert scores["true"]["pass@1"] >= scores["false"]["pass@1"] + 0.3, scores
    assert scores["false"]["pass@1"] <= 0.05 and scores["true"]["turns_mean"] >= 2  # it calls, then answers


def test_vespo_weights_each_response_by_a_gamma_kernel_of_its_sequence_ratio(tmp_path, quiet, monkeypatch):
    # VESPO (arXiv:2602.10693; TRL's loss_type="vespo"): l_it = -sg(phi(w_i)) A_i log pi_it with
    # w_i = prod_t pi_t / pi_old_t (the whole product, no 1/|y| root as in GSPO) and phi(w) = e^lam w^k e^(-lam w),
    # (k, lam) = (2, 3) for A >= 0 and (3, 2) for A < 0. On the second (off-policy) minibatch every response's
    # gradient is its policy gradient scaled by one smooth factor phi(w_i): never cut to 0 like a clip, and
    # different from what a length-normalized ratio would give.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("vespo.toml", tmp_path, quiet, monkeypatch)
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's calls (not the config's 1 x 1 parameter probe)
    lp = cfg.algorithm.loss_params
    assert (cfg.algorithm.loss, cfg.algorithm.aggregation, cfg.train.minibatches) == ("vespo", "token_mean", 2)
    assert lp == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    assert _signal_share(seen) > 0
    assert calls and {args[0] for args, _, _ in calls} == {"vespo"}
    reweighted = length_matters = 0
    for (_, logp, old, adv, mask), kw, out in calls:
        m = mask.float()
        A = adv if adv.dim() == 1 else adv[:, 0]
        log_w = ((logp - old) * m).sum(1).clamp(math.log(1e-8), 20.0)
        k = torch.where(A >= 0, lp["k_pos"], lp["k_neg"])
        lam = torch.where(A >= 0, lp["lambda_pos"], lp["lambda_neg"])
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        torch.testing.assert_close(out, (-phi * A)[:, None] * logp * m)
        _, g = _loss_and_grad("vespo", logp, old, adv, mask, **{k_: v for k_, v in kw.items() if k_ != "weights"})
        torch.testing.assert_close(g, (-phi * A)[:, None] * m)
        live = (m.sum(1) > 0) & (A != 0)
        assert (phi[live] > 0).all()  # no response is dropped
        reweighted += int((live & ((phi - 1).abs() > 1e-3)).sum())
        log_w_mean = log_w / m.sum(1).clamp(min=1)  # GSPO's length-normalized ratio, in the same kernel
        phi_mean = torch.exp(lam + k * log_w_mean - lam * torch.exp(log_w_mean))
        length_matters += int((live & ((phi - phi_mean).abs() > 1e-3)).sum())
    print(f"\nresponses reweighted by phi(w) != 1: {reweighted}; whose weight the 1/|y| root would change: "
          f"{length_matters}")
    assert reweighted > 0 and length_matters > 0


# ---- reward-model training (`posttrain rm`) ----


def test_rm_trains_a_bradley_terry_reward_model_on_task_pairs(tmp_path, quiet, monkeypatch):
    # InstructGPT's reward model (arXiv:2203.02155, eq. 1): l = -log sigmoid(r(x, y_w) - r(x, y_l)) on pairs of a
    # response the task verifies (or its demonstration) over a sampled wrong one; held-out pairs are scored too.
    from posttrain.trainers import rm, rm_heads

    cfg = load_config(RECIPES / "rm.toml", [
        f'out="{tmp_path / "run"}"', "rm.steps=2", "rm.prompts=16", "rm.eval_prompts=8", "log.progress=false",
        "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0",
    ])
    assert (cfg.rm.debias, cfg.rm.margin, cfg.rm.pairs) == ("none", 0.0, "task")
    calls = _spy(monkeypatch, rm_heads, "bradley_terry")
    rm.rm_train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(calls) == 2
    for (r_w, r_l), kw, out in calls:
        torch.testing.assert_close(out, -torch.nn.functional.logsigmoid(r_w - r_l - kw["margin"]))
    r_w, r_l = calls[0][0]
    assert (r_w - r_l).abs().max() < 0.2 and rows[0]["rm/loss"] == pytest.approx(math.log(2), abs=0.05)  # fresh head
    assert 0 <= rows[-1]["rm/val_accuracy"] <= 1 and (tmp_path / "run" / "reward_model" / "config.json").exists()


def test_rover_regresses_the_log_ratio_onto_the_advantage_plus_the_next_state_term(tmp_path, quiet, monkeypatch):
    # ROVER (arXiv:2509.24981; catalog L227): l_t = (Q_t - sg(A + next_t))^2 with Q_t = log pi_t - log pi_old_t and
    # next_t = m_theta(s_{t+1}) - m_old(s_{t+1}) (m: the mean log-softmax over the vocabulary, 0 at the last token).
    # A batch's first minibatch sees pi_old: Q = 0 and next = 0, so the gradient is -2 A (twice the policy
    # gradient). The later ones see a moved policy: next_t != 0 moves the target off A (what the authors'
    # target_adv_only ablation leaves out), and the gradient 2 (Q - target) pulls each log-ratio toward it.
    from posttrain.algorithms.losses_rover import next_state_term

    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("rover.toml", tmp_path, quiet, monkeypatch)
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's calls (not the config's 1 x 1 parameter probe)
    a, r = cfg.algorithm, cfg.rollout
    assert (a.loss, a.advantage, a.advantage_params["std"], a.aggregation, a.kl_coef) == (
        "rover", "grpo", "unbiased", "token_mean", 0.0)
    assert (r.group_size, r.temperature, cfg.train.minibatches) == (8, 0.6, 4)
    assert _signal_share(seen) > 0
    assert len(calls) == 8 and {args[0] for args, _, _ in calls} == {"rover"}  # 2 steps x 4 minibatches
    moved = 0
    for i, ((_, logp, old, adv, mask), kw, out) in enumerate(calls):
        m = mask.float()
        A = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
        nxt = next_state_term(kw["mean_logsoftmax"], kw["old_mean_logsoftmax"], m)
        target = A + nxt
        torch.testing.assert_close(out, (logp - old - target) ** 2 * m)
        params = {k: v for k, v in kw.items() if k != "weights"}
        _, g = _loss_and_grad("rover", logp, old, adv, mask, **params)
        torch.testing.assert_close(g, 2 * (logp - old - target) * m)
        last = m.sum(1).long() - 1  # each response's last token: next = 0
        live = m.sum(1) > 0
        assert (nxt[live, last[live]] == 0).all()
        if i % 4 == 0:  # a batch's first minibatch: pi_theta = pi_old
            torch.testing.assert_close(g, -2 * A * m, atol=1e-4, rtol=1e-4)
        else:
            moved += int(((nxt.abs() > 1e-6) & mask.bool()).sum())
    print(f"\noff-policy tokens whose target the next-state term moves off A: {moved}")
    assert moved > 0


def test_ref_logit_mix_samples_and_trains_the_mixture_anchored_to_the_reference(tmp_path, quiet, monkeypatch):
    # Logit averaging with a frozen reference (catalog 3.7): pi_mix = softmax((z_theta + z_ref) / 2) is what the
    # engine samples and what the loss's log-probs and ratio are taken under (pi_old on the on-policy update equals
    # the sampler's log-probs), with no KL term. Since z_mix - z_ref = (z_theta - z_ref) / 2 and KL(softmax(z_ref +
    # t d) || pi_ref) is convex in t and 0 at t = 0, KL(pi_mix || pi_ref) <= KL(pi_theta || pi_ref) / 2: the trained
    # policy is anchored to the reference. Checkpoints hold theta alone, a plain model.
    from posttrain.models import load_model

    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("ref_logit_mix.toml", tmp_path, quiet, monkeypatch, "train.minibatches=1",
                           "train.micro_batch_tokens=0", "checkpoint.every=2", "train.lr=3e-3")
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    a = cfg.algorithm
    assert (a.parameterization, a.parameterization_params, a.kl_coef) == ("ref_logit_mix", {"weight": 0.5}, 0.0)
    assert _signal_share(seen) > 0 and len(calls) == len(seen)
    for (batch, _), ((_, _, old, _, mask), _, _) in zip(seen, calls, strict=True):
        m = mask.bool()
        torch.testing.assert_close(old[m], batch.rollouts.behaviour_logprobs[m], atol=1e-5, rtol=0)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    theta, ref = load_model(str(ckpt)), load_model(str(tmp_path / "run" / "base_model"))  # a plain LLaMA each
    batch = seen[-1][0]
    ids = torch.tensor([list(batch.rollouts.prompt_ids[0]) + batch.rollouts.token_ids[0].tolist()])
    with torch.no_grad():
        z_t, z_r = theta(input_ids=ids).logits, ref(input_ids=ids).logits
    z_m = 0.5 * (z_t + z_r)

    def kl(z):  # mean over positions of KL(softmax(z) || pi_ref)
        return float((z.log_softmax(-1).exp() * (z.log_softmax(-1) - z_r.log_softmax(-1))).sum(-1).mean())

    print(f"\nKL to the reference: theta {kl(z_t):.3e}, pi_mix {kl(z_m):.3e}")
    assert kl(z_t) > 1e-6 and kl(z_m) <= 0.5 * kl(z_t) + 1e-9


# ---- TRL's DPO-family losses: a preset each, recipes/dpo_<loss>.toml over dpo.toml ----
# Every preset trains on dpo.toml's task pairs with its seed, so its first step sees the same pairs and batch as plain
# DPO's, with the policy equal to the reference: m_w = m_l = h = 0 on every pair (m = log pi(y) - log pi_ref(y)). There
# each loss has its own value, and (all but apo_down) a gradient in (m_w, m_l) that is one multiple c of DPO's
# (-beta/2, +beta/2) on every pair, so the first step's grad norm (clip_grad_norm_'s, taken before clipping) is |c|
# times DPO's. AdamW's first update is lr g / (|g| + eps), the same for g and c g when c > 0: such a loss moves the
# policy as DPO does at step 1 (h rises on step 2's pairs), c < 0 the other way. From step 2 on the losses differ
# through their formulas, checked on each step's own inputs.

_logsig = torch.nn.functional.logsigmoid


@pytest.fixture(scope="module")
def dpo_first_grad_norm(tmp_path_factory):
    """optim/grad_norm of plain DPO's first step on the pairs `_dpo_record` builds (h = 0 on every pair)."""
    from rich.console import Console

    out = tmp_path_factory.mktemp("dpo_first") / "run"
    cfg = load_config(RECIPES / "dpo.toml", [
        f'out="{out}"', "dpo.steps=1", "dpo.eval_every=0", "dpo.prompts_per_refresh=16", "log.progress=false",
        "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0",
    ])
    dpo_train(cfg, console=Console(quiet=True))
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["optim/grad_norm"]


def _logratios(args):
    """(m_w, m_l): log pi(y) - log pi_ref(y) of each pair's chosen and rejected response."""
    chosen, rejected, ref_chosen, ref_rejected = args[1:5]
    return chosen - ref_chosen, rejected - ref_rejected


def _dpo_loss(args):
    return -_logsig(0.1 * _margin(args))


def _dpo_family(recipe, tmp_path, quiet, monkeypatch, dpo_grad, loss, params, formula, at_zero, slope):
    """``_dpo_record`` on ``recipe`` and what every TRL-loss preset shares: its loss and parameters, each per-pair loss
    of the run equal to ``formula(args)`` on the spied arguments, and at step 1 (pi = pi_ref) the value ``at_zero`` on
    every pair; unless ``slope`` is None (its first gradient is no multiple of DPO's), a first grad norm |slope| times
    plain DPO's and step 2's margin moved the way the sign of ``slope`` says. Returns the calls and metrics rows."""
    cfg, calls, rows = _dpo_record(recipe, tmp_path, quiet, monkeypatch)
    assert (cfg.dpo.loss, cfg.dpo.loss_params, cfg.dpo.pairs) == (loss, params, "task")
    for args, _, out in calls:
        assert args[0] == loss
        torch.testing.assert_close(out, formula(args))
    (args1, _, out1), (args2, _, _) = calls
    assert max(float(m.abs().max()) for m in _logratios(args1)) < 1e-4  # the policy is the reference
    torch.testing.assert_close(out1, torch.full_like(out1, at_zero), atol=1e-4, rtol=1e-5)
    assert rows[0]["dpo/loss"] == pytest.approx(at_zero, abs=1e-4)
    print(f"\n{loss}: dpo/loss {[round(x['dpo/loss'], 6) for x in rows]}, step 2 h mean "
          f"{float(_margin(args2).mean()):.4f}, first grad norm {rows[0]['optim/grad_norm']:.6g} (DPO's {dpo_grad})")
    if slope is not None:
        assert rows[0]["optim/grad_norm"] == pytest.approx(abs(slope) * dpo_grad, rel=1e-3)
        assert math.copysign(1.0, slope) * _margin(args2).mean() > 0
    return calls, rows


def _grads(loss, args, **params):
    """d(sum of the registry's per-pair ``loss``)/d(log pi(y_w)) and /d(log pi(y_l)) at a step's spied inputs."""
    chosen, rejected = args[1].clone().requires_grad_(True), args[2].clone().requires_grad_(True)
    preference.compute(loss, chosen, rejected, args[3], args[4], **params).sum().backward()
    return chosen.grad, rejected.grad


def test_dpo_hinge_starts_at_one_with_twice_dpo_slope_and_is_zero_past_the_margin(
        tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # SLiC-HF's hinge (arXiv:2305.10425; TRL "hinge"): L = relu(1 - beta h), beta = 0.1. At h = 0: relu(1 - 0) = 1
    # (DPO: log 2 = 0.693147); its slope dL/dh is -beta = -0.1 wherever beta h < 1, DPO's at h = 0 is
    # -beta sigmoid(0) = -0.05: the first gradient is 2x DPO's. Where beta h >= 1 (h >= 10) the loss is exactly 0 and
    # the pair stops pulling; in 2 steps on the tiny model h stays far below 10 (printed), so that branch is checked on
    # the pairs that reach it (none here) and with numbers in tests/algorithms/test_preference_trl.py::test_hinge.
    calls, _ = _dpo_family("dpo_hinge.toml", tmp_path, quiet, monkeypatch, dpo_first_grad_norm, "hinge",
                           {"beta": 0.1}, lambda a: torch.relu(1 - 0.1 * _margin(a)), at_zero=1.0, slope=2.0)
    for args, _, out in calls:
        h = _margin(args)
        assert (out[0.1 * h >= 1] == 0).all() and (out[0.1 * h < 1] > 0).all()
    print(f"step 2: max h {float(_margin(calls[1][0]).max()):.4f} (the hinge is 0 from h = 10)")


def test_dpo_robust_is_dpo_minus_the_flip_rate_correction(tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # rDPO (arXiv:2403.00409; TRL "robust"): L = [(1 - e) l(z) - e l(-z)] / (1 - 2e), l(z) = -log sigmoid(z), z = beta h
    # (e = flip_rate 0.1, beta = 0.1). As l(z) - l(-z) = -z, L = l(z) - e/(1 - 2e) z = DPO's loss - 0.125 z. At h = 0 it
    # is DPO's value, (0.9 - 0.1) log 2 / 0.8 = log 2 = 0.693147, with slope dL/dz = -1/2 - 0.125 = -0.625, 1.25x DPO's;
    # at step 2 (h != 0) it departs from DPO's loss on the same pairs by exactly that correction, -0.0125 h.
    def robust(args):
        z = 0.1 * _margin(args)
        return (0.9 * -_logsig(z) - 0.1 * -_logsig(-z)) / 0.8

    calls, _ = _dpo_family("dpo_robust.toml", tmp_path, quiet, monkeypatch, dpo_first_grad_norm, "robust",
                           {"beta": 0.1, "flip_rate": 0.1}, robust, at_zero=math.log(2), slope=1.25)
    for args, _, out in calls:
        torch.testing.assert_close(out - _dpo_loss(args), -0.0125 * _margin(args), atol=1e-6, rtol=1e-3)
    args2, _, out2 = calls[1]
    assert (out2 - _dpo_loss(args2)).abs().max() > 1e-5


def test_dpo_bco_pair_bounds_the_dpo_loss_from_above(tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # BCO (arXiv:2404.04656; TRL "bco_pair", delta = 0): L = -log sigmoid(beta m_w) - log sigmoid(-beta m_l), beta 0.1.
    # The paper's bound: on every pair this binary cross-entropy is at least the DPO loss, since with x = beta m_w,
    # y = beta m_l, sigmoid(x) sigmoid(-y) = 1 / (1 + e^-x + e^y + e^(y - x)) <= 1 / (1 + e^(y - x)) = sigmoid(x - y).
    # At m = 0: -log(1/2) - log(1/2) = 2 log 2 = 1.386294, DPO's log 2 plus a gap of log 2, with DPO's slopes exactly:
    # dL/dm_w = -beta sigmoid(0) = -0.05, dL/dm_l = +0.05 (1x). The paper's running reward shift delta is not kept.
    def bco(args):
        m_w, m_l = _logratios(args)
        return -_logsig(0.1 * m_w) - _logsig(-0.1 * m_l)

    calls, _ = _dpo_family("dpo_bco_pair.toml", tmp_path, quiet, monkeypatch, dpo_first_grad_norm, "bco_pair",
                           {"beta": 0.1, "delta": 0.0}, bco, at_zero=2 * math.log(2), slope=1.0)
    for args, _, out in calls:
        assert (out >= _dpo_loss(args) - 1e-6).all()
    args1, _, out1 = calls[0]
    torch.testing.assert_close(out1 - _dpo_loss(args1), torch.full_like(out1, math.log(2)), atol=1e-4, rtol=0)


def test_dpo_apo_zero_raises_the_chosen_and_lowers_the_rejected_each_on_its_own(
        tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # APO-zero (arXiv:2408.06266, Eq. 7; TRL "apo_zero"): L = (1 - sigmoid(beta m_w)) + sigmoid(beta m_l), beta = 0.1,
    # one term per response, each anchored at m = 0. At m = 0: (1 - 1/2) + 1/2 = 1; slopes dL/dm_w = -beta/4 = -0.025,
    # dL/dm_l = +0.025, 0.5x DPO's. On every step's pairs the chosen's gradient is its own term's,
    # -beta s(beta m_w) s(-beta m_w) < 0 (raise it), and the rejected's +beta s(beta m_l) s(-beta m_l) > 0 (lower it),
    # whatever the other response does; DPO's both hang on h.
    def apo_zero(args):
        m_w, m_l = _logratios(args)
        return (1 - torch.sigmoid(0.1 * m_w)) + torch.sigmoid(0.1 * m_l)

    calls, _ = _dpo_family("dpo_apo_zero.toml", tmp_path, quiet, monkeypatch, dpo_first_grad_norm, "apo_zero",
                           {"beta": 0.1}, apo_zero, at_zero=1.0, slope=0.5)
    for args, _, _ in calls:
        g_w, g_l = _grads("apo_zero", args, beta=0.1)
        s_w, s_l = (torch.sigmoid(0.1 * m) for m in _logratios(args))
        torch.testing.assert_close(g_w, -0.1 * s_w * (1 - s_w))
        torch.testing.assert_close(g_l, 0.1 * s_l * (1 - s_l))
        assert (g_w < 0).all() and (g_l > 0).all()


def test_dpo_apo_down_first_pushes_only_the_rejected_down(tmp_path, quiet, monkeypatch):
    # APO-down (arXiv:2408.06266, Eq. 8; TRL "apo_down"): L = sigmoid(beta m_w) + (1 - sigmoid(beta h)), beta = 0.1. At
    # m = 0: 1/2 + (1 - 1/2) = 1. Slopes there: dL/dm_w = beta/4 - beta/4 = 0 (the anchor term's push down cancels the
    # margin term's pull up) and dL/dm_l = +beta/4 = +0.025, no multiple of DPO's (-0.05, +0.05): the first step lowers
    # only the rejected likelihood. Later dL/dm_w = beta (s'(beta m_w) - s'(beta h)), s' = s(1 - s), and
    # dL/dm_l = beta s'(beta h).
    # That it lowers both likelihoods over training (its claim) takes more than 2 steps.
    def apo_down(args):
        m_w, _ = _logratios(args)
        return torch.sigmoid(0.1 * m_w) + (1 - torch.sigmoid(0.1 * _margin(args)))

    calls, rows = _dpo_family("dpo_apo_down.toml", tmp_path, quiet, monkeypatch, None, "apo_down", {"beta": 0.1},
                              apo_down, at_zero=1.0, slope=None)
    g_w, g_l = _grads("apo_down", calls[0][0], beta=0.1)
    assert g_w.abs().max() < 1e-6
    torch.testing.assert_close(g_l, torch.full_like(g_l, 0.025), atol=1e-6, rtol=0)
    args2 = calls[1][0]
    m_w, _ = _logratios(args2)
    ds = [torch.sigmoid(0.1 * x) * (1 - torch.sigmoid(0.1 * x)) for x in (m_w, _margin(args2))]
    g_w, g_l = _grads("apo_down", args2, beta=0.1)
    torch.testing.assert_close(g_w, 0.1 * (ds[0] - ds[1]))
    torch.testing.assert_close(g_l, 0.1 * ds[1])
    print(f"step 2: chosen {rows[1]['dpo/chosen_logratio']:.4f}, rejected {rows[1]['dpo/rejected_logratio']:.4f}")
    assert rows[1]["dpo/rejected_logratio"] < 0 and _margin(args2).mean() > 0


def test_dpo_discopop_slopes_up_at_zero_so_its_first_step_lowers_the_margin(
        tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # DiscoPOP (arXiv:2406.08414, Eq. 5; TRL "discopop"): z = beta h, w = sigmoid(z / tau),
    # L = (1 - w)(-log sigmoid(z)) + w exp(-z), beta = 0.1, tau = 0.05. At z = 0, w = 1/2: 0.5 log 2 + 0.5 = 0.846574.
    # dL/dz = w (1 - w) / tau (exp(-z) + log sigmoid(z)) - (1 - w) sigmoid(-z) - w exp(-z)
    #       = 0.25 / 0.05 (1 - 0.693147) - 0.25 - 0.5 = 1.534264 - 0.75 = +0.784264 at z = 0,
    # -1.568528 times DPO's -1/2: the blend rises with the margin there (non-convex around 0: a local minimum at
    # z = -0.119, a local maximum at z = 0.072, by a grid search), so the first step lowers h on the pairs where DPO's
    # raises it (test_dpo_raises_the_implicit_reward_margin_of_the_task_pairs).
    def discopop(args):
        z = 0.1 * _margin(args)
        w = torch.sigmoid(z / 0.05)
        return (1 - w) * -_logsig(z) + w * torch.exp(-z)

    _dpo_family("dpo_discopop.toml", tmp_path, quiet, monkeypatch, dpo_first_grad_norm, "discopop",
                {"beta": 0.1, "tau": 0.05}, discopop, at_zero=0.5 * math.log(2) + 0.5, slope=-1.568528)


def _exo_pair(args):  # KL(q || p), q = (s(z), s(-z)), z = beta h, p = (1 - eps, eps) = (0.999, 0.001)
    z = 0.1 * _margin(args)
    return torch.sigmoid(z) * (_logsig(z) - math.log(0.999)) + torch.sigmoid(-z) * (_logsig(-z) - math.log(1e-3))


def _nca_pair(args):
    m_w, m_l = _logratios(args)
    return -_logsig(0.1 * m_w) - 0.5 * _logsig(-0.1 * m_w) - 0.5 * _logsig(-0.1 * m_l)


def _sppo_hard(args):  # targets +-1/(2 beta) = +-5 for the winner's and the loser's own log-ratio
    m_w, m_l = _logratios(args)
    return (m_w - 5) ** 2 + (m_l + 5) ** 2


def _aot_logits(args):  # Delta = sort(d) - sort(d_ref) over the batch, d = log pi(y_w) - log pi(y_l)
    chosen, rejected, ref_chosen, ref_rejected = args[1:5]
    return (chosen - rejected).sort().values - (ref_chosen - ref_rejected).sort().values


def _aot_unpaired_logits(args):  # Delta = sort(m_w) - sort(m_l) over the batch
    m_w, m_l = _logratios(args)
    return m_w.sort().values - m_l.sort().values


@pytest.mark.parametrize(("recipe", "loss", "params", "formula", "at_zero", "slope"), [
    # EXO (arXiv:2402.00856): at z = 0, q = (1/2, 1/2): -log 2 - 0.5 log(0.999 * 0.001) = -0.693147 + 3.454378
    # = 2.761231 (DPO: 0.693147); dL/dz = q_w q_l (log(q_w/p_w) - log(q_l/p_l)) = 1/4 log(0.001/0.999) = -1.726689,
    # 3.453378x DPO's -1/2. Its optimum at beta h = log 999 = 6.9 (DPO's is at infinity) is out of reach in 2 steps.
    pytest.param("dpo_exo_pair.toml", "exo_pair", {"beta": 0.1, "epsilon": 1e-3}, _exo_pair, 2.761231, 3.453378,
                 id="exo_pair"),
    # NCA (arXiv:2402.05369): at m = 0: -log(1/2) - 0.5 log(1/2) - 0.5 log(1/2) = 2 log 2 = 1.386294; dL/dm_w =
    # beta (-sigmoid(0) + 0.5 sigmoid(0)) = -0.025, dL/dm_l = 0.5 beta sigmoid(0) = +0.025: 0.5x DPO's. Its claim (the
    # chosen likelihood does not fall as under DPO) needs many steps: its first update is DPO's (see above).
    pytest.param("dpo_nca_pair.toml", "nca_pair", {"beta": 0.1}, _nca_pair, 2 * math.log(2), 0.5, id="nca_pair"),
    # SPPO hard (arXiv:2405.00675): at m = 0: (0 - 5)^2 + (0 + 5)^2 = 50; dL/dm_w = 2 (0 - 5) = -10, dL/dm_l = +10,
    # 200x DPO's -/+0.05: each response regressed onto its own target, which 2 steps do not reach.
    pytest.param("dpo_sppo_hard.toml", "sppo_hard", {"beta": 0.1}, _sppo_hard, 50.0, 200.0, id="sppo_hard"),
])
def test_dpo_family_preset_starts_at_its_value_at_zero_with_its_slope(
        recipe, loss, params, formula, at_zero, slope, tmp_path, quiet, monkeypatch, dpo_first_grad_norm):
    # the shared shape (section comment above): formula on both steps, value and slope at h = 0, step 2's margin
    _dpo_family(recipe, tmp_path, quiet, monkeypatch, dpo_first_grad_norm, loss, params, formula, at_zero, slope)


@pytest.mark.parametrize(("recipe", "loss", "logits"), [
    # paired: the policy's margins d and the reference's d_ref, each sorted over the batch
    pytest.param("dpo_aot.toml", "aot", _aot_logits, id="aot"),
    # unpaired: the chosen and the rejected log-ratios, each sorted over the batch
    pytest.param("dpo_aot_unpaired.toml", "aot_unpaired", _aot_unpaired_logits, id="aot_unpaired"),
])
def test_dpo_aot_compares_sorted_batches_not_pairs(recipe, loss, logits, tmp_path, quiet, monkeypatch,
                                                   dpo_first_grad_norm):
    # AOT (arXiv:2406.05882; TRL "aot", "aot_unpaired"): L_k = -log sigmoid(beta Delta_k), beta = 0.1, label smoothing
    # 0, Delta_k the k-th quantile difference. At the start d = d_ref and m_w = m_l = 0, so Delta = 0 = h everywhere:
    # DPO's log 2 = 0.693147 and DPO's slope (1x). After one step the policy ranks the pairs differently (paired: the
    # pair with the smallest h, 0.02, drops below three pairs whose reference margins were up to 0.12 under its own;
    # unpaired: chosen and rejected log-ratios rank in unrelated orders), so the quantile logits are not the pairs'
    # margins: as multisets they differ by up to 0.12 (paired) and 0.26 (unpaired) here, where DPO's logits are h.
    calls, _ = _dpo_family(recipe, tmp_path, quiet, monkeypatch, dpo_first_grad_norm, loss,
                           {"beta": 0.1, "label_smoothing": 0.0}, lambda a: -_logsig(0.1 * logits(a)),
                           at_zero=math.log(2), slope=1.0)
    args2 = calls[1][0]
    gap = (logits(args2).sort().values - _margin(args2).sort().values).abs().max()
    print(f"step 2: sorted quantile logits vs sorted margins differ by up to {float(gap):.4f}")
    assert gap > 0.05


def test_ar_grpo_damps_each_token_by_its_sampling_probability(tmp_path, quiet, monkeypatch):
    # Advantage Reweighting (arXiv:2505.12929): w_t = 0.2 pi_old(o_t) + 0.8. The untrained tiny model spreads its
    # probability over its 13 characters, so its tokens sit far below probability 1 and the weights fall well
    # under 1 (about 0.2 * 1/13 + 0.8 = 0.815 for a uniform sampler), spreading with each token's probability
    cfg, seen, rows = _record("ar_grpo.toml", tmp_path, quiet, monkeypatch)
    assert [w.name for w in cfg.algorithm.loss_weights] == ["prob_reweight"]
    for row in rows:
        assert 0.8 <= row["loss_weight/prob_reweight_mean"] < 0.99
    # the logged mean weight is the formula over the first step's own trained tokens: pi_old is the policy that
    # sampled them (one epoch, on-policy), so its probabilities are the sampler's, up to float rounding
    batch, _ = seen[0]
    mask = batch.rollouts.loss_mask > 0
    want = float((0.2 * batch.rollouts.behaviour_logprobs[mask].exp() + 0.8).mean())
    assert rows[0]["loss_weight/prob_reweight_mean"] == pytest.approx(want, abs=1e-3)


def test_rc_grpo_conditions_each_slot_on_its_reward_token_and_trains_on_the_sampled_tokens(tmp_path, quiet,
                                                                                         monkeypatch):
    # RC-GRPO (arXiv:2602.03025; catalog L185): rows 0-1 of each group follow <|high_reward|>, rows 2-3
    # <|low_reward|>; the token opens the response as context (attended, loss mask 0), the advantages are plain
    # GRPO's over the group, and each token's mean reward is logged. That a conditioned policy keeps a spread
    # where the unconditioned one's group agrees (the claim) is tests/produce/test_reward_conditioned.py's
    # test_groups_keep_a_spread_where_unconditioned_samples_all_agree, with a policy that learned the tokens
    # (stage 1, which the tiny model has not had).
    cfg, seen, rows = _record("rc_grpo.toml", tmp_path, quiet, monkeypatch)
    assert (cfg.rollout.driver, cfg.algorithm.advantage) == ("reward_conditioned", "grpo")
    n_hi, n_lo = (len(t) for t in cfg.rollout.driver_params["tokens"])  # the tiny tokenizer spells characters
    for batch, prep in seen:
        r, G = batch.rollouts, batch.rollouts.n
        for i in range(r.token_ids.shape[0]):
            k = n_hi if i % G < G // 2 else n_lo
            assert (r.loss_mask[i, :k] == 0).all() and (r.attention_mask[i, :k] == 1).all()
            assert r.loss_mask[i, k] == 1  # the first sampled token is trained on
        torch.testing.assert_close(prep.adv, advantages.REGISTRY.get("grpo")(batch.rewards_PG))
    assert all("selection/rc_reward_0" in row and "selection/rc_reward_1" in row for row in rows)


def test_a_lol_trains_only_on_positive_advantages_weighted_by_the_clamped_ratio_to_the_reference(tmp_path, quiet,
                                                                                               monkeypatch):
    # A-LoL (arXiv:2305.14718; catalog 3.16): A = r - group mean (dr_grpo, the preset's Monte Carlo V(x)); the loss
    # on each token is -log pi_t x w x max(A, 0), w = clamp(exp(sum_t log pi_theta - log pi_ref), 0.1, 1.9) of the
    # whole response. A response at or below its group's mean gets a loss of exactly 0 (reinforce would push it
    # down); after the first step pi_theta has left pi_ref, so the second step's weights differ from 1.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("a_lol.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.loss, a.loss_params["clip"], a.aggregation) == (
        "dr_grpo", "a_lol", 0.9, "seq_mean_token_sum")
    for batch, prep in seen:
        r = batch.rewards_PG
        torch.testing.assert_close(prep.adv, r - r.mean(1, keepdim=True))
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    assert len(calls) == 2
    negatives = moved = 0
    for (_, logp, _, adv, mask), kw, out in calls:
        m = mask.float()
        A = adv if adv.dim() == 1 else adv[:, 0]
        w = torch.exp(((logp - kw["ref_logprobs"]) * m).sum(1)).clamp(0.1, 1.9)
        torch.testing.assert_close(out, -logp * (w * A.clamp(min=0))[:, None] * m)
        assert (A > 0).any() and (A < 0).any()
        assert (out[A <= 0] == 0).all()
        negatives += int((A < 0).sum())
        moved += int(((w - 1).abs() > 1e-6).sum())
    print(f"\na_lol: {negatives} negative-advantage responses left untrained; {moved} responses with w != 1")
    assert moved > 0  # the second step's policy is no longer the reference


def test_fdiv_grpo_weights_each_token_by_its_implicit_reward_to_the_reference(tmp_path, quiet, monkeypatch):
    # f-GRPO, provisional (arXiv:2602.05946; catalog L179): r_t = beta (log pi_theta - log pi_ref), beta = 0.1;
    # Pearson chi^2: l_t = |A| (-r_t) where A > 0 and |A| (r_t + r_t^2 / 4) elsewhere, token_mean, no clip. The first
    # step's policy is the reference (r = 0: loss 0, gradient -beta A, the policy gradient scaled); after one update
    # r != 0 and a negative row's gradient |A| beta (1 + r / 2) differs from REINFORCE's constant |A|.
    calls = _spy(monkeypatch, losses, "compute")
    cfg, seen, _ = _record("fdiv_grpo.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.advantage, a.loss, a.aggregation, a.kl_coef) == ("grpo", "fdiv_grpo", "token_mean", 0.0)
    assert a.loss_params == {"divergence": "pearson", "beta": 0.1, "gamma": 0.0}
    assert _signal_share(seen) > 0
    calls = [c for c in calls if c[0][1].shape[0] > 1]  # the run's (the config's check calls it on one token)
    assert len(calls) == 2
    moved = []
    for (_, logp, _, adv, mask), kw, out in calls:
        m = mask.float()
        A = (adv[:, None] if adv.dim() == 1 else adv).expand_as(logp)
        r = 0.1 * (logp - kw["ref_logprobs"])
        torch.testing.assert_close(out, A.abs() * torch.where(A > 0, -r, r + r**2 / 4) * m)
        assert (A > 0).any() and (A < 0).any()
        moved.append(float((r.abs() * m).max()))
    print(f"\nfdiv_grpo: max |r| per step {moved}")
    assert moved[0] < 1e-6 < moved[1]  # the start policy is the reference; the update moves it away


def test_rm_fimi_fits_the_length_then_decorrelates_the_reward_from_the_fit(tmp_path, quiet, monkeypatch):
    # FiMi-RM stage 3, provisional (arXiv:2505.12843; catalog 3.27): after the plain-BT warm-up, blocks alternate:
    # the fitting model r_hat = f(len) on -|rho(sg(r), r_hat)|, then the reward model on BT + |rho(r, sg(r_hat))|.
    # Made short here (1 warm-up step, blocks of 2): phases [warm-up, fit, fit, debias, debias]; the fitting model
    # moves only in its block and the debiasing loss is BT plus the |rho| the fitting model's output gives.
    from posttrain.algorithms import reward_fimi
    from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
    from posttrain.seeds import derive_seed
    from posttrain.trainers import rm, rm_heads

    cfg = load_config(RECIPES / "rm_fimi.toml", [
        f'out="{tmp_path / "run"}"', "rm.steps=5", "rm.prompts=16", "rm.eval_prompts=8", "rm.fimi_warmup_steps=1",
        "rm.fimi_every=2", "rm.eval_every=0", "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
        "checkpoint.every=0",
    ])
    d = cfg.rm
    assert (d.debias, d.fimi_mse_coef) == ("fimi", 0.0)
    assert load_config(RECIPES / "rm_fimi.toml", []).rm.fimi_every == 8
    fits = _spy(monkeypatch, rm_heads, "fimi_fit_loss")
    debiases = _spy(monkeypatch, rm_heads, "fimi_reward_loss")
    rm.rm_train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rm/fimi_phase"] for r in rows] == [0, 1, 1, 2, 2]
    assert len(fits) == 5 and len(debiases) == 2  # the fitting loss is logged every step, trained on in its block
    for (r, fitted), _, (loss, bt) in debiases:
        b = r.shape[0] // 2
        torch.testing.assert_close(bt, -torch.nn.functional.logsigmoid(r[:b] - r[b:]).mean())
        torch.testing.assert_close(loss, bt + reward_fimi.pearson(r, fitted).abs())
        assert reward_fimi.pearson(r, fitted).abs() > 0  # a live decorrelation term
    for row, ((r, fitted), _, out) in zip(rows, fits, strict=True):
        torch.testing.assert_close(out, -reward_fimi.pearson(r, fitted).abs())
        if row["rm/fimi_phase"] == 1:
            assert row["rm/loss"] == pytest.approx(float(out), abs=1e-6)
    # the fitting model (kept in the loop state, 6,465 parameters) learned: it left its seeded initialisation
    fitter = load_trainer_state(latest_checkpoint(tmp_path / "run" / "checkpoints"))["loop"]["length_head"]
    start = rm_heads.FiMi(torch.nn.Linear(1, 1), d, derive_seed(cfg.seed, "rm-length-head")).state()
    assert fitter.shape == start.shape == (6465,) and not torch.equal(fitter, start)


def test_shiq_regresses_each_tokens_multi_step_log_ratio_and_logit_level_onto_the_reward(tmp_path, quiet, monkeypatch):
    # ShiQ (arXiv:2505.11081; papers/004_f298e9ec572f7f27.txt:239): the logits are shifted soft Q-values, and the loss
    # is (beta (sum_{k>=t} log pi/pi_ref + V(s_t) - V_ref(s_t)) - R_t)^2 at every token, V = logsumexp of the logits.
    # Its signature in the loop: the frozen reference is held with kl_coef 0 (ref_logprobs, ref_logsumexp); the
    # policy's logsumexp arrives with gradient; a batch's first epoch sees the starting policy = the reference, so
    # the residual is the reward itself (l_t = R^2, the shifted start); the second epoch trains a moved policy whose
    # logit level has left the reference's (D = V - V_ref != 0), which only a loss on the logits' level can see.
    seen = []
    real = losses.compute

    def spy(name, logp, old, adv, mask, **kw):
        out = real(name, logp, old, adv, mask, **kw)
        if logp.shape[0] > 1:  # the run's calls (not the config's 1 x 1 parameter probe)
            seen.append((kw["logsumexp"].requires_grad, logp.detach().clone(), mask.clone(), out.detach().clone(),
                         {k: v.detach().clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}))
        return out

    monkeypatch.setattr(losses, "compute", spy)
    cfg, _, rows = _record("shiq.toml", tmp_path, quiet, monkeypatch)
    a = cfg.algorithm
    assert (a.loss, a.aggregation, a.kl_coef, a.loss_params["beta"], cfg.train.epochs) == (
        "shiq", "seq_mean_token_sum", 0.0, 0.1, 2)
    assert len(seen) == 4 and all(r["train/nonfinite"] == 0 for r in rows)  # 2 steps x 2 epochs
    beta, moved = 0.1, 0.0
    for i, (with_grad, logp, mask, out, kw) in enumerate(seen):
        assert with_grad  # the level of the logits is trained, like the log-probs
        m = mask.float()
        s = ((logp - kw["ref_logprobs"]) * m).flip(-1).cumsum(-1).flip(-1)
        d = kw["logsumexp"] - kw["ref_logsumexp"]
        torch.testing.assert_close(out, (beta * (s + d) - kw["rewards"][:, None]) ** 2 * m)
        if i % 2 == 0:  # a batch's first epoch: the policy that sampled it, and at step 1 the reference itself
            if i == 0:
                torch.testing.assert_close(logp * m, kw["ref_logprobs"] * m, atol=1e-4, rtol=0)
                torch.testing.assert_close(d * m, torch.zeros_like(d), atol=1e-4, rtol=0)
                torch.testing.assert_close(out, kw["rewards"][:, None] ** 2 * m, atol=1e-4, rtol=0)
                assert kw["rewards"].sum() > 0  # a sparse reward to propagate
        else:
            moved = max(moved, float((d.abs() * m).max()))
    print(f"\nlargest |V - V_ref| over the trained tokens of a second epoch: {moved:.4f}")
    assert moved > 1e-3


def test_crf_pays_conciseness_only_on_correct_answers(tmp_path, quiet, monkeypatch):
    # CRF (arXiv:2511.09158; catalog L195): R^ = R^o [1 + alpha c (s + d_q)] with alpha = s = 1, d_q = 0 and the
    # length proxy c = clamp(1 - chars / 8, 0.1, 1). Over the run's rewards: a wrong answer (R^o = 0) gets exactly 0
    # however short, a correct one exactly 1 + c of its own text, in [1.1, 2], above every wrong one
    crf = ('reward=[{name="crf", params={outcome="test_one_in_four", conciseness="conciseness_length", '
           'conciseness_max_chars=8}}]')
    _, seen, rows = _record("crf.toml", tmp_path, quiet, monkeypatch, crf)
    n_right = n_wrong = 0
    for batch, _ in seen:
        for r, text in zip(batch.rewards_PG.reshape(-1).tolist(), batch.scored_texts, strict=True):
            if _one_in_four("", text):
                n_right += 1
                assert r == pytest.approx(1.0 + min(1.0, max(0.1, 1.0 - len(text) / 8)))
            else:
                n_wrong += 1
                assert r == 0.0
    print(f"\nCRF rewards: {n_right} correct answers in [1.1, 2], {n_wrong} wrong ones at exactly 0")
    assert n_right and n_wrong and all(math.isfinite(r["loss"]) for r in rows)


def test_sft_iq_learn_adds_a_td_term_on_the_implied_rewards_to_mle(tmp_path, quiet, monkeypatch):
    # IRL imitation (arXiv:2409.01369; papers/004_f298e9ec572f7f27.txt:147), through `posttrain sft`: the per-token
    # loss is -log pi_t + coef (Q_t - gamma V(s_{t+1}))^2 with Q_t = the chosen logit = log pi_t + V(s_t) and V the
    # logits' logsumexp, which reaches the loss with gradient. What sets it apart from MLE is live: the TD term is
    # > 0 on the demonstration tokens, and it reads the next position's value (0 after a row's last token).
    from posttrain.algorithms import sft_losses
    from posttrain.algorithms.sft_losses import next_value
    from posttrain.trainers.sft import sft

    seen = []
    real = sft_losses.compute

    def spy(name, logp, mask, **kw):
        out = real(name, logp, mask, **kw)
        if logp.shape[0] > 1:  # the trainer's calls (not the config's 1 x 1 parameter probe)
            seen.append((name, kw["logsumexp"].requires_grad, logp.detach().clone(), mask.clone(),
                         kw["logsumexp"].detach().clone(), out.detach().clone()))
        return out

    monkeypatch.setattr(sft_losses, "compute", spy)
    cfg = load_config(RECIPES / "sft_iq_learn.toml", [
        f'out="{tmp_path / "run"}"', "sft.steps=2", "sft.demos=32", "sft.batch_size=8", "sft.eval_every=2",
        "sft.eval_prompts=8", "sft.target_accuracy=1.0", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0",
    ])
    assert (cfg.sft.loss, cfg.sft.loss_params) == ("iq_learn", {"coef": 0.1, "gamma": 1.0})
    sft(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == 2 and len(rows) == 2
    for (name, with_grad, logp, mask, v, out), row in zip(seen, rows, strict=True):
        assert name == "iq_learn" and with_grad
        r = logp + v - next_value(v, mask)
        torch.testing.assert_close(out, (-logp + 0.1 * r**2) * mask)
        td = float((0.1 * r**2 * mask).sum() / mask.sum())
        assert td > 1e-3  # the regularizer is live
        assert row["sft/loss"] == pytest.approx(float(out.sum() / mask.sum()), rel=1e-5)
        last = mask.sum(1).long() - 1
        assert (next_value(v, mask)[torch.arange(len(last)), last] == 0).all()


def test_tf_reward_trains_on_the_teacher_forced_models_step_rewards(tmp_path, quiet, monkeypatch):
    # teacher-forcing-induced reward (arXiv:2210.08708; catalog 3.14): r_t = f(a_t | s_t) - V(s_{t+1}) from the
    # frozen reference's logits f, V = logsumexp f. It is dense (every response token), and a response's return is
    # its log-likelihood under the reference plus V(s_1), a constant of its prompt: at step 1, where the sampler is
    # the reference, sum_t r_t - sum_t log pi_old(y_t) is the same for every response of a group, and differs across
    # prompts. With outcome_coef = 0 the advantages are REINFORCE++ on r alone: the verifier is not read
    cfg, seen, rows = _record("tf_reward.toml", tmp_path, quiet, monkeypatch)
    assert cfg.algorithm.advantage_params["outcome_coef"] == 0.0
    batch, prep = seen[0]
    r_PGT, m_PGT = prep.inputs["induced_rewards"], prep.inputs["mask"].float()
    assert bool(((r_PGT != 0) == (m_PGT > 0)).all())  # a reward on every response token, none on padding
    v1_PG = (r_PGT * m_PGT).sum(-1) - (prep.inputs["logprobs"].float() * m_PGT).sum(-1)
    spread = float((v1_PG - v1_PG.mean(1, keepdim=True)).abs().max())
    print(f"\nV(s_1) per prompt: {[round(x, 3) for x in v1_PG[:, 0].tolist()]}; largest spread in a group {spread:.2e}")
    assert spread < 1e-3 and float(v1_PG[:, 0].std()) > 1e-3
    torch.testing.assert_close(prep.adv, advantages.compute("reinforce_pp", torch.zeros_like(batch.rewards_PG),
                                                            mask=m_PGT, token_rewards=r_PGT))
    assert all(math.isfinite(r["loss"]) for r in rows)
