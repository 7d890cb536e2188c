"""Preference optimization (DPO family) on (prompt, chosen, rejected) pairs: ``posttrain dpo``.

Per step, for a batch of B pairs: the summed log-probs of the chosen and rejected completions
(completion tokens only, EOS included) under the policy and under the reference, the frozen
starting model; then the per-pair loss ``preference.compute(cfg.dpo.loss, ...)`` averaged over
the batch, AdamW with warm-up and gradient clipping. The loss is looked up by name: no branch on
the method here. Extra inputs are computed when the loss declares them (``preference.inputs``):
- ``chosen_risk`` / ``rejected_risk`` [B] (Ra-DPO): :func:`~posttrain.algorithms.preference.token_risk`
  of the full-vocabulary per-token log-probs of policy (with gradient) and reference, at
  ``dpo.risk_confidence``;
- ``prev_chosen_logps`` / ``prev_rejected_logps`` [B] (INPO): the sums under the previous iterate
  pi_t, a frozen copy of the policy taken at each iteration start: when task pairs are (re)built
  (pi_t is then the policy that sampled them), or every ``dpo.iterate_every`` steps for file pairs.
  pi_t's sums over the whole pool are computed then, in one no-gradient pass, and kept in the
  checkpointed state, so no second model is held and a resumed run uses the same numbers.
The config rejects losses needing any other input.

Logged per step: ``dpo/loss``; ``dpo/chosen_logratio`` and ``dpo/rejected_logratio`` (batch means
of m = log pi(y) - log pi_ref(y)); ``dpo/reward_margin`` (mean of h = m_w - m_l, the implicit
reward margin without beta); ``dpo/accuracy`` (fraction of pairs with h > 0); ``dpo/<input>`` (the
batch mean of each extra input above); ``dpo/pairs`` (pairs available), ``dpo/pairs_used`` (pairs
trained on so far), optimizer figures, and for task pairs the
statistics of :func:`~posttrain.trainers.dpo_pairs.task_pairs` at each refresh. At step 1 the policy
equals the reference, so h = 0 and the ``dpo`` loss is log 2.

Differences from TRL's ``DPOTrainer``: pairs may be built on-policy from a verifiable task
(refreshed every ``dpo.refresh_every`` steps, iterative-DPO style, reference still the start
model); batches are drawn without replacement within a step and with replacement across steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor
from transformers import PreTrainedModel

from posttrain.algorithms import preference
from posttrain.config import Config
from posttrain.config.trainers import DPOConfig
from posttrain.evaluation import evaluate
from posttrain.learn.logprobs import completion_logits
from posttrain.models.lora import engine_weights
from posttrain.models.precision import autocast_dtype, compute
from posttrain.rollout import engine_for
from posttrain.rollout.hf import left_pad
from posttrain.run.harness import Finish, Loop, StopRun, finish_run, run_loop
from posttrain.run.optim import make_optimizer, make_scheduler
from posttrain.run.setup import OpenedRun, Resume, open_run, restore_trainer_state
from posttrain.seeds import derive_seed
from posttrain.trainers.dpo_pairs import TokenPair, read_pairs, task_pairs


@dataclass
class DPOState:
    """Loop state saved in checkpoints (task pairs are kept, so a resumed run trains on the same ones)."""

    step: int = 0
    pairs_used: int = 0
    best_val: float = 0.0
    built_at: int = -1  # step at which the task pairs were last built; -1: never
    pool: list = field(default_factory=list)  # task pairs as [prompt, chosen, rejected] id lists
    prev_at: int = -1  # INPO: step at which the previous iterate pi_t was last taken; -1: never
    prev_logps: Tensor | None = None  # INPO: pi_t's (chosen, rejected) sums of every pool pair, [N, 2]


def pair_logps(
    model: PreTrainedModel, pairs: list[TokenPair], pad_id: int, *, vocab: bool = False
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Summed completion log-probs (EOS included) of the chosen and rejected of ``pairs``: ``[B]``, ``[B]``,
    then the full-vocabulary log-probs ``[2B, T, V]`` when ``vocab`` (else None) and the completion
    mask ``[2B, T]``.

    One forward over 2B rows (chosen rows, then rejected rows); a pair's two rows share the prompt's
    forward pass (see :func:`~posttrain.learn.logprobs.completion_logits`).
    """
    completions = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ids_NT, mask_NT = left_pad([c[::-1] for c in completions], pad_id)
    ids_NT, mask_NT = ids_NT.flip(1), mask_NT.flip(1).float()  # right-padded completions
    logits_NTV = completion_logits(model, [p.prompt for p in pairs] * 2, ids_NT, mask_NT, pad_id=pad_id)
    logp_NTV = logits_NTV.log_softmax(-1)
    mask_NT = mask_NT.to(logp_NTV.device)
    logp_NT = logp_NTV.gather(-1, ids_NT.to(logp_NTV.device)[..., None])[..., 0]
    seq_N = (logp_NT * mask_NT).sum(-1)
    return seq_N[: len(pairs)], seq_N[len(pairs) :], logp_NTV if vocab else None, mask_NT


