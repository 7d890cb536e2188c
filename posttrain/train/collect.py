"""Steps 1-3 of the loop: prompts -> rollouts -> rewards, shaped and filtered into a training batch."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from posttrain.config import Config
from posttrain.models.load import encode_chat
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rewards.steps import score_steps
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams, concat_rollouts
from posttrain.tasks.base import Example, Task
from posttrain.train import partial
from posttrain.train.hint import hint_reroll
from posttrain.train.parts import Parts
from posttrain.train.setup import derive_seed


@dataclass
class Batch:
    """One step's training batch: P kept groups and what it took to collect them."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    comps: Rollout
    rewards_PG: Tensor  # the weighted sum of the components, shaped
    rewards_PGK: Tensor  # each component times its weight, unshaped
    valid_PG: Tensor
    correct_PG: Tensor  # the task's verifier said correct (accuracy), for the group diagnostics
    rerolled_P: Tensor  # bool [P]: HINT re-rolled the group with its hint
    partial_queue: list[dict]  # ReST-GRPO's queued partial states after this step (train/partial.py)
    baseline_P: Tensor | None  # reward of each prompt's greedy response (ReMax), when the estimator needs it
    metrics: dict[str, float]
    failures: list[dict]  # reward calls that failed (error, timeout, crash, NaN), with their samples
    consumed: int  # prompts taken from the data stream
    generate_s: float
    reward_s: float
    gen_tokens: int


