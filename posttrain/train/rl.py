"""The RL loop: prompts -> rollouts -> rewards -> advantages -> policy update.

It reads top to bottom and has no algorithm branches: the advantage estimator, policy loss,
aggregation and KL estimator are looked up by name once, at set-up, from the config; the rollout
engine is used only through its interface. Every run writes a run directory (config.toml,
metrics.jsonl, TensorBoard events, samples.jsonl, checkpoints/, summary.json, plots/).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

from posttrain.algorithms import advantages, aggregation, kl, losses, selection, shaping
from posttrain.config import LOSS_INPUTS, Config, ConfigError
from posttrain.evaluation import evaluate
from posttrain.models.load import encode_chat, load_model, load_tokenizer
from posttrain.reporting.plots import plot_metrics
from posttrain.reporting.progress import fmt_metrics, make_progress, summary_table
from posttrain.reporting.sinks import MetricSinks, read_metrics
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rewards import score_batch
from posttrain.rollout import Completions, HFEngine, SamplingParams
from posttrain.rollout.base import concat_completions
from posttrain.tasks import make_task
from posttrain.tasks.base import Example, Task
from posttrain.train.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint, set_rng_state
from posttrain.train.logprobs import completion_logprobs
from posttrain.train.optim import make_optimizer, make_scheduler
from posttrain.train.setup import derive_seed, prepare_run_dir, resolve_model_path, seed_everything

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


@dataclass
class Parts:
    """The registry entries of this run, bound to their parameters once at set-up."""

    advantage: partial
    loss: partial
    aggregate: partial
    kl: partial | None
    kl_coef: float
    shapers: list[partial]
    group_filter: partial
    loss_inputs: tuple[str, ...]  # the LOSS_INPUTS this loss declares
    needs_ref: bool  # a frozen reference model is needed (KL term, or a loss that reads ref_logprobs)

    @classmethod
    def from_config(cls, cfg: Config) -> Parts:
        a = cfg.algorithm
        declared = losses.REGISTRY.params(a.loss)
        return cls(
            shapers=[partial(shaping.compute, sp.name, **sp.params) for sp in a.shapers],
            group_filter=partial(selection.select, a.group_filter, **a.group_filter_params),
            loss_inputs=tuple(k for k in LOSS_INPUTS if k in declared),
            needs_ref=a.kl_coef > 0 or "ref_logprobs" in losses.inputs(a.loss),
            advantage=partial(advantages.compute, a.advantage, **a.advantage_params),
            loss=partial(losses.compute, a.loss, **a.loss_params),
            aggregate=partial(aggregation.reduce, a.aggregation, **a.aggregation_params),
            kl=partial(kl.estimate, a.kl) if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
        )


def train(cfg: Config, *, resume: bool = False, console: Console | None = None) -> dict:
    """Run RL training as configured; returns the summary (also written to ``summary.json``)."""
    console = console or Console()
    t_start = time.perf_counter()
    task = make_task(cfg.task.name, **cfg.task.params)
    run = prepare_run_dir(cfg, resume)
    ckpt_root = run / "checkpoints"
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    seed_everything(cfg.seed)
    model_path = str(ckpt) if ckpt else resolve_model_path(cfg, task, run)
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, cfg.model.dtype)
    parts = Parts.from_config(cfg)
    ref_model = (
        load_model(resolve_model_path(cfg, task, run), cfg.model.dtype).eval() if parts.needs_ref else None
    )
    check_context(cfg, task, tokenizer, model.config.max_position_embeddings)
    engine = HFEngine(model, tokenizer)
    optimizer = make_optimizer(model, cfg.train.lr, cfg.train.betas, cfg.train.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.train.warmup_steps, cfg.train.steps, cfg.train.schedule)
    state = LoopState()
    if ckpt:
        saved = load_trainer_state(ckpt)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        state = LoopState(**saved["loop"])
        console.print(f"[bold]resumed[/] from {ckpt} at step {state.step}")
    rewards = [(s.name, REWARDS.get(s.name), s.params) for s in cfg.reward]
    weights_K = torch.tensor([s.weight for s in cfg.reward])
    sampling = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        n=cfg.rollout.group_size,
        min_new_tokens=cfg.rollout.min_new_tokens,
    )
    eval_examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    sinks = MetricSinks(run, cfg.log.tensorboard, start_step=state.step)

    def checkpoint() -> Path:
        trainer_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "loop": asdict(state),
        }
        return save_checkpoint(ckpt_root, state.step, model, tokenizer, trainer_state, cfg.checkpoint.keep)

    progress = make_progress(console, "train", cfg.log.progress)
    bar = progress.add_task("train", total=cfg.train.steps, completed=state.step, metrics="")
    metrics: dict[str, float] = {}
    try:
        with progress:
            while state.step < cfg.train.steps:
                t0 = time.perf_counter()
                # 1-3. prompts -> rollouts -> rewards [P, G] (shaped, filtered; see collect())
                batch = collect(task, tokenizer, engine, sampling, rewards, weights_K, parts, cfg, state)
                examples, prompt_ids, comps = batch.examples, batch.prompt_ids, batch.comps
                rewards_PG, valid_PG, reward_metrics = batch.rewards_PG, batch.valid_PG, batch.metrics
                # 4. advantages
                P, G = rewards_PG.shape
                mask_NT = comps.mask * valid_PG.reshape(-1, 1)
                adv = parts.advantage(
                    rewards_PG,
                    lengths=comps.lengths.view(P, G).float(),
                    mask=mask_NT.view(P, G, -1),
                    logprobs=comps.logprobs.view(P, G, -1),
                )
                adv_N = adv.reshape(P * G, *adv.shape[2:])
                # 5. policy update
                row_prompts = [p for p in prompt_ids for _ in range(G)]
                row_inputs = {
                    "rewards": rewards_PG.reshape(-1),
                    "group_ids": torch.arange(P).repeat_interleave(G),
                }
                update_metrics = policy_update(
                    model,
                    ref_model,
                    optimizer,
                    parts,
                    cfg,
                    row_prompts,
                    comps,
                    mask_NT,
                    adv_N,
                    row_inputs,
                    tokenizer.pad_token_id,
                    state.step,
                )
                if update_metrics["train/optimizer_steps"]:
                    scheduler.step()  # the schedule counts steps that updated the model
                state.bad_steps = state.bad_steps + 1 if update_metrics["train/nonfinite"] else 0
                if state.bad_steps >= cfg.train.max_bad_steps:
                    raise TrainingAborted(
                        f"{state.bad_steps} consecutive steps had a non-finite loss (last at step {state.step}); "
                        "lower train.lr or check the rewards. The last good checkpoint is in "
                        f"{latest_checkpoint(ckpt_root)}"
                    )
                state.step += 1
                state.cursor += batch.consumed
                metrics = {
                    **reward_metrics,
                    "response/length_mean": float(comps.lengths.float().mean()),
                    "response/length_max": float(comps.lengths.max()),
                    "response/truncation_rate": float((~comps.finished).float().mean()),
                    "adv/zero_group_frac": float((adv.reshape(P, -1).abs().amax(1) < 1e-8).float().mean()),
                    "adv/mean": float(adv.mean()),
                    **update_metrics,
                    "optim/lr": scheduler.get_last_lr()[0],
                    "time/generate_s": batch.generate_s,
                    "time/reward_s": batch.reward_s,
                    "time/update_s": time.perf_counter() - t0 - batch.generate_s - batch.reward_s,
                    "time/step_s": time.perf_counter() - t0,
                    "throughput/gen_tokens_per_s": batch.gen_tokens / max(batch.generate_s, 1e-9),
                    "throughput/tokens_per_s": comps.num_tokens / max(time.perf_counter() - t0, 1e-9),
                }
                if cfg.eval.every and state.step % cfg.eval.every == 0:
                    ev = evaluate(
                        engine,
                        tokenizer,
                        task,
                        eval_examples,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        temperature=cfg.eval.temperature,
                        system_prompt=cfg.task.system_prompt,
                    )
                    metrics.update({f"eval/{k}": v for k, v in ev.items()})
                sinks.write(state.step, metrics)
                if cfg.log.samples and state.step % cfg.log.samples_every == 0:
                    write_samples(run, state.step, examples, comps, rewards_PG, adv_N, cfg.log.samples)
                if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
                    checkpoint()
                progress.update(bar, completed=state.step, metrics=fmt_metrics(metrics, PROGRESS_KEYS))
    except KeyboardInterrupt:
        path = checkpoint()
        sinks.close()
        console.print(
            f"\n[bold yellow]interrupted[/]: saved {path}. Resume with:\n"
            f"  posttrain train {run / 'config.toml'} --resume --out {run}",
            soft_wrap=True,
        )
        raise
    final_ckpt = checkpoint()
    sinks.close()
    final_eval = evaluate(
        engine,
        tokenizer,
        task,
        eval_examples,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        system_prompt=cfg.task.system_prompt,
    )
    rows = read_metrics(run / "metrics.jsonl")
    plot_metrics(
        rows,
        PLOT_KEYS,
        run / "plots" / "train.png",
        title=f"{cfg.algorithm.advantage} / {cfg.algorithm.loss}",
    )
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


@dataclass
class Batch:
    """One step's training batch: P kept groups and what it took to collect them."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    comps: Completions
    rewards_PG: Tensor
    valid_PG: Tensor
    metrics: dict[str, float]
    consumed: int  # prompts taken from the data stream
    generate_s: float
    reward_s: float
    gen_tokens: int


