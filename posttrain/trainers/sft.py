"""Supervised fine-tuning on a task's reference demonstrations (loss on completion tokens only; ``sft.loss``
picks it: maximum likelihood by default, or another entry of ``posttrain.algorithms.sft_losses``).

The demonstrations form a fixed pool of ``sft.demos`` examples (the scarce resource RL does not
need). Training stops at ``sft.steps``, at a wall-clock budget, or as soon as validation accuracy
reaches ``sft.target_accuracy``. Checkpoints use the same atomic format as RL, so ``--resume``
works here too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from posttrain.algorithms import sft_losses
from posttrain.config import Config
from posttrain.envs.task import EnvTask
from posttrain.evaluation import evaluate
from posttrain.learn.chunked import LogitTerm
from posttrain.learn.logprobs import completion_terms, log_partition
from posttrain.models.chat import encode_example
from posttrain.models.lora import engine_weights
from posttrain.models.precision import autocast_dtype, compute
from posttrain.rollout import engine_for
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.rollout.hf import left_pad
from posttrain.run.harness import Finish, Loop, finish_run, run_loop
from posttrain.run.optim import make_optimizer, make_scheduler
from posttrain.run.setup import OpenedRun, Resume, open_run, restore_trainer_state
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example, Task


@dataclass
class SFTState:
    """Loop state saved in checkpoints."""

    step: int = 0
    best_val: float = 0.0


def sft(
    cfg: Config,
    *,
    resume: Resume = False,
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
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    r = SFTRun(cfg, opened)
    if r.val_note:
        console.print(r.val_note)
    s = cfg.sft

    def stop(metrics: dict[str, float]) -> str | None:
        if use_target and s.target_accuracy and metrics.get("sft/val_accuracy", 0.0) >= s.target_accuracy:
            return f"validation accuracy {metrics['sft/val_accuracy']:.2f} >= {s.target_accuracy}"
        if max_seconds is not None and r.train_s >= max_seconds:
            return f"time budget {max_seconds:.0f}s"
        return None

    loop = Loop("sft", s.steps, lambda: r.state.step, r.step, r.checkpoint,
                [("sft/loss", "loss"), ("sft/val_accuracy", "val_acc")],
                evaluate=r.validate, eval_every=s.eval_every, eval_last=True, stop=stop)
    ended = run_loop(cfg, opened, loop, console)
    finish = Finish(f"posttrain sft: {opened.run}", ["sft/loss", "sft/val_accuracy"],
                    summary={"train_s": r.train_s, "best_val": r.state.best_val},
                    rows=[("best validation accuracy", f"{r.state.best_val:.3f}")])
    return finish_run(cfg, opened, loop, ended, finish, time.perf_counter() - t_start, console)


class SFTRun:
    """One SFT run: model, optimizer, demonstration pool and loop state; the run harness
    (:func:`~posttrain.run.harness.run_loop`) calls :meth:`step`, :meth:`validate` and :meth:`checkpoint`.
    """

    def __init__(self, cfg: Config, opened: OpenedRun) -> None:
        s = self.s = cfg.sft
        self.cfg, self.opened = cfg, opened
        task, tokenizer = opened.task, opened.tokenizer
        self.engine = engine_for(cfg, opened.model, tokenizer)
        self.optimizer = make_optimizer(opened.model, s.lr, (0.9, 0.99), s.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, s.warmup_steps, max(s.steps, 1), "constant")
        self.state = SFTState()
        if opened.ckpt:
            self.state = SFTState(**restore_trainer_state(opened.ckpt, self.optimizer, self.scheduler))
        pool = task.examples("train", s.demos, seed=derive_seed(cfg.seed, "sft-pool"))
        self.val, self.val_note = held_back(task, pool, s.eval_prompts, derive_seed(cfg.seed, "sft-val"))
        self.prompts, self.targets, self.loss_masks = demonstration_rows(cfg, task, tokenizer, pool)
        self.train_s = 0.0  # seconds spent in steps (the demo's equal-time control)

    def step(self) -> dict[str, float]:
        """One optimizer step on a batch of demonstrations (loss on completion tokens only)."""
        t0 = time.perf_counter()
        s, model, pad_id = self.s, self.opened.model, self.opened.tokenizer.pad_token_id
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "sft-batch", self.state.step))
        idx = torch.randint(len(self.targets), (s.batch_size,), generator=gen).tolist()
        loss, grad_norm = sft_update(model, self.optimizer, self.scheduler, [self.prompts[i] for i in idx],
                                     [self.targets[i] for i in idx], [self.loss_masks[i] for i in idx], pad_id,
                                     autocast_dtype(self.cfg.model.autocast), s.loss, s.loss_params)
        self.state.step += 1
        self.train_s += time.perf_counter() - t0
        return {"sft/loss": loss, "optim/grad_norm": grad_norm,
                "optim/lr": self.scheduler.get_last_lr()[0], "time/step_s": time.perf_counter() - t0}

    def validate(self) -> dict[str, float]:
        """Greedy accuracy on held-back training prompts (``sft/val_accuracy``; see :func:`held_back`)."""
        cfg = self.cfg
        self.engine.sync(engine_weights(self.opened.model, self.engine), self.state.step)  # own copy (vllm)
        ev = evaluate(self.engine, self.opened.tokenizer, self.opened.task, self.val,
                      max_new_tokens=cfg.rollout.max_new_tokens, system_prompt=cfg.task.system_prompt)
        self.state.best_val = max(self.state.best_val, ev["pass@1"])
        return {"sft/val_accuracy": ev["pass@1"]}

    def checkpoint(self) -> Path:
        """Save the run as it is now (the adapter with LoRA); the checkpoint directory."""
        return self.opened.checkpoint(self.state, self.optimizer, self.scheduler, self.cfg.checkpoint.keep)


def held_back(task: Task, pool: list[Example], n: int, seed: int) -> tuple[list[Example], str | None]:
    """``n`` training-split examples that are not problems of the demonstration ``pool`` (same prompt and
    answer), and a note when there are none: SFT fits the pool for many epochs, so a pool problem among the
    validation ones is answered from memory (with 500 demonstrations of 2-digit addition, 15 of 200
    validation prompts were pool prompts: one SFT run's best validation accuracy read 0.37 with them, 0.32
    without). Drawn from ``seed``'s stream with pool problems skipped (so a stream with none gives
    the examples it gave before); fewer than ``n`` when the stream has no more. A pool that covers the
    task's training problems (an environment with 16 hidden numbers) leaves none: then the plain draw,
    pool problems and all, with a note saying so.
    """
    seen = {(ex.prompt, ex.answer) for ex in pool}
    drawn = task.examples("train", 4 * n, seed=seed)
    got = [ex for ex in drawn if (ex.prompt, ex.answer) not in seen][:n]
    if got:
        return got, None
    return drawn[:n], (f"note: the {len(pool)} demonstrations cover every training problem drawn for validation, "
                       "so sft/val_accuracy is measured on problems SFT trains on")


# The inputs an SFT loss may declare (algorithms/sft_losses.py INPUTS), each a per-token term of the logits,
# computed with gradient in the forward pass of the log-probs only for a loss that declares it.
SFT_TERMS: dict[str, LogitTerm] = {"logsumexp": log_partition}


def demonstration_loss(
    model: torch.nn.Module,
    prompts: list[list[int]],
    targets: list[list[int]],
    loss_masks: list[list[float]],
    pad_id: int,
    loss: str = "mle",
    loss_params: dict | None = None,
) -> Tensor:
    """The SFT loss of a batch of (prompt, completion) rows: the token mean of a per-token loss.

    The per-token loss is ``loss`` (``sft.loss``, ``posttrain.algorithms.sft_losses``; ``mle``, the default, is
    the negative log-likelihood):

        L = sum_{n,t} m_{n,t} l_{n,t} / sum_{n,t} m_{n,t},   mle: l_{n,t} = -log pi(y_{n,t} | x_n, y_{n,<t})

    over the completion tokens ``targets`` (N lists, EOS included when the row has one) with their
    loss masks ``m`` (``loss_masks``, 1 on what the policy writes: a multi-turn demonstration's
    environment replies are attended to, not trained). Prompts are never trained. A scalar with gradient.
    The inputs the loss declares (:data:`SFT_TERMS`) come from the same forward pass.
    """
    ids_NT, _ = left_pad([t[::-1] for t in targets], pad_id)
    ids_NT = ids_NT.flip(1)  # right-padded completion ids
    width = ids_NT.shape[1]
    attn_NT = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in targets])
    needs = sft_losses.inputs(loss)
    logp_NT, _, extra = completion_terms(model, prompts, ids_NT, attn_NT, pad_id=pad_id,
                                         terms=[SFT_TERMS[k] for k in needs])
    mask_NT = torch.tensor([m + [0.0] * (width - len(m)) for m in loss_masks]).to(logp_NT.device)
    loss_NT = sft_losses.compute(loss, logp_NT, mask_NT, **dict(zip(needs, extra, strict=True)), **(loss_params or {}))
    return loss_NT.sum() / mask_NT.sum()


def sft_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    prompts: list[list[int]],
    targets: list[list[int]],
    loss_masks: list[list[float]],
    pad_id: int,
    autocast: torch.dtype | None = None,
    loss: str = "mle",
    loss_params: dict | None = None,
) -> tuple[float, float]:
    """One optimizer step on :func:`demonstration_loss` of the batch (gradient norm clipped to 1);
    returns the loss and the gradient norm before clipping. What ``posttrain sft`` and each round of
    ``posttrain rft`` (``trainers/rft.py``) train with. ``autocast``: the matmuls' dtype
    (``model.autocast``; ``models/precision.py``), ``None``: the weights'. ``loss``, ``loss_params``: the SFT
    loss (``sft.loss``; ``mle`` by default, as ``rft`` trains).
    """
    model.train()
    with compute(next(model.parameters()).device, autocast):
        loss_value = demonstration_loss(model, prompts, targets, loss_masks, pad_id, loss, loss_params)
    optimizer.zero_grad(set_to_none=True)
    loss_value.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return float(loss_value.detach()), float(grad_norm)


def demonstration_rows(
    cfg: Config, task: Task, tokenizer: PreTrainedTokenizerBase, pool: list[Example]
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Prompt ids, completion ids and loss masks of the demonstrations: the example's prompt and its
    demonstration + EOS (all trained); in a multi-turn environment (``task.name = "env"``) its expert
    transcript, laid out as the ``multi_turn`` driver lays out an episode (only assistant turns trained).
    """
    if isinstance(task, EnvTask):
        delta = ChatDelta(tokenizer)
        rows = [delta.transcript_ids(task.demonstration(ex, derive_seed(cfg.seed, "sft-demo", i)))
                for i, ex in enumerate(pool)]
        return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    eos = [int(tokenizer.eos_token_id)]
    prompts = [encode_example(tokenizer, ex, cfg.task.system_prompt) for ex in pool]
    targets = [list(tokenizer(ex.demonstration, add_special_tokens=False)["input_ids"]) + eos for ex in pool]
    return prompts, targets, [[1.0] * len(t) for t in targets]
