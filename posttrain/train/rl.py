"""The RL loop: produce (prompts -> rollouts -> rewards) -> prepare (advantages, the rows to train
on) -> learn (the Learner's update) -> hand-off (the pipeline gives the new policy to the engine that
samples next, now or, when it runs ahead of the learner, for its producer).

It reads top to bottom and names no method: the rollout driver, shapers, group filter, advantage
estimator and its input providers, batch selector, policy loss, aggregation, regularizers and the
stateful components are looked up once, at set-up, from the config; the rollout engine is used only
through its interface. Every run writes a run directory (config.toml,
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

from posttrain.config import Config, LearnSettings, ProduceSettings
from posttrain.evaluation.sampled import evaluate_config
from posttrain.learn.build import build_learner
from posttrain.learn.learner import Learner
from posttrain.models.chat import example_messages, is_chat
from posttrain.models.parameterization import REGISTRY as PARAMETERIZATIONS
from posttrain.models.precision import autocast_dtype
from posttrain.planning.plan import check_run as check_memory
from posttrain.prepare.prepare import Prepared, prepare
from posttrain.prepare.providers import InputContext
from posttrain.prepare.selectors import BatchSelector
from posttrain.produce.batch import Batch
from posttrain.produce.collect import collect
from posttrain.produce.drivers import ProduceContext
from posttrain.produce.pipeline import RolloutPipeline
from posttrain.produce.ref_samples import ReferenceRewards
from posttrain.produce.ref_values import run_values, use_values
from posttrain.reporting.plots import plot_metric_groups
from posttrain.reporting.sinks import keep_steps, read_metrics
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rewards import RewardPool, pool_for
from posttrain.rewards.steps import check_step_reward
from posttrain.rollout import (
    Rollout,
    RolloutEngine,
    SamplingParams,
    make_engine,
    ray_workers,
    training_engine,
)
from posttrain.rollout.multiturn import turn_advantage_share
from posttrain.run.checkpoint import latest_checkpoint
from posttrain.run.harness import Finish, Loop, finish_run, run_loop
from posttrain.run.optim import make_optimizer, make_scheduler
from posttrain.run.record import BatchRecorder
from posttrain.run.setup import OpenedRun, open_run, restore_trainer_state
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example
from posttrain.train.diagnose import expensive_diagnostics, step_group_stats
from posttrain.train.loop_state import Component, Phases, StepRecord, advance_all, components, load_all, shaper_states
from posttrain.train.prompt_stats import PromptStatsLog

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
    pipeline: bytes = b""  # batches sampled ahead with weights older than the checkpoint's (max_staleness > 0)


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


@dataclass
class RunParts:
    """Everything a run sets up once: the phases' contexts and the objects they share."""

    cfg: Config
    run: Path
    ckpt_root: Path
    tokenizer: object
    engine: RolloutEngine
    learner: Learner
    selector: BatchSelector
    phases: Phases  # each phase's entries, bound once
    stateful: list[Component]
    produce: ProduceContext
    inputs: InputContext
    start_model: torch.nn.Module | None  # the frozen starting model (reference, divergence diagnostics)
    extras: dict  # models + optimizers checkpointed beside the policy (PPO's value model)
    opened: OpenedRun  # what a checkpoint saves (the adapter with LoRA) and the merged export
    pipeline: RolloutPipeline  # where each step's batch comes from (a producer thread when max_staleness > 0)
    recorder: BatchRecorder | None = None  # log.record_batches: keeps each step's batch for `posttrain replay`