def collect(
    task: Task,
    tokenizer: object,
    engine: HFEngine,
    sampling: SamplingParams,
    rewards: list,
    weights_K: Tensor,
    parts: Parts,
    cfg: Config,
    state: LoopState,
) -> Batch:
    """Generate, score, shape and filter until ``prompts_per_step`` groups pass the group filter or
    ``rollout.max_gen_batches`` generation batches are spent.

    With the default filter (``none``) this is one generation batch. With ``dynamic_sampling`` and
    ``max_gen_batches > 1`` it is DAPO's dynamic sampling (arXiv:2503.14476): groups whose rewards
    are all equal carry no signal and are replaced by fresh ones. Prompts are a deterministic
    function of the data cursor and sampling of ``(seed, step, batch)``, so resume replays nothing.
    Metrics describe every generated sample (the policy), not only the kept ones.
    """
    P = cfg.rollout.prompts_per_step
    kept_ex: list[Example] = []
    kept_ids: list[list[int]] = []
    kept_comps, kept_r, kept_valid, all_metrics = [], [], [], []
    consumed, gen_s, reward_s, gen_tokens, n_batches, n_groups = 0, 0.0, 0.0, 0, 0, 0
    while len(kept_ex) < P and n_batches < cfg.rollout.max_gen_batches:
        t0 = time.perf_counter()
        examples = task.examples("train", P, seed=derive_seed(cfg.seed, "data", state.cursor + consumed))
        prompt_ids = [encode_chat(tokenizer, ex.prompt, cfg.task.system_prompt) for ex in examples]
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "sample", state.step, n_batches))
        comps = engine.generate(prompt_ids, sampling, generator=gen)
        t1 = time.perf_counter()
        rewards_PGK, valid_PG, metrics = score(rewards, task, examples, comps, cfg)
        rewards_PG = (rewards_PGK * weights_K).sum(-1)
        lengths_PG = comps.lengths.view(P, -1).float()
        for shaper in parts.shapers:
            rewards_PG = shaper(rewards_PG, lengths=lengths_PG)
        valid = rewards_PG[valid_PG]
        metrics["reward/mean"] = float(valid.mean()) if valid.numel() else float("nan")
        metrics["reward/std"] = float(valid.std()) if valid.numel() > 1 else 0.0
        keep = parts.group_filter(rewards_PG).tolist()
        reward_s += time.perf_counter() - t1
        gen_s += t1 - t0
        consumed += P
        n_batches += 1
        n_groups += P
        gen_tokens += comps.num_tokens
        all_metrics.append(metrics)
        groups = [g for g in range(P) if keep[g]][: P - len(kept_ex)]
        if not groups and n_batches == cfg.rollout.max_gen_batches and not kept_ex:
            groups, valid_PG = list(range(P)), torch.zeros_like(valid_PG)  # nothing passed: train on nothing
        kept_ex += [examples[g] for g in groups]
        kept_ids += [prompt_ids[g] for g in groups]
        kept_comps.append(comps.select_groups(groups))
        kept_r.append(rewards_PG[groups])
        kept_valid.append(valid_PG[groups])
    metrics = {k: sum(m[k] for m in all_metrics) / len(all_metrics) for k in all_metrics[0]}
    metrics["selection/gen_batches"] = float(n_batches)
    metrics["selection/kept_groups"] = float(len(kept_ex))
    metrics["selection/kept_frac"] = len(kept_ex) / n_groups
    return Batch(
        examples=kept_ex,
        prompt_ids=kept_ids,
        comps=concat_completions(kept_comps, engine.pad_id),
        rewards_PG=torch.cat(kept_r),
        valid_PG=torch.cat(kept_valid),
        metrics=metrics,
        consumed=consumed,
        generate_s=gen_s,
        reward_s=reward_s,
        gen_tokens=gen_tokens,
    )


