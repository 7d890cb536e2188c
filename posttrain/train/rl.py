"""The RL loop: prompts -> rollouts -> rewards -> advantages -> policy update.

It reads top to bottom and has no algorithm branches: the advantage estimator, policy loss,
aggregation and KL estimator are looked up by name once, at set-up, from the config; the rollout
engine is used only through its interface. Every run writes a run directory (config.toml,
metrics.jsonl, TensorBoard events, samples.jsonl, checkpoints/, summary.json, plots/).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

from posttrain.config import Config
from posttrain.evaluation.sampled import evaluate_config
from posttrain.models.load import load_model
from posttrain.reporting.plots import plot_metric_groups, plot_metrics
from posttrain.reporting.progress import fmt_metrics, make_progress, summary_table
from posttrain.reporting.sinks import MetricSinks, read_metrics
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rewards import RewardPool, pool_for
from posttrain.rewards.steps import check_step_reward
from posttrain.rollout import Rollout, SamplingParams, make_engine
from posttrain.tasks.base import Example
from posttrain.train.checkpoint import latest_checkpoint
from posttrain.train.collect import collect
from posttrain.train.critic import POLICY_FROZEN, Critic
from posttrain.train.diagnose import expensive_diagnostics, step_group_stats
from posttrain.train.drivers import ProduceContext
from posttrain.train.inputs import advantage_inputs, kl_reward_metrics
from posttrain.train.optim import make_optimizer, make_scheduler
from posttrain.train.parts import (
    Parts,
    advance_entropy_state,
    advance_kl_coef,
    advance_states,
    load_entropy_state,
    load_kl_coef,
    load_states,
)
from posttrain.train.prompt_stats import PromptStatsLog
from posttrain.train.select import STATE_KEY, BatchSelector, UpdateBatch
from posttrain.train.setup import (
    derive_seed,
    open_run,
    resolve_model_path,
    restore_trainer_state,
    save_trainer_checkpoint,
)
from posttrain.train.update import policy_entropies, policy_update

PROGRESS_KEYS = [
    ("reward/mean", "reward"),
    ("accuracy", "acc"),
    ("response/length_mean", "len"),
    ("policy/entropy", "ent"),
    ("eval/pass@1", "eval"),
]
PLOT_KEYS = ["reward/mean", "accuracy", "response/length_mean", "policy/entropy", "eval/pass@1"]


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many non-finite losses in a row)."""


@dataclass
class LoopState:
    """What, beyond model/optimizer/scheduler, a checkpoint must hold to resume exactly."""

    step: int = 0  # completed RL steps
    cursor: int = 0  # prompts consumed from the training stream
    bad_steps: int = 0  # consecutive steps with a non-finite loss
    version: int = 0  # the policy version: optimizer steps taken (what the engine samples with)
    rank_state: dict = field(default_factory=dict)  # ERV / ERA series of diag/effective_rank
    entry_states: dict = field(default_factory=dict)  # stateful advantage / shapers (history, curriculum)


def train(cfg: Config, *, resume: bool = False, console: Console | None = None) -> dict:
    """Run RL training as configured; returns the summary (also written to ``summary.json``).

    The reward worker pool starts first (forked before any model loads or thread starts) and is
    stopped however the run ends.
    """
    pool = pool_for(cfg.scoring)
    try:
        return _train(cfg, resume, console or Console(), pool)
    finally:
        if pool is not None:
            pool.close()