def _setup(cfg: Config, resume: bool, console: Console, pool: RewardPool | None) -> tuple[RunParts, LoopState]:
    """Open the run, look every part up once, restore a checkpoint when resuming."""
    phases = Phases.from_config(cfg)
    produce_parts = phases.produce
    # posttrain astar-values' file, checked before any model loads
    produce_settings, learn_settings = ProduceSettings.of(cfg), LearnSettings.of(cfg)  # each phase's cut
    ref_values = run_values(produce_settings, produce_parts.ref_samples)
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    task, run, ckpt, tokenizer, model = opened.task, opened.run, opened.ckpt, opened.tokenizer, opened.model
    check_memory(cfg, model, opened.prompt_tokens)  # a layout that cannot fit stops here, naming the setting to change
    if produce_parts.step_reward:  # a step scorer that cannot read this task's steps fails here, not mid-run
        check_step_reward(*produce_parts.step_reward, task)
    wants_base = cfg.diagnostics.every > 0 and cfg.diagnostics.divergence
    needs_ref = phases.learn.needs_reference
    # the frozen starting model: a second copy, or with LoRA the policy with its adapter off
    start_model = opened.reference(cfg) if needs_ref or wants_base else None
    # what the loop trains and samples (algorithm.parameterization): the policy, or a module built around it
    a = cfg.algorithm
    model = PARAMETERIZATIONS.get(a.parameterization)(model, lambda: opened.reference(cfg),
                                                        **a.parameterization_params)
    engine = training_engine(cfg, model, tokenizer)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.betas, cfg.train.weight_decay, cfg.train.optimizer)
    scheduler = make_scheduler(optimizer, cfg.train.warmup_steps, cfg.train.steps, cfg.train.schedule)
    pad_id = tokenizer.pad_token_id
    learner = build_learner(model, optimizer, scheduler, phases.learn, learn_settings, pad_id,
                            start_model if needs_ref else None, opened.base_path, ckpt, console)
    extras = learner.extras()  # second learners' models and optimizers (PPO's value model)
    state = LoopState()
    if ckpt:
        state = LoopState(**restore_trainer_state(ckpt, learner.optimizer, scheduler, extras))
        console.print(f"[bold]resumed[/] from {ckpt} at step {state.step}")
    rewards = [(s.name, dict(s.params)) for s in cfg.reward]
    for name, params in rewards:  # rewards that say how they will run (e.g. the code sandbox's isolation)
        describe = getattr(REWARDS.get(name), "describe", None)
        if describe is not None:
            console.print(describe(params))
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, n=r.group_size, min_new_tokens=r.min_new_tokens)
    weights_K = torch.tensor([s.weight for s in cfg.reward])
    produce_ctx = ProduceContext(task, tokenizer, engine, sampling, rewards, weights_K, produce_settings, pool)
    if produce_parts.ref_samples:  # PAR's / A*-PO's responses of the frozen starting policy, sampled once per prompt
        produce_ctx.reference = ReferenceRewards.for_run(produce_settings, start_model, tokenizer, produce_ctx.score,
                                                         produce_parts.ref_samples)
    for note in use_values(produce_settings, ref_values, task, produce_ctx.reference):  # preloaded; filter_unsolved
        console.print(note)
    input_ctx = InputContext(phases.prepare, learner)
    pipeline = RolloutPipeline.build(
        lambda ctx, step, cursor, shapers, driver: collect(ctx, produce_parts, step, cursor, shapers, driver),
        produce_ctx, r.max_staleness, cfg.train.steps,
        lambda m, tok: ray_workers(cfg, m, tok) if cfg.cluster.backend == "ray"
        else make_engine(r.engine, m, tok, r.engine_params, cfg.seed, autocast_dtype(cfg.model.autocast)),
        r.on_new_weights, model=model,
    )
    selector = BatchSelector.from_config(cfg.algorithm, cfg.train.minibatches, cfg.seed)
    rp = RunParts(cfg, run, opened.ckpt_root, tokenizer, engine, learner, selector,
                  phases, components(phases, r.driver), produce_ctx, input_ctx, start_model, extras, opened, pipeline,
                  BatchRecorder.for_run(cfg.log.record_batches, run, cfg.train.steps, console))
    return rp, state