@torch.no_grad()
def pool_logps(model: PreTrainedModel, pool: list[TokenPair], pad_id: int, chunk: int) -> Tensor:
    """(chosen, rejected) summed log-probs of every pair of ``pool`` under ``model``: ``[N, 2]`` on the CPU."""
    was_training = model.training
    model.eval()
    rows = [torch.stack(pair_logps(model, pool[i : i + chunk], pad_id)[:2], 1) for i in range(0, len(pool), chunk)]
    model.train(was_training)
    return torch.cat(rows).float().cpu()


def iteration_starts(state: DPOState, d: DPOConfig) -> bool:
    """INPO: is the previous iterate due? Task pairs: whenever they were rebuilt since it was taken;
    file pairs: at the start, then every ``d.iterate_every`` steps (0 = never again).
    """
    if d.pairs == "task":
        return state.prev_at != state.built_at
    return state.prev_at < 0 or (d.iterate_every > 0 and state.step - state.prev_at >= d.iterate_every)


def dpo_train(cfg: Config, *, resume: Resume = False, console: Console | None = None) -> dict:
    """Run preference optimization as ``cfg.dpo`` says; returns the summary (also ``summary.json``)."""
    console = console or Console()
    t_start = time.perf_counter()
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    r = DPORun(cfg, opened, console)
    d = cfg.dpo
    loop = Loop("dpo", d.steps, lambda: r.state.step, r.step, r.checkpoint,
                [("dpo/loss", "loss"), ("dpo/accuracy", "acc"), ("eval/pass@1", "pass@1")],
                evaluate=r.validate, eval_every=d.eval_every, eval_last=bool(d.eval_every))
    ended = run_loop(cfg, opened, loop, console)
    st = r.state
    finish = Finish(f"posttrain dpo: {opened.run}", ["dpo/loss", "dpo/reward_margin", "dpo/accuracy"],
                    summary={"pairs_used": st.pairs_used, "best_val": st.best_val},
                    rows=[("pairs used", str(st.pairs_used)), ("best eval pass@1", f"{st.best_val:.3f}")])
    return finish_run(cfg, opened, loop, ended, finish, time.perf_counter() - t_start, console)