def collect(
    task: Task,
    tokenizer: object,
    engine: RolloutEngine,
    sampling: SamplingParams,
    rewards: list[tuple[str, dict]],
    weights_K: Tensor,
    parts: Parts,
    cfg: Config,
    step: int,
    cursor: int,
    pool: RewardPool | None = None,
    shaper_states: list[object | None] | None = None,
    partial_queue: list[dict] | None = None,
) -> Batch:
    """Generate, score, shape and filter until ``prompts_per_step`` groups pass the group filter or
    ``rollout.max_gen_batches`` generation batches are spent.

    With the default filter (``none``) this is one generation batch. With ``dynamic_sampling`` and
    ``max_gen_batches > 1`` it is DAPO's dynamic sampling (arXiv:2503.14476): groups whose rewards
    are all equal carry no signal and are replaced by fresh ones. Prompts are a deterministic
    function of the data cursor and sampling of ``(seed, step, batch)``, so resume replays nothing.
    Metrics describe every generated sample (the policy), not only the kept ones. With
    ``rollout.hint_reroll`` (HINT) all-wrong groups are sampled again with a hint and replaced before
    shaping and filtering (``train/hint.py``): ``accuracy`` and ``reward/<name>/*`` still describe the
    policy's own samples, ``reward/mean`` the groups that go on (re-rolled ones included).
    With ``rollout.partial_states`` (ReST-GRPO) queued partial states take the place of some
    stream prompts and eligible groups queue new ones (``train/partial.py``).
    """
    P = cfg.rollout.prompts_per_step
    kept_ex: list[Example] = []
    kept_ids: list[list[int]] = []
    kept_comps, kept_r, kept_rk, kept_valid, kept_ok, kept_base, all_metrics, failures = [], [], [], [], [], [], [], []
    kept_rerolled = []
    queue = list(partial_queue or [])
    partial_used, partial_pushed = 0, 0
    consumed, gen_s, reward_s, gen_tokens, n_batches, n_groups = 0, 0.0, 0.0, 0, 0, 0
    while len(kept_ex) < P and n_batches < cfg.rollout.max_gen_batches:
        t0 = time.perf_counter()
        taken, queue = partial.take(queue, cfg) if cfg.rollout.partial_states else ([], queue)
        n_stream = P - len(taken)  # the rest come from the data stream
        stream = draw_prompts(task, n_stream, cfg.seed, cursor + consumed) if n_stream else []
        examples = [*stream, *(partial.item_example(it) for it in taken)]
        prefixes = [""] * n_stream + [it["prefix"] for it in taken]
        prompt_ids = [
            encode_chat(tokenizer, ex.prompt, cfg.task.system_prompt) + partial.prefix_ids(tokenizer, pre)
            for ex, pre in zip(examples, prefixes, strict=True)
        ]
        comps = engine.generate(prompt_ids, sampling, seed=derive_seed(cfg.seed, "sample", step, n_batches))
        scored = partial.with_prefixes(comps, prefixes)  # what rewards see: prefix + continuation
        base_P = None
        if parts.needs_baseline_rewards:  # ReMax: one greedy response per prompt, scored like the samples
            greedy = engine.generate(prompt_ids, replace(sampling, n=1, temperature=0.0))
            base_PK, _, _, _, base_failed = score(rewards, task, examples, greedy, cfg, pool)
            base_P = (base_PK * weights_K).sum(-1)[:, 0]
            failures += base_failed
        t1 = time.perf_counter()
        rewards_PGK, valid_PG, correct_PG, metrics, failed = score(rewards, task, examples, scored, cfg, pool)
        failures += failed
        rewards_PGK = rewards_PGK * weights_K
        train_ids = prompt_ids  # what the update trains on (HINT's re-rolled groups may differ)
        rerolled_P = torch.zeros(P, dtype=torch.bool)
        if cfg.rollout.hint_reroll:  # HINT: all-wrong groups sampled again with the hint (train/hint.py)
            re = hint_reroll(cfg, tokenizer, engine, sampling, examples, prompt_ids, comps, rewards_PGK, valid_PG,
                             correct_PG, lambda exs, c: score(rewards, task, exs, c, cfg, pool), weights_K, step,
                             n_batches)
            comps, rewards_PGK, valid_PG, correct_PG, train_ids, rerolled_P = (
                re.comps, re.rewards_PGK, re.valid_PG, re.correct_PG, re.train_ids, re.rerolled_P
            )
            scored = comps  # no prefixes: partial states and the re-roll do not mix (config)
            metrics |= re.metrics
            failures += re.failures
            gen_tokens += re.discarded_tokens
            t1 += re.generate_s  # the re-roll's sampling counts as generation time
        rewards_PG = rewards_PGK.sum(-1)
        if cfg.rollout.partial_states:  # ReST-GRPO: eligible base groups queue partial states
            queue, pushed = partial.push(queue, examples, prefixes, scored.texts, rewards_PG, cfg, step, n_batches)
            partial_used, partial_pushed = partial_used + len(taken), partial_pushed + pushed
        lengths_PG = comps.lengths.view(P, -1).float()
        ref_P1 = reference_rewards(rewards, weights_K, task, examples, pool) if parts.needs_ref_rewards else None
        steps = step_rewards(parts.step_reward, task, examples, scored, metrics) if parts.step_reward else {}
        for shaper, st in zip(parts.shapers, shaper_states or [None] * len(parts.shapers), strict=True):
            rewards_PG = shaper(rewards_PG, lengths=lengths_PG, ref_rewards=ref_P1, state=st, **steps)
        valid = rewards_PG[valid_PG]
        metrics["reward/mean"] = float(valid.mean()) if valid.numel() else float("nan")
        metrics["reward/std"] = float(valid.std()) if valid.numel() > 1 else 0.0
        keep = parts.group_filter(rewards_PG).tolist()
        reward_s += time.perf_counter() - t1
        gen_s += t1 - t0
        consumed += n_stream
        n_batches += 1
        n_groups += P
        gen_tokens += comps.num_tokens
        all_metrics.append(metrics)
        groups = [g for g in range(P) if keep[g]][: P - len(kept_ex)]
        if not groups and n_batches == cfg.rollout.max_gen_batches and not kept_ex:
            groups, valid_PG = list(range(P)), torch.zeros_like(valid_PG)  # nothing passed: train on nothing
        kept_ex += [examples[g] for g in groups]
        kept_ids += [train_ids[g] for g in groups]
        kept_comps.append(comps.select_groups(groups))
        kept_r.append(rewards_PG[groups])
        kept_rk.append(rewards_PGK[groups])
        kept_valid.append(valid_PG[groups])
        kept_ok.append(correct_PG[groups])
        kept_rerolled.append(rerolled_P[groups])
        kept_base.append(base_P[groups] if base_P is not None else None)
    metrics = {k: sum(m[k] for m in all_metrics) / len(all_metrics) for k in all_metrics[0]}
    metrics["selection/gen_batches"] = float(n_batches)
    metrics["selection/kept_groups"] = float(len(kept_ex))
    metrics["selection/kept_frac"] = len(kept_ex) / n_groups
    if hasattr(task, "pools"):  # a dataset: how far through it the stream is
        metrics["data/epoch"] = (cursor + consumed) / max(len(task.pools["train"]), 1)
    if cfg.rollout.partial_states:
        metrics["selection/partial_groups"] = float(partial_used)
        metrics["selection/partial_pushed"] = float(partial_pushed)
        metrics["selection/partial_queue"] = float(len(queue))
    return Batch(
        examples=kept_ex,
        prompt_ids=kept_ids,
        comps=concat_rollouts(kept_comps, engine.pad_id),
        rewards_PG=torch.cat(kept_r),
        rewards_PGK=torch.cat(kept_rk),
        valid_PG=torch.cat(kept_valid),
        correct_PG=torch.cat(kept_ok),
        rerolled_P=torch.cat(kept_rerolled),
        partial_queue=queue,
        baseline_P=torch.cat(kept_base) if parts.needs_baseline_rewards else None,
        metrics=metrics,
        failures=failures,
        consumed=consumed,
        generate_s=gen_s,
        reward_s=reward_s,
        gen_tokens=gen_tokens,
    )