def check_context(cfg: Config, task: Task, tokenizer: object, max_positions: int) -> None:
    """Fail before training when task prompts plus ``max_new_tokens`` do not fit the context."""
    sample = task.examples("train", 32, seed=0)
    longest = max(len(encode_chat(tokenizer, ex.prompt, cfg.task.system_prompt)) for ex in sample)
    if longest + cfg.rollout.max_new_tokens > max_positions:
        raise ConfigError(
            f"prompts of task {cfg.task.name!r} take up to {longest} tokens; with rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} that exceeds the model's context of {max_positions} tokens"
        )


def score(
    rewards: list, task: Task, examples: list[Example], comps: Completions, cfg: Config
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Score every completion with every reward component; returns rewards ``[P, G, K]``,
    a validity mask ``[P, G]`` and per-component metrics. ``None`` scores become 0, or mask the
    sample out of the update, as ``train.on_reward_error`` says.
    """
    G = comps.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [{**ex.fields, "answer": ex.answer, "example": ex, "task": task} for ex in rows]
    report = score_batch(rewards, [ex.prompt for ex in rows], comps.texts, fields)
    P = len(examples)
    values = torch.tensor([[math.nan if v is None else v for v in col] for col in report.values]).T  # [N, K]
    missing = values.isnan()
    valid_N = (
        ~missing.any(1) if cfg.train.on_reward_error == "mask" else torch.ones(len(rows), dtype=torch.bool)
    )
    values = values.nan_to_num(0.0)
    metrics: dict[str, float] = {
        "accuracy": sum(task.verify(t, ex) for t, ex in zip(comps.texts, rows, strict=True)) / len(rows)
    }
    for k, (name, _, _) in enumerate(rewards):
        metrics[f"reward/{name}/mean"] = float(values[:, k].mean())
        metrics[f"reward/{name}/errors"] = float(report.errors[k])
        metrics[f"reward/{name}/nonfinite"] = float(report.nonfinite[k])
    for line in report.samples:
        print(f"warning: {line}")
    return values.view(P, G, -1), valid_N.view(P, G), metrics


def policy_update(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    parts: Parts,
    cfg: Config,
    row_prompts: list[list[int]],
    comps: Completions,
    mask_NT: Tensor,
    adv_N: Tensor,
    row_inputs: dict[str, Tensor],
    pad_id: int,
    step: int,
) -> dict[str, float]:
    """Epochs x minibatches of optimizer steps on one rollout batch; returns update metrics.

    ``row_inputs`` holds per-row tensors (``rewards``, ``group_ids``) for losses that declare them.
    """
    n_rows = comps.token_ids.shape[0]
    lp_kwargs = {"pad_id": pad_id, "temperature": cfg.rollout.temperature}
    off_policy = cfg.train.epochs > 1 or cfg.train.minibatches > 1
    with torch.no_grad():  # old log-probs are needed only when later minibatches see a moved policy
        old_NT = (
            completion_logprobs(model, row_prompts, comps.token_ids, mask_NT, **lp_kwargs)[0]
            if off_policy
            else None
        )
        ref_NT = (
            completion_logprobs(ref_model, row_prompts, comps.token_ids, mask_NT, **lp_kwargs)[0]
            if ref_model is not None
            else None
        )
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "minibatch", step))
    sums: dict[str, float] = {}
    count, nonfinite = 0, 0
    model.train()
    for _ in range(cfg.train.epochs):
        order = torch.randperm(n_rows, generator=gen) if off_policy else torch.arange(n_rows)
        for idx in order.chunk(cfg.train.minibatches):
            mask = mask_NT[idx]
            if mask.sum() == 0:
                continue
            prompts = [row_prompts[i] for i in idx.tolist()]
            logp, entropy = completion_logprobs(
                model, prompts, comps.token_ids[idx], mask, with_entropy=True, **lp_kwargs
            )
            old = old_NT[idx] if old_NT is not None else logp.detach()
            available = {
                **{k: v[idx] for k, v in row_inputs.items()},
                "ref_logprobs": ref_NT[idx] if ref_NT is not None else None,
            }
            extra = {k: available[k] for k in parts.loss_inputs if available[k] is not None}
            loss_NT = parts.loss(logp, old, adv_N[idx], mask, **extra)
            kl_value = float("nan")
            if ref_NT is not None and parts.kl is not None:
                kl_NT = parts.kl(logp, ref_NT[idx]) * mask
                loss_NT = loss_NT + parts.kl_coef * kl_NT
                kl_value = float((kl_NT.sum() / mask.sum()).detach())
            loss = parts.aggregate(loss_NT, mask)
            if not torch.isfinite(loss):
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            if not torch.isfinite(grad_norm):
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step()
            with torch.no_grad():
                ratio = torch.exp(logp.detach() - old)
                denom = mask.sum()
                eps_low = float(cfg.algorithm.loss_params.get("eps_low", 0.2))
                eps_high = float(cfg.algorithm.loss_params.get("eps_high", 0.2))
                adv_t = adv_N[idx].reshape(len(idx), -1).expand_as(ratio)
                step_metrics = {
                    "loss": float(loss.detach()),
                    "optim/grad_norm": float(grad_norm),
                    "policy/entropy": float((entropy * mask).sum() / denom),
                    "policy/kl_ref": kl_value,
                    "policy/ratio_mean": float((ratio * mask).sum() / denom),
                    "policy/clip_frac_low": float(
                        (((ratio < 1 - eps_low) & (adv_t < 0)) * mask).sum() / denom
                    ),
                    "policy/clip_frac_high": float(
                        (((ratio > 1 + eps_high) & (adv_t > 0)) * mask).sum() / denom
                    ),
                    "policy/kl_rollout": float(((old - logp.detach()) * mask).sum() / denom),
                }
            for k, v in step_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {k: v / count for k, v in sums.items()} if count else {}
    out["train/nonfinite"] = float(nonfinite)
    out["train/optimizer_steps"] = float(count)
    return out


def write_samples(
    run: Path,
    step: int,
    examples: list[Example],
    comps: Completions,
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