def _train(cfg: Config, resume: bool, console: Console, pool: RewardPool | None) -> dict:
    t_start = time.perf_counter()
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    task, run, ckpt_root, ckpt = opened.task, opened.run, opened.ckpt_root, opened.ckpt
    tokenizer, model = opened.tokenizer, opened.model
    parts = Parts.from_config(cfg)
    if parts.step_reward:  # a step scorer that cannot read this task's steps fails here, not mid-run
        check_step_reward(*parts.step_reward, task)
    selector = BatchSelector.from_config(cfg)  # which rows the update trains on (Shuffle-R1, RoRecomp; none: all)
    d = cfg.diagnostics
    wants_base = d.every > 0 and d.divergence
    start_model = (
        load_model(resolve_model_path(cfg, task, run), cfg.model.dtype).eval()
        if parts.needs_ref or parts.kl_reward or wants_base
        else None
    )
    ref_model = start_model if parts.needs_ref or parts.kl_reward else None  # the frozen starting model
    engine = make_engine(cfg.rollout.engine, model, tokenizer)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.betas, cfg.train.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.train.warmup_steps, cfg.train.steps, cfg.train.schedule)
    critic = (  # PPO's value model, for estimators that read `values` (gae)
        Critic.build(cfg, resolve_model_path(cfg, task, run), ckpt, str(model.device)) if parts.needs_values else None
    )
    extras = critic.extras() if critic else {}
    if critic:
        console.print(critic.note)
    state = LoopState()
    if ckpt:
        state = LoopState(**restore_trainer_state(ckpt, optimizer, scheduler, extras))
        console.print(f"[bold]resumed[/] from {ckpt} at step {state.step}")
    engine.sync(model.state_dict(), state.version)
    rewards = [(s.name, dict(s.params)) for s in cfg.reward]
    for name, params in rewards:  # rewards that say how they will run (e.g. the code sandbox's isolation)
        describe = getattr(REWARDS.get(name), "describe", None)
        if describe is not None:
            console.print(describe(params))
    weights_K = torch.tensor([s.weight for s in cfg.reward])
    sampling = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        n=cfg.rollout.group_size,
        min_new_tokens=cfg.rollout.min_new_tokens,
    )
    produce_ctx = ProduceContext(task, tokenizer, engine, sampling, rewards, weights_K, cfg, pool)
    eval_examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    sinks = MetricSinks(run, cfg.log, start_step=state.step, config=cfg.model_dump(mode="json"))
    prompt_stats = PromptStatsLog(run, state.step) if cfg.log.prompt_stats else None  # for rank-prompts

    def held_out_eval() -> dict[str, float]:
        return evaluate_config(engine, tokenizer, task, eval_examples, cfg, pool).metrics

    def checkpoint() -> Path:
        return save_trainer_checkpoint(
            ckpt_root, state, model, tokenizer, optimizer, scheduler, cfg.checkpoint.keep, extras
        )

    progress = make_progress(console, "train", cfg.log.progress)
    bar = progress.add_task("train", total=cfg.train.steps, completed=state.step, metrics="")
    metrics: dict[str, float] = {}
    try:
        with progress:
            while state.step < cfg.train.steps:
                t0 = time.perf_counter()
                adv_state, shaper_states = load_states(parts, state.entry_states)  # history-aware entries
                ent_state = load_entropy_state(parts, state.entry_states)  # AEnt's adaptive coefficient
                # 1-3. prompts -> rollouts -> rewards [P, G] (shaped, filtered; see collect())
                batch = collect(produce_ctx, parts, state.step, state.cursor, shaper_states,
                                state.entry_states.get(cfg.rollout.driver))
                if batch.failures:
                    log_reward_failures(run, state.step, batch.failures, console)
                examples, prompt_ids, comps = batch.examples, batch.prompt_ids, batch.comps
                rewards_PG, valid_PG, reward_metrics = batch.rewards_PG, batch.valid_PG, batch.metrics
                # 4. advantages
                P, G = rewards_PG.shape
                mask_NT = comps.loss_mask * valid_PG.reshape(-1, 1)
                row_prompts = [p for p in prompt_ids for _ in range(G)]
                pad_id = tokenizer.pad_token_id
                values_NT = critic.values(row_prompts, comps, mask_NT, pad_id) if critic else None  # V(s_t) [N, T]
                entropies_NT = (  # token entropies under the current policy, for entropy-shaped estimators
                    policy_entropies(model, row_prompts, comps, tokenizer.pad_token_id, cfg.rollout.temperature)
                    if parts.needs_entropies
                    else None
                )
                kl_coef = load_kl_coef(parts, state.entry_states)  # the KL-in-reward beta (adaptive: it moves)
                on_demand = advantage_inputs(  # metric (CANON), prompt_confidence (ProGRPO), KL in the reward
                    parts, model, ref_model, prompt_ids, comps, mask_NT, entropies_NT, pad_id, cfg.rollout.temperature,
                    kl_coef,
                )
                adv = parts.advantage(
                    rewards_PG,
                    batch.rewards_PGK,
                    lengths=comps.lengths.view(P, G).float(),
                    mask=mask_NT.view(P, G, -1),
                    logprobs=comps.behaviour_logprobs.view(P, G, -1),
                    baseline_rewards=batch.baseline_P,
                    entropies=entropies_NT.view(P, G, -1) if entropies_NT is not None else None,
                    values=values_NT.view(P, G, -1) if values_NT is not None else None,
                    state=adv_state,
                    **on_demand,
                )
                adv_N = adv.reshape(P * G, *adv.shape[2:])
                critic_metrics = (  # the critic regresses V on the GAE returns (the policy's minibatches)
                    critic.update(
                        cfg, state.step, row_prompts, comps, mask_NT, values_NT, rewards_PG, pad_id,
                        on_demand.get("token_rewards"),
                    )
                    if critic
                    else {}
                )
                # 5. policy update
                row_inputs = {
                    "rewards": rewards_PG.reshape(-1),
                    "group_ids": torch.arange(P).repeat_interleave(G),
                    "hint_rerolled": batch.rerolled_P.repeat_interleave(G),  # AAPO's groups (HINT)
                }
                chosen = selector.select(  # rows and minibatches to train on (train/select.py)
                    UpdateBatch(row_prompts, comps, mask_NT, adv_N, row_inputs), rewards_PG, state.step,
                    state.entry_states.get(STATE_KEY), tokenizer.pad_token_id,
                )
                update_metrics = dict(POLICY_FROZEN) if critic and critic.warming_up(state.step) else policy_update(
                    model,
                    ref_model if parts.needs_ref else None,  # the KL in the loss / losses reading ref_logprobs
                    optimizer,
                    parts,
                    cfg,
                    chosen.row_prompts,
                    chosen.comps,
                    chosen.mask_NT,
                    chosen.adv_N,
                    chosen.row_inputs,
                    tokenizer.pad_token_id,
                    state.step,
                    entropy_state=ent_state,
                    minibatches=chosen.minibatches,
                )
                if update_metrics["train/optimizer_steps"]:
                    scheduler.step()  # the schedule counts steps that updated the model
                    state.version += int(update_metrics["train/optimizer_steps"])
                    engine.sync(model.state_dict(), state.version)  # the next rollouts sample this policy
                state.bad_steps = state.bad_steps + 1 if update_metrics["train/nonfinite"] else 0
                if state.bad_steps >= cfg.train.max_bad_steps:
                    raise TrainingAborted(
                        f"{state.bad_steps} consecutive steps had a non-finite loss (last at step {state.step}); "
                        "lower train.lr or check the rewards. The last good checkpoint is in "
                        f"{latest_checkpoint(ckpt_root)}"
                    )
                state.step += 1
                state.cursor += batch.consumed
                lengths_PG = comps.lengths.view(P, G).float()
                raw_PG = batch.rewards_PGK.sum(-1)  # unshaped, for the shapers' history
                kl_metrics = kl_reward_metrics(on_demand.get("token_rewards"), mask_NT.view(P, G, -1), kl_coef)
                state.entry_states = {
                    **advance_states(parts, adv_state, shaper_states, rewards_PG, raw_PG, lengths_PG),
                    **advance_entropy_state(parts, ent_state, update_metrics),
                    **advance_kl_coef(parts, kl_coef, kl_metrics, P * G),  # the adaptive KL controller
                    **selector.state_dict(chosen),  # RoRecomp's compensation buffer
                    # the rollout driver's own state (ReST-GRPO's queue), under the driver's name
                    **({cfg.rollout.driver: batch.driver_state} if batch.driver_state is not None else {}),
                }
                metrics = {
                    **reward_metrics,
                    "rollout/policy_version": float(comps.policy_version.float().mean()),  # what sampled them
                    "response/length_mean": float(comps.lengths.float().mean()),
                    "response/length_max": float(comps.lengths.max()),
                    "response/truncation_rate": float((~comps.finished).float().mean()),
                    "adv/zero_group_frac": float((adv.reshape(P, -1).abs().amax(1) < 1e-8).float().mean()),
                    "adv/mean": float(adv.mean()),
                    **step_group_stats(rewards_PG, adv, batch.correct_PG),
                    **kl_metrics,
                    **update_metrics,
                    **chosen.metrics,
                    **critic_metrics,
                    "optim/lr": scheduler.get_last_lr()[0],
                    "time/generate_s": batch.generate_s,
                    "time/reward_s": batch.reward_s,
                    "time/update_s": time.perf_counter() - t0 - batch.generate_s - batch.reward_s,
                    "time/step_s": time.perf_counter() - t0,
                    "throughput/gen_tokens_per_s": batch.gen_tokens / max(batch.generate_s, 1e-9),
                    "throughput/tokens_per_s": comps.num_tokens / max(time.perf_counter() - t0, 1e-9),
                }
                if d.every and state.step % d.every == 0:
                    diag, state.rank_state = expensive_diagnostics(
                        model,
                        start_model,
                        row_prompts,
                        comps.token_ids,
                        mask_NT,
                        pad_id=tokenizer.pad_token_id,
                        temperature=cfg.rollout.temperature,
                        samples=d.samples,
                        rank_state=state.rank_state,
                    )
                    metrics.update(diag)
                if cfg.eval.every and state.step % cfg.eval.every == 0:
                    ev = held_out_eval()
                    metrics.update({f"eval/{k}": v for k, v in ev.items()})
                sinks.write(state.step, metrics)
                if prompt_stats is not None:
                    prompt_stats.write(state.step, examples, batch.correct_PG, valid_PG)
                if cfg.log.samples and state.step % cfg.log.samples_every == 0:
                    write_samples(run, state.step, examples, comps, rewards_PG, adv_N, cfg.log.samples)
                if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
                    checkpoint()
                progress.update(bar, completed=state.step, metrics=fmt_metrics(metrics, PROGRESS_KEYS))
    except KeyboardInterrupt:
        path = checkpoint()
        sinks.close()
        if prompt_stats is not None:
            prompt_stats.close()
        console.print(
            f"\n[bold yellow]interrupted[/]: saved {path}. Resume with:\n"
            f"  posttrain train {run / 'config.toml'} --resume --out {run}",
            soft_wrap=True,
        )
        raise
    final_ckpt = checkpoint()
    sinks.close()
    if prompt_stats is not None:
        prompt_stats.close()
    final_eval = held_out_eval()
    rows = read_metrics(run / "metrics.jsonl")
    plot_metrics(
        rows,
        PLOT_KEYS,
        run / "plots" / "train.png",
        title=f"{cfg.algorithm.advantage} / {cfg.algorithm.loss}",
    )
    if cfg.log.plot_groups:
        plot_metric_groups(rows, run / "plots")
    summary = {
        "steps": state.step,
        "wall_s": time.perf_counter() - t_start,
        "final": final_eval,
        "last_metrics": metrics,
        "checkpoint": str(final_ckpt),
        "run_dir": str(run),
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(
        summary_table(
            f"posttrain train: {run}",
            [
                ("steps", str(state.step)),
                ("held-out pass@1", f"{final_eval['pass@1']:.3f}"),
                ("last reward/mean", f"{metrics.get('reward/mean', float('nan')):.3f}"),
                ("wall time", f"{summary['wall_s']:.1f} s"),
                ("checkpoint", str(final_ckpt)),
            ],
        )
    )
    return summary


def log_reward_failures(run: Path, step: int, failures: list[dict], console: Console) -> None:
    """Append failed reward calls, each with its prompt and completion, to ``reward_failures.jsonl``
    and print one line per reward and status (the run goes on).
    """
    with open(run / "reward_failures.jsonl", "a") as f:
        for row in failures:
            f.write(json.dumps({"step": step, **row}) + "\n")
    seen: dict[tuple[str, str], dict] = {}
    for row in failures:
        seen.setdefault((row["reward"], row["status"]), row)
    for (name, status), row in seen.items():
        n = sum(r["reward"] == name and r["status"] == status for r in failures)
        console.print(
            f"[yellow]warning[/]: step {step}: reward {name!r}: {n} call(s) {status}, e.g. {row['message']} "
            f"on completion {row['completion']!r:.80} (all in {run / 'reward_failures.jsonl'})",
            soft_wrap=True,
        )


def write_samples(
    run: Path,
    step: int,
    examples: list[Example],
    comps: Rollout,
    rewards_PG: Tensor,
    adv_N: Tensor,
    k: int,
) -> None:
    """Append the first ``k`` completions of this step to ``samples.jsonl``."""
    G = comps.n
    adv_seq = adv_N.reshape(adv_N.shape[0], -1)[:, 0]
    with (run / "samples.jsonl").open("a") as f:
        for i in range(min(k, len(comps.texts))):
            ex = examples[i // G]
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "prompt": ex.prompt,
                        "answer": ex.answer,
                        "completion": comps.texts[i],
                        "reward": float(rewards_PG.view(-1)[i]),
                        "advantage": float(adv_seq[i]),
                    }
                )
                + "\n"
            )