class DPORun:
    """One preference-optimization run: its models, optimizer, pairs and loop state; the run harness
    (:func:`~posttrain.run.harness.run_loop`) calls :meth:`step`, :meth:`validate` and :meth:`checkpoint`.
    """

    def __init__(self, cfg: Config, opened: OpenedRun, console: Console) -> None:
        d = self.d = cfg.dpo
        self.cfg, self.opened = cfg, opened
        tokenizer, model = opened.tokenizer, opened.model
        self.ref = opened.reference(cfg)  # a second copy, or with LoRA the policy with its adapter off
        self.pad_id, self.context = int(tokenizer.pad_token_id), model.config.max_position_embeddings
        self.engine = engine_for(cfg, model, tokenizer)
        self.optimizer = make_optimizer(model, d.lr, (0.9, 0.99), d.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, d.warmup_steps, max(d.steps, 1), "constant")
        needs = set(preference.inputs(d.loss))  # extra inputs, computed only when the loss declares them
        self.wants_risk, self.wants_prev = bool(needs & set(d.RISK_INPUTS)), bool(needs & set(d.PREV_INPUTS))
        self.state = DPOState()
        if opened.ckpt:
            self.state = DPOState(**restore_trainer_state(opened.ckpt, self.optimizer, self.scheduler))
            console.print(f"[bold]resumed[/] from {opened.ckpt} at step {self.state.step}")
        self.file_pool: list[TokenPair] = []
        if d.pairs == "file":
            read = read_pairs(d.path, tokenizer, fields=d.fields, format=d.format, system_prompt=cfg.task.system_prompt)
            self.file_pool = [p for p in read if self.fits(p)]
            console.print(f"dpo: {len(self.file_pool)} pairs from {d.path} ({len(read) - len(self.file_pool)} longer "
                          f"than the context of {self.context} tokens dropped)")
        seed = derive_seed(cfg.seed, "dpo-eval")
        self.val = opened.task.examples("test", d.eval_prompts, seed=seed) if d.eval_every else []

    def fits(self, p: TokenPair) -> bool:
        """Whether the prompt plus the longer completion fits the model's context."""
        return len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= self.context

    def pairs(self, metrics: dict[str, float]) -> list[TokenPair]:
        """The pairs to draw from now: the file's, or the task's, (re)built on-policy when due."""
        d, state, cfg = self.d, self.state, self.cfg
        stale = state.built_at < 0 or (d.refresh_every > 0 and state.step - state.built_at >= d.refresh_every)
        if d.pairs == "task" and stale:
            seed = derive_seed(cfg.seed, "dpo-pairs", state.step)
            examples = self.opened.task.examples("train", d.prompts_per_refresh, seed=seed)
            self.engine.sync(engine_weights(self.opened.model, self.engine), state.step)  # an engine with its own copy
            built, stats = task_pairs(
                self.engine, self.opened.tokenizer, self.opened.task, examples, group_size=d.group_size,
                max_new_tokens=cfg.rollout.max_new_tokens, temperature=d.temperature,
                system_prompt=cfg.task.system_prompt, seed=seed,
            )
            state.pool = [[p.prompt, p.chosen, p.rejected] for p in built if self.fits(p)]
            state.built_at = state.step
            metrics.update(stats)
        pool = self.file_pool or [TokenPair(*p) for p in state.pool]
        if not pool:
            raise StopRun("no pairs (every sample of every prompt verified)" if d.pairs == "task" else "no pairs")
        return pool

    def step(self) -> dict[str, float]:
        """One optimizer step on a batch of pairs; its metrics."""
        d, state, model = self.d, self.state, self.opened.model
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        pool = self.pairs(metrics)
        if self.wants_prev and iteration_starts(state, d):
            state.prev_logps = pool_logps(model, pool, self.pad_id, d.batch_size)  # pi_t := the policy now
            state.prev_at = state.step
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "dpo-batch", state.step))
        idx = torch.randperm(len(pool), generator=gen)[: d.batch_size].tolist()
        batch = [pool[i] for i in idx]
        model.train()
        with compute(next(model.parameters()).device, autocast_dtype(self.cfg.model.autocast)):  # model.autocast
            chosen_B, rejected_B, logp_NTV, mask_NT = pair_logps(model, batch, self.pad_id, vocab=self.wants_risk)
            with torch.no_grad():
                ref_chosen_B, ref_rejected_B, ref_logp_NTV, _ = pair_logps(self.ref, batch, self.pad_id,
                                                                          vocab=self.wants_risk)
        extra: dict[str, Tensor] = {}
        if self.wants_risk:
            risk_N = preference.token_risk(logp_NTV, ref_logp_NTV, mask_NT, confidence=d.risk_confidence)
            extra.update(chosen_risk=risk_N[: len(batch)], rejected_risk=risk_N[len(batch) :])
        if self.wants_prev:
            prev_B2 = state.prev_logps[idx].to(chosen_B.device)
            extra.update(prev_chosen_logps=prev_B2[:, 0], prev_rejected_logps=prev_B2[:, 1])
        loss = preference.compute(d.loss, chosen_B, rejected_B, ref_chosen_B, ref_rejected_B, **extra,
                                  **d.loss_params).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), d.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        state.step += 1
        state.pairs_used += len(batch)
        m_w, m_l = (chosen_B - ref_chosen_B).detach(), (rejected_B - ref_rejected_B).detach()
        return metrics | {
            "dpo/loss": float(loss.detach()),
            "dpo/chosen_logratio": float(m_w.mean()),
            "dpo/rejected_logratio": float(m_l.mean()),
            "dpo/reward_margin": float((m_w - m_l).mean()),
            "dpo/accuracy": float((m_w > m_l).float().mean()),
            "dpo/pairs": float(len(pool)),
            "dpo/pairs_used": float(state.pairs_used),
            "optim/grad_norm": float(grad_norm),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "time/step_s": time.perf_counter() - t0,
            **{f"dpo/{k}": float(v.detach().float().mean()) for k, v in extra.items()},
        }

    def validate(self) -> dict[str, float]:
        """Held-out pass@1 of the policy (``eval/pass@1``)."""
        cfg = self.cfg
        self.engine.sync(engine_weights(self.opened.model, self.engine), self.state.step)
        ev = evaluate(self.engine, self.opened.tokenizer, self.opened.task, self.val,
                      max_new_tokens=cfg.rollout.max_new_tokens, system_prompt=cfg.task.system_prompt)
        self.state.best_val = max(self.state.best_val, ev["pass@1"])
        return {"eval/pass@1": ev["pass@1"]}

    def checkpoint(self) -> Path:
        """Save the run as it is now (the adapter with LoRA); the checkpoint directory."""
        return self.opened.checkpoint(self.state, self.optimizer, self.scheduler, self.cfg.checkpoint.keep)
