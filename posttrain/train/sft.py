"""Supervised fine-tuning on a task's reference demonstrations (loss on completion tokens only).

The demonstrations form a fixed pool of ``sft.demos`` examples (the scarce resource RL does not
need). Training stops at ``sft.steps``, at a wall-clock budget, or as soon as validation accuracy
reaches ``sft.target_accuracy``. Checkpoints use the same atomic format as RL, so ``--resume``
works here too.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from rich.console import Console

from posttrain.config import Config
from posttrain.evaluation import evaluate
from posttrain.models.load import encode_chat
from posttrain.reporting.plots import plot_metrics
from posttrain.reporting.progress import fmt_metrics, make_progress
from posttrain.reporting.sinks import MetricSinks, read_metrics
from posttrain.rollout import make_engine
from posttrain.rollout.hf import left_pad
from posttrain.train.logprobs import completion_logprobs
from posttrain.train.optim import make_optimizer, make_scheduler
from posttrain.train.setup import derive_seed, open_run, restore_trainer_state, save_trainer_checkpoint


@dataclass
class SFTState:
    """Loop state saved in checkpoints."""

    step: int = 0
    best_val: float = 0.0


def sft(
    cfg: Config,
    *,
    resume: bool = False,
    max_seconds: float | None = None,
    use_target: bool = True,
    console: Console | None = None,
) -> dict:
    """Run SFT as configured; returns the summary (also written to ``summary.json``).

    ``max_seconds`` stops after that much training wall-clock (the demo's equal-time control);
    ``use_target=False`` ignores ``sft.target_accuracy``.
    """
    console = console or Console()
    t_start = time.perf_counter()
    s = cfg.sft
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    task, run, ckpt_root, ckpt = opened.task, opened.run, opened.ckpt_root, opened.ckpt
    tokenizer, model = opened.tokenizer, opened.model
    saved = opened.saved  # what checkpoints hold: the adapter with LoRA, else the policy
    engine = make_engine(cfg.rollout.engine, model, tokenizer)
    optimizer = make_optimizer(model, s.lr, (0.9, 0.99), s.weight_decay)
    scheduler = make_scheduler(optimizer, s.warmup_steps, max(s.steps, 1), "constant")
    state = SFTState()
    if ckpt:
        state = SFTState(**restore_trainer_state(ckpt, optimizer, scheduler))
    pool = task.examples("train", s.demos, seed=derive_seed(cfg.seed, "sft-pool"))
    val = task.examples("train", s.eval_prompts, seed=derive_seed(cfg.seed, "sft-val"))
    eos = [int(tokenizer.eos_token_id)]
    prompts = [encode_chat(tokenizer, ex.prompt, cfg.task.system_prompt) for ex in pool]
    targets = [list(tokenizer(ex.demonstration, add_special_tokens=False)["input_ids"]) + eos for ex in pool]
    sinks = MetricSinks(run, cfg.log, start_step=state.step, config=cfg.model_dump(mode="json"))
    progress = make_progress(console, "sft", cfg.log.progress)
    bar = progress.add_task("sft", total=s.steps, completed=state.step, metrics="")
    reason = "max steps"
    train_s = 0.0
    with progress:
        while state.step < s.steps:
            t0 = time.perf_counter()
            gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "sft-batch", state.step))
            idx = torch.randint(len(pool), (s.batch_size,), generator=gen).tolist()
            ids_NT, _ = left_pad([targets[i][::-1] for i in idx], tokenizer.pad_token_id)
            ids_NT = ids_NT.flip(1)  # right-padded completion ids
            mask_NT = torch.tensor(
                [[1.0] * len(targets[i]) + [0.0] * (ids_NT.shape[1] - len(targets[i])) for i in idx]
            )
            model.train()
            logp, _ = completion_logprobs(
                model, [prompts[i] for i in idx], ids_NT, mask_NT, pad_id=tokenizer.pad_token_id
            )
            loss = -(logp * mask_NT).sum() / mask_NT.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            state.step += 1
            train_s += time.perf_counter() - t0
            metrics = {
                "sft/loss": float(loss.detach()),
                "optim/grad_norm": float(grad_norm),
                "optim/lr": scheduler.get_last_lr()[0],
                "time/step_s": time.perf_counter() - t0,
            }
            if state.step % s.eval_every == 0 or state.step == s.steps:
                ev = evaluate(
                    engine,
                    tokenizer,
                    task,
                    val,
                    max_new_tokens=cfg.rollout.max_new_tokens,
                    system_prompt=cfg.task.system_prompt,
                )
                metrics["sft/val_accuracy"] = ev["pass@1"]
                state.best_val = max(state.best_val, ev["pass@1"])
            sinks.write(state.step, metrics)
            progress.update(
                bar,
                completed=state.step,
                metrics=fmt_metrics(metrics, [("sft/loss", "loss"), ("sft/val_accuracy", "val_acc")]),
            )
            if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
                save_trainer_checkpoint(ckpt_root, state, saved, tokenizer, optimizer, scheduler, cfg.checkpoint.keep)
            if use_target and s.target_accuracy and metrics.get("sft/val_accuracy", 0.0) >= s.target_accuracy:
                reason = f"validation accuracy {metrics['sft/val_accuracy']:.2f} >= {s.target_accuracy}"
                break
            if max_seconds is not None and train_s >= max_seconds:
                reason = f"time budget {max_seconds:.0f}s"
                break
    final = save_trainer_checkpoint(ckpt_root, state, saved, tokenizer, optimizer, scheduler, cfg.checkpoint.keep)
    sinks.close()
    opened.export(cfg)  # model.lora.merge_on_export: RUN/merged
    plot_metrics(
        read_metrics(run / "metrics.jsonl"), ["sft/loss", "sft/val_accuracy"], run / "plots" / "sft.png"
    )
    summary = {
        "steps": state.step,
        "stopped": reason,
        "train_s": train_s,
        "wall_s": time.perf_counter() - t_start,
        "checkpoint": str(final),
        "run_dir": str(run),
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"sft: {state.step} steps ({reason}); checkpoint {final}")
    return summary