def _step(rp: RunParts, state: LoopState, console: Console) -> tuple[dict[str, float], Batch, Prepared]:
    """One RL step: produce -> prepare -> learn -> hand-off; advances ``state`` and returns the metrics."""
    cfg = rp.cfg
    t0 = time.perf_counter()
    live = load_all(rp.stateful, state.entry_states)  # every stateful component's state, by key
    # 1-3. produce: prompts -> rollouts -> rewards [P, G], shaped and filtered (the rollout driver; collect()),
    # now or, with rollout.max_staleness > 0, by the producer thread while the learner worked
    batch, pipe_metrics = rp.pipeline.take(state.step, state.cursor, shaper_states(rp.phases.produce, live),
                                           live[cfg.rollout.driver])
    if rp.recorder is not None:  # log.record_batches: what prepare reads, for `posttrain replay`
        rp.recorder.write(state, batch, pipe_metrics)
    t1 = time.perf_counter()
    # 4. prepare: advantage inputs -> advantages -> the rows and minibatches to train on
    prep = prepare(rp.inputs, rp.selector, batch, live, state.step)
    if batch.failures:
        log_reward_failures(rp.run, state.step + 1, batch.failures, console)  # the step metrics.jsonl names
    t2 = time.perf_counter()
    # 5. learn
    update = rp.learner.learn(prep, batch, state.step, live.get("entropy"))
    state.version += int(update["train/optimizer_steps"])
    state.bad_steps = state.bad_steps + 1 if update["train/nonfinite"] else 0
    if state.bad_steps >= cfg.train.max_bad_steps:
        raise TrainingAborted(
            f"{state.bad_steps} consecutive steps had a non-finite loss (last at step {state.step}); "
            f"lower train.lr or check the rewards. The last good checkpoint is in {latest_checkpoint(rp.ckpt_root)}"
        )
    state.step += 1
    state.cursor += batch.consumed
    # 6. hand-off: the engine that samples next takes the new policy (the pipeline knows which, and when)
    rp.pipeline.after_update(rp.learner, state.step, state.version)
    rollouts, P = batch.rollouts, batch.rewards_PG.shape[0]
    record = StepRecord(batch.rewards_PG, batch.rewards_PGK.sum(-1), rollouts.lengths.view(P, -1).float(), update,
                        prep.metrics, prep.chosen.state, batch.driver_state)
    state.entry_states = advance_all(rp.stateful, live, record)
    t3 = time.perf_counter()
    adv = prep.adv
    if batch.turns is not None:  # how many of the episodes' turns this step's credit reaches
        prep.metrics["adv/turn_nonzero_frac"] = turn_advantage_share(adv.reshape(rollouts.token_ids.shape[0],
                                                                                 *adv.shape[2:]), rollouts.turn_ids)
    metrics = {
        **batch.metrics,
        "policy/rollout_version": float(rollouts.policy_version.float().mean()),  # the version that sampled them
        "response/length_mean": float(rollouts.lengths.float().mean()),
        "response/length_max": float(rollouts.lengths.max()),
        "response/truncation_rate": float((~rollouts.finished).float().mean()),
        "adv/zero_group_frac": float((adv.reshape(P, -1).abs().amax(1) < 1e-8).float().mean()),
        "adv/zero_frac": float((adv.reshape(rollouts.token_ids.shape[0], -1).abs().amax(1) < 1e-8).float().mean()),
        "adv/mean": float(adv.mean()),
        **step_group_stats(batch.rewards_PG, adv, batch.correct_PG),
        **prep.metrics,
        **update,
        **pipe_metrics,
        "optim/lr": float(rp.learner.scheduler.get_last_lr()[0]),  # a tensor with torchao's optimizers
        "time/generate_s": batch.generate_s,
        "time/reward_s": batch.reward_s + (t1 - t0 - batch.generate_s - batch.reward_s),  # + shaping, filter
        "time/prepare_s": t2 - t1,
        "time/update_s": t3 - t2,
        "time/step_s": t3 - t0,
        "throughput/gen_tokens_per_s": batch.gen_tokens / max(batch.generate_s, 1e-9),
        "throughput/tokens_per_s": rollouts.num_tokens / max(t3 - t0, 1e-9),
    }
    return metrics, batch, prep


def _train(cfg: Config, resume: bool, console: Console, pool: RewardPool | None) -> dict:
    """Set up, then run the steps through the shared harness (sinks, progress, eval and checkpoint
    cadence, Ctrl-C, summary).
    """
    t_start = time.perf_counter()
    rp, state = _setup(cfg, resume, console, pool)
    try:
        return _run(rp, state, console, t_start)
    finally:
        rp.pipeline.close()
        rp.learner.close()
        if hasattr(rp.engine, "close"):  # an engine with workers of its own
            rp.engine.close()