def draw_prompts(task: Task, n: int, seed: int, start: int) -> list[Example]:
    """The next ``n`` training prompts at data cursor ``start``.

    A dataset (a task with ``stream``) is read epoch by epoch: every training prompt once per
    epoch, in an order shuffled per epoch by the run's seed, position = the cursor, so a resumed
    run continues the same sequence. A built-in task draws a fresh seeded sample each time.
    """
    stream = getattr(task, "stream", None)
    if stream is not None:
        return stream("train", start, n, derive_seed(seed, "data"))
    return task.examples("train", n, seed=derive_seed(seed, "data", start))


def step_rewards(
    scorer: tuple[str, dict],
    task: Task,
    examples: list[Example],
    comps: Rollout,
    metrics: dict[str, float],
) -> dict[str, Tensor]:
    """The process-reward shapers' inputs: ``step_rewards`` and ``step_mask``, ``[P, G, K]``, from the
    step scorer ``(name, params)`` (``algorithm.step_reward``; ``posttrain/rewards/steps.py``).

    Adds ``step_reward/mean`` (over every scored step), ``step_reward/steps_mean`` (steps per
    response) and ``step_reward/errors`` (responses whose scorer failed) to ``metrics``.
    """
    name, params = scorer
    G = comps.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    values_NK, mask_NK, errors = score_steps(name, params, [ex.prompt for ex in rows], comps.texts, fields)
    n_steps = mask_NK.sum()
    metrics["step_reward/mean"] = float((values_NK * mask_NK).sum() / n_steps) if n_steps else float("nan")
    metrics["step_reward/steps_mean"] = float(mask_NK.sum(-1).mean())
    metrics["step_reward/errors"] = float(errors)
    P = len(examples)
    return {"step_rewards": values_NK.view(P, G, -1), "step_mask": mask_NK.view(P, G, -1)}


def reference_rewards(
    rewards: list[tuple[str, dict]],
    weights_K: Tensor,
    task: Task,
    examples: list[Example],
    pool: RewardPool | None,
) -> Tensor:
    """The weighted reward of each prompt's reference response (its demonstration), ``[P, 1]``.

    What PAR (arXiv:2502.18770) centres the policy's rewards on: with a reward model as the
    reward, the RM's score of the SFT reference. A reference that cannot be scored counts 0.
    """
    fields = [reward_fields(ex, task) for ex in examples]
    report = score_batch(rewards, [ex.prompt for ex in examples], [ex.demonstration for ex in examples], fields,
                         pool=pool)
    values = torch.tensor([[0.0 if v is None else v for v in col] for col in report.values]).T  # [P, K]
    return (values * weights_K).sum(-1, keepdim=True)


def score(
    rewards: list[tuple[str, dict]],
    task: Task,
    examples: list[Example],
    comps: Rollout,
    cfg: Config,
    pool: RewardPool | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, float], list[dict]]:
    """Score every completion with every reward component (in ``pool``'s workers when given).

    Returns rewards ``[P, G, K]``, a validity mask ``[P, G]``, the verifier's verdicts ``[P, G]``,
    per-component metrics and the failed calls. ``None`` scores become 0, or mask the sample out
    of the update, as ``scoring.on_error`` says. ``accuracy`` is the task's verifier, scored in
    the same protected way (reusing a plain ``task`` component when the recipe has one).
    """
    G = comps.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    fns = list(rewards)
    acc_k = next((k for k, (name, params) in enumerate(fns) if name == "task" and not params), None)
    if acc_k is None:
        fns.append(("task", {}))
        acc_k = len(fns) - 1
    report = score_batch(fns, [ex.prompt for ex in rows], comps.texts, fields, pool=pool)
    P, K = len(examples), len(rewards)
    values = torch.tensor([[math.nan if v is None else v for v in col] for col in report.values]).T  # [N, K+]
    accuracy = values[:, acc_k].nan_to_num(0.0)
    values = values[:, :K]
    missing = values.isnan()
    valid_N = ~missing.any(1) if cfg.scoring.on_error == "mask" else torch.ones(len(rows), dtype=torch.bool)
    values = values.nan_to_num(0.0)
    metrics: dict[str, float] = {"accuracy": float(accuracy.mean())}
    for k, (name, _) in enumerate(rewards):
        metrics[f"reward/{name}/mean"] = float(values[:, k].mean())
        metrics[f"reward/{name}/errors"] = float(report.errors[k])
        metrics[f"reward/{name}/nonfinite"] = float(report.nonfinite[k])
        metrics[f"reward/{name}/timeouts"] = float(report.timeouts[k])
    metrics["reward/invalid_frac"] = float(missing.any(1).float().mean())
    correct = (accuracy > 0.5).view(P, G)
    return values.view(P, G, -1), valid_N.view(P, G), correct, metrics, report.failures