def _run(rp: RunParts, state: LoopState, console: Console, t_start: float) -> dict:
    """The steps, evaluations and checkpoints of a set-up run, then its summary."""
    cfg = rp.cfg
    rp.pipeline.start(state.step, state.cursor, state.pipeline, rp.learner, state.version)
    run, d, model = rp.run, cfg.diagnostics, rp.learner.model
    eval_examples = rp.produce.task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    prompt_stats = PromptStatsLog(run, state.step) if cfg.log.prompt_stats else None  # for rank-prompts
    for log in ("samples.jsonl", "reward_failures.jsonl"):  # after a resume, the steps it re-runs are logged once
        keep_steps(run / log, state.step)

    def held_out_eval() -> dict[str, float]:
        engine = rp.pipeline.for_eval(rp.learner, state.version)  # the run's engine, holding the current policy
        return evaluate_config(engine, rp.tokenizer, rp.produce.task, eval_examples, cfg, rp.produce.pool).metrics

    def step() -> dict[str, float]:
        metrics, batch, prep = _step(rp, state, console)
        if d.every and state.step % d.every == 0:
            diag, state.rank_state = expensive_diagnostics(
                model, rp.start_model, prep.row_prompts, batch.rollouts.token_ids, prep.mask_NT,
                pad_id=rp.inputs.pad_id, temperature=cfg.rollout.temperature, samples=d.samples,
                rank_state=state.rank_state, stride=d.rank_stride,
            )
            metrics.update(diag)
        if prompt_stats is not None:
            prompt_stats.write(state.step, batch.examples, batch.correct_PG, batch.valid_PG)
        if cfg.log.samples and state.step % cfg.log.samples_every == 0:
            adv_N = prep.adv.reshape(batch.rollouts.token_ids.shape[0], *prep.adv.shape[2:])
            write_samples(run, state.step, batch.examples, batch.rollouts, batch.rewards_PG, adv_N, cfg.log.samples,
                          rp.tokenizer if batch.turns is not None else None, cfg.task.system_prompt)
        return metrics

    def checkpoint() -> Path:
        lrn = rp.learner
        state.pipeline = rp.pipeline.checkpoint_state(state.step)  # the batches sampled ahead, if any
        return rp.opened.checkpoint(state, lrn.optimizer, lrn.scheduler, cfg.checkpoint.keep, rp.extras)

    loop = Loop("train", cfg.train.steps, lambda: state.step, step, checkpoint, PROGRESS_KEYS,
                evaluate=lambda: {f"eval/{k}": v for k, v in held_out_eval().items()}, eval_every=cfg.eval.every,
                close=prompt_stats.close if prompt_stats is not None else None)
    ended = run_loop(cfg, rp.opened, loop, console)
    # the last step's evaluation when it had one (the same greedy, seeded evaluation), else one now
    last_eval = {k.removeprefix("eval/"): v for k, v in ended.metrics.items() if k.startswith("eval/")}
    final_eval = last_eval or held_out_eval()
    if cfg.log.plot_groups:
        plot_metric_groups(read_metrics(run / "metrics.jsonl"), run / "plots")
    metrics = ended.metrics
    finish = Finish(
        f"posttrain train: {run}", PLOT_KEYS,
        summary={"final": final_eval, "last_metrics": metrics},
        rows=[("held-out pass@1", f"{final_eval['pass@1']:.3f}"),
              ("last reward/mean", f"{metrics.get('reward/mean', float('nan')):.3f}")],
        plot_title=f"{cfg.algorithm.advantage} / {cfg.algorithm.loss}",
    )
    return finish_run(cfg, rp.opened, loop, ended, finish, time.perf_counter() - t_start, console)


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
    rollouts: Rollout,
    rewards_PG: Tensor,
    adv_N: Tensor,
    k: int,
    tokenizer: object | None = None,
    system: str | None = None,
) -> None:
    """Append the first ``k`` completions of this step to ``samples.jsonl``. With ``tokenizer`` (a
    multi-turn batch) each row also keeps its whole episode as ``transcript``: ``[text, trained]``
    segments, trained = the policy sampled it (loss mask 1), else context the environment or the
    chat template added. A chat row (``task.dataset`` messages, tools or template kwargs) also keeps
    the ``messages`` its prompt was rendered from (``system``, the task's system prompt, in front when
    the row has none) and its ``tools`` / ``chat_template_kwargs``.
    """
    G = rollouts.n
    adv_seq = adv_N.reshape(adv_N.shape[0], -1)[:, 0]
    if adv_N.dim() > 1:  # token-level advantages: the first trained token's
        first = (rollouts.loss_mask > 0).float().argmax(1)
        adv_seq = adv_N.reshape(adv_N.shape[0], -1).gather(1, first[:, None].clamp(max=adv_N.shape[-1] - 1))[:, 0]
    with (run / "samples.jsonl").open("a") as f:
        for i in range(min(k, len(rollouts.texts))):
            ex = examples[i // G]
            row = {
                "step": step,
                "prompt": ex.prompt,
                "answer": ex.answer,
                "completion": rollouts.texts[i],
                "reward": float(rewards_PG.view(-1)[i]),
                "advantage": float(adv_seq[i]),
            }
            if is_chat(ex):  # the turns the chat template rendered (task.system_prompt in front when the row has none)
                row["messages"] = example_messages(ex, system)
                row |= {k: v for k in ("tools", "chat_template_kwargs") if (v := getattr(ex, k))}
            if tokenizer is not None:
                row["transcript"] = transcript_segments(tokenizer, rollouts, i)
            f.write(json.dumps(row) + "\n")


def transcript_segments(tokenizer: object, rollouts: Rollout, row: int) -> list[list]:
    """Row ``row`` of ``rollouts`` as ``[text, trained]`` runs of tokens with one loss-mask value (special
    tokens kept, padding dropped).
    """
    n = int(rollouts.attention_mask[row].sum())
    ids, trained = rollouts.token_ids[row, :n].tolist(), (rollouts.loss_mask[row, :n] > 0).tolist()
    out: list[list] = []
    start = 0
    for j in range(1, n + 1):
        if j == n or trained[j] != trained[start]:
            out.append([tokenizer.decode(ids[start:j], skip_special_tokens=False), bool(trained[start])])
            start = j
    return out
