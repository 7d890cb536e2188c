"""Rejection-sampling fine-tuning (expert iteration): ``posttrain rft``.

Each of ``rft.rounds`` rounds is one expectation-maximization step of ReST-EM (Singh et al. 2023,
arXiv:2312.06585), the outer loop of STaR (Zelikman et al. 2022, arXiv:2203.14465) and one stage of
RAFT (Dong et al. 2023, arXiv:2304.06767):

1. sample (E-step, "Grow"): the current policy samples G = ``rft.samples_per_prompt`` completions for
   each of P = ``rft.prompts_per_round`` training prompts, through the rollout driver and engine the RL
   loop uses (``produce/drivers/registry.py::produce``, ``rollout.engine_for``), in generation batches of
   ``rollout.prompts_per_step`` prompts, and the run's ``[[reward]]`` components score them;
2. keep: the samples whose weighted reward is >= ``rft.keep_threshold``, each prompt's repeats dropped
   (``rft.dedup``), at most ``rft.max_per_prompt`` per prompt, highest reward first
   (``trainers/rft_keep.py::keep_samples``);
3. fine-tune (M-step, "Improve"): ``rft.sft_steps`` AdamW steps of the SFT loss
   (``trainers/sft.py::sft_update``) on the kept (prompt, completion) pairs, a fresh optimizer with its
   warm-up each round, starting from the starting model (``rft.restart_from_base = true``: ReST-EM's
   and STaR's choice, which they report overfits and drifts less) or from the current policy (``false``:
   RAFT's choice);
4. evaluate: held-out pass@1 with the run's ``[eval]`` settings (every ``rft.eval_every`` rounds and
   after the last).

The defaults are ReST-EM's: a binary filter (the task's verifier, threshold 1), fine-tuning from the
starting model. Departures: the kept set of a round is deduplicated by default (on short answers most
correct samples of a prompt are one string; the papers keep repeats, and ReST-EM caps them per
problem); a round that keeps nothing trains on nothing and leaves the policy as it was (rather than
resetting it to the starting model); the number of fine-tuning steps is fixed per round (STaR grows it
by 20 % per outer loop; ReST-EM sizes it to the data).

Logged per round: ``rft/verified``, ``rft/kept``, ``rft/kept_frac`` (kept / P G), ``rft/prompts_with_kept``
(prompts with at least one kept sample), ``rft/duplicates``, ``rft/capped``, ``rft/kept_total``,
``rft/kept_nll_start`` and ``rft/kept_nll_end`` (token-mean NLL of the kept completions before and after
the round's fine-tuning), ``sft/loss`` (its mean over the round's steps; ``sft/loss_first``,
``sft/loss_last``), ``rft/sft_steps``, the sampler's ``accuracy`` and ``reward/...``, ``eval/pass@1``
and the other ``[eval]`` metrics. The kept samples are appended to ``RUN/rft_kept.jsonl``. A checkpoint
(``checkpoint.every`` counts rounds) holds the policy after its round, so ``--resume`` continues exactly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from posttrain.config import Config, ConfigError, ProduceSettings
from posttrain.evaluation.sampled import evaluate_config
from posttrain.models.load import load_model
from posttrain.models.lora import engine_weights
from posttrain.models.precision import autocast_dtype
from posttrain.produce.drivers import ProduceContext, produce
from posttrain.reporting.sinks import keep_steps
from posttrain.rewards import RewardPool, pool_for
from posttrain.rollout import SamplingParams, engine_for
from posttrain.run.harness import Finish, Loop, finish_run, run_loop
from posttrain.run.optim import make_optimizer, make_scheduler
from posttrain.run.setup import OpenedRun, Resume, open_run, restore_trainer_state
from posttrain.seeds import derive_seed
from posttrain.trainers.rft_keep import KeptRows, completion_keys, keep_samples, kept_rows
from posttrain.trainers.sft import demonstration_loss, sft_update

# hint_reroll (produce/drivers/hint.py): all-wrong groups are sampled again with the example's hint and trained on
# the plain question, as STaR's rationalization trains rationales found with the answer as a hint
DRIVERS = ("single_turn", "hint_reroll")
PROGRESS_KEYS = [("rft/kept", "kept"), ("rft/kept_frac", "kept_frac"), ("sft/loss", "loss"),
                 ("eval/pass@1", "pass@1")]
KEPT_LOG = "rft_kept.jsonl"


def check_rft(cfg: Config) -> None:
    """What ``posttrain rft`` cannot run, as a :class:`ConfigError` before any model loads."""
    if cfg.rollout.driver not in DRIVERS:
        raise ConfigError(f"rollout.driver: posttrain rft samples with {list(DRIVERS)}; got {cfg.rollout.driver!r}")
    if cfg.model.lora.enabled and cfg.rft.restart_from_base:
        raise ConfigError("rft.restart_from_base = true with model.lora: restarting an adapter from the starting "
                          "model is not supported; set rft.restart_from_base=false (RAFT) or train without LoRA")


@dataclass
class RFTState:
    """Loop state saved in checkpoints (after a round: the policy is that round's fine-tuned model)."""

    step: int = 0  # rounds completed
    cursor: int = 0  # prompts consumed from the training stream
    sft_steps: int = 0  # fine-tuning optimizer steps over all rounds (the policy version the engine samples)
    kept_total: int = 0  # samples kept over all rounds
    baseline: float | None = None  # held-out pass@1 of the starting model, before round 1
    best_eval: float = 0.0


def rft(cfg: Config, *, resume: Resume = False, console: Console | None = None) -> dict:
    """Run rejection-sampling fine-tuning as ``cfg.rft`` says; returns the summary (also ``summary.json``).
    It is the Expert Iteration baseline of seed ``papers/004_f298e9ec572f7f27.txt:231``.

    The reward worker pool starts first (forked before any model loads), as in ``posttrain train``.
    """
    check_rft(cfg)
    pool = pool_for(cfg.scoring)
    try:
        return _rft(cfg, resume, console or Console(), pool)
    finally:
        if pool is not None:
            pool.close()


def _rft(cfg: Config, resume: Resume, console: Console, pool: RewardPool | None) -> dict:
    """Open the run, then the rounds through the shared harness (sinks, progress, eval and checkpoint
    cadence, Ctrl-C, summary).
    """
    t_start = time.perf_counter()
    opened = open_run(cfg, resume)
    if opened.data_note:
        console.print(opened.data_note)
    r = RFTRun(cfg, opened, pool, console)
    loop = Loop("rft", cfg.rft.rounds, lambda: r.state.step, r.step, r.checkpoint, PROGRESS_KEYS,
                evaluate=r.validate, eval_every=cfg.rft.eval_every, eval_last=True)
    ended = run_loop(cfg, opened, loop, console)
    final = {k.removeprefix("eval/"): v for k, v in ended.metrics.items() if k.startswith("eval/")}
    final = final or {k.removeprefix("eval/"): v for k, v in r.validate().items()}
    st = r.state
    base = st.baseline if st.baseline is not None else float("nan")
    finish = Finish(
        f"posttrain rft: {opened.run}", ["rft/kept_frac", "sft/loss", "eval/pass@1"],
        summary={"baseline": st.baseline, "final": final, "gain": final["pass@1"] - base,
                 "kept_total": st.kept_total, "sft_steps": st.sft_steps, "best_eval": st.best_eval},
        rows=[("held-out pass@1", f"{base:.3f} -> {final['pass@1']:.3f}"),
              ("samples kept", str(st.kept_total)), ("fine-tuning steps", str(st.sft_steps))],
        plot_title="rejection-sampling fine-tuning",
    )
    return finish_run(cfg, opened, loop, ended, finish, time.perf_counter() - t_start, console)


class RFTRun:
    """One RFT run: the policy, its engine and rewards, the starting weights and loop state; the run harness
    (:func:`~posttrain.run.harness.run_loop`) calls :meth:`step` (one round), :meth:`validate` and
    :meth:`checkpoint`.
    """

    def __init__(self, cfg: Config, opened: OpenedRun, pool: RewardPool | None, console: Console) -> None:
        f, r = cfg.rft, cfg.rollout
        self.cfg, self.opened, self.pool, self.console = cfg, opened, pool, console
        task, tokenizer, model = opened.task, opened.tokenizer, opened.model
        self.engine = engine_for(cfg, model, tokenizer)
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, n=f.samples_per_prompt, min_new_tokens=r.min_new_tokens)
        rewards = [(s.name, dict(s.params)) for s in cfg.reward]
        weights_K = torch.tensor([s.weight for s in cfg.reward])
        self.produce_ctx = ProduceContext(task, tokenizer, self.engine, sampling, rewards, weights_K,
                                          ProduceSettings.of(cfg), pool)
        self.optimizer, self.scheduler = self.new_optimizer()
        self.state = RFTState()
        if opened.ckpt:
            self.state = RFTState(**restore_trainer_state(opened.ckpt, self.optimizer, self.scheduler))
            console.print(f"[bold]resumed[/] from {opened.ckpt} after round {self.state.step}")
        # ReST-EM's M-step starts from the starting model: its weights, read from where the run started
        self.base = (load_model(opened.base_path, cfg.model.dtype, "cpu").state_dict()
                     if f.restart_from_base else None)
        self.eval_examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
        keep_steps(opened.run / KEPT_LOG, self.state.step)  # rounds re-run after a crash are not logged twice
        if self.state.step == 0 and self.state.baseline is None:
            self.state.baseline = self.held_out()["pass@1"]
            console.print(f"held-out pass@1 of the starting model: {self.state.baseline:.3f}")

    def new_optimizer(self) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """A fresh AdamW and its warm-up schedule (each round's fine-tuning is a new job on a new data set)."""
        f = self.cfg.rft
        optimizer = make_optimizer(self.opened.model, f.lr, (0.9, 0.99), f.weight_decay)
        return optimizer, make_scheduler(optimizer, f.warmup_steps, f.sft_steps, "constant")

    def step(self) -> dict[str, float]:
        """One round: sample and score, keep, fine-tune; advances the loop state and returns the metrics."""
        t0 = time.perf_counter()
        st = self.state
        self.engine.sync(engine_weights(self.opened.model, self.engine), st.sft_steps)  # own copy (vllm)
        rows, metrics = self.sample()
        t1 = time.perf_counter()
        metrics |= self.fine_tune(rows)
        st.step += 1
        st.kept_total += len(rows.targets)
        self.log_kept(rows)
        t2 = time.perf_counter()
        return metrics | {"rft/kept_total": float(st.kept_total), "time/sample_s": t1 - t0,
                          "time/sft_s": t2 - t1, "time/step_s": t2 - t0}

    def sample(self) -> tuple[KeptRows, dict[str, float]]:
        """Steps 1-2: sample the round's P prompts x G completions in generation batches, score them and
        apply the keep rule; returns the kept rows and the round's sampling and keep metrics.
        """
        cfg, f, st = self.cfg, self.cfg.rft, self.state
        rows = KeptRows([], [], [], [], [])
        weighted: dict[str, float] = {}
        rewards, done, batch = [], 0, 0
        verified = duplicates = capped = with_kept = 0
        while done < f.prompts_per_round:
            n = min(cfg.rollout.prompts_per_step, f.prompts_per_round - done)
            out, _ = produce(self.batch_ctx(n), None, st.step, batch, st.cursor)  # stateless drivers only
            rewards_PG = out.rewards_PGK.sum(-1)  # the weighted sum of the components
            kept = keep_samples(rewards_PG, out.valid_PG, completion_keys(out), threshold=f.keep_threshold,
                                max_per_prompt=f.max_per_prompt, dedup=f.dedup)
            new = kept_rows(out, rewards_PG, kept)
            for part, more in zip(vars(rows).values(), vars(new).values(), strict=True):
                part.extend(more)
            verified, duplicates, capped = verified + kept.verified, duplicates + kept.duplicates, capped + kept.capped
            with_kept += sum(bool(g) for g in kept.index_P)
            rewards.append(rewards_PG[out.valid_PG])
            for k, v in out.metrics.items():  # the sampler's accuracy and reward/<name>/..., averaged over prompts
                weighted[k] = weighted.get(k, 0.0) + v * n / f.prompts_per_round
            st.cursor += out.consumed
            done, batch = done + n, batch + 1
        samples = f.prompts_per_round * f.samples_per_prompt
        valid = torch.cat(rewards)
        return rows, weighted | {
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "rft/verified": float(verified), "rft/verified_frac": verified / samples,
            "rft/kept": float(len(rows.targets)), "rft/kept_frac": len(rows.targets) / samples,
            "rft/prompts_with_kept": float(with_kept), "rft/duplicates": float(duplicates),
            "rft/capped": float(capped),
        }

    def batch_ctx(self, n: int) -> ProduceContext:
        """The produce context of a generation batch of ``n`` prompts (the driver draws
        ``rollout.prompts_per_step`` of them).
        """
        if n == self.cfg.rollout.prompts_per_step:
            return self.produce_ctx
        rollout = self.cfg.rollout.model_copy(update={"prompts_per_step": n})
        return replace(self.produce_ctx, cfg=self.cfg.model_copy(update={"rollout": rollout}))

    def fine_tune(self, rows: KeptRows) -> dict[str, float]:
        """Step 3: ``rft.sft_steps`` steps of the SFT loss on the kept rows, from the starting model or the
        current policy, with a fresh optimizer; nothing when nothing was kept.
        """
        f, st, model = self.cfg.rft, self.state, self.opened.model
        if not rows.targets:
            self.console.print(f"[yellow]warning[/]: round {st.step + 1} kept no sample (none scored reward >= "
                               f"rft.keep_threshold = {f.keep_threshold}): no fine-tuning, the policy is unchanged",
                               highlight=False)
            return {"rft/sft_steps": 0.0}
        if self.base is not None:
            model.load_state_dict(self.base)
        self.optimizer, self.scheduler = self.new_optimizer()
        nll_start = self.kept_nll(rows)
        pad_id = self.opened.tokenizer.pad_token_id
        losses, grad_norm = [], 0.0
        for i in range(f.sft_steps):
            gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "rft-batch", st.step, i))
            idx = torch.randint(len(rows.targets), (f.batch_size,), generator=gen).tolist()
            loss, grad_norm = sft_update(model, self.optimizer, self.scheduler, [rows.prompts[j] for j in idx],
                                         [rows.targets[j] for j in idx], [rows.loss_masks[j] for j in idx], pad_id,
                                         autocast_dtype(self.cfg.model.autocast))
            losses.append(loss)
        st.sft_steps += f.sft_steps
        return {"sft/loss": sum(losses) / len(losses), "sft/loss_first": losses[0], "sft/loss_last": losses[-1],
                "rft/kept_nll_start": nll_start, "rft/kept_nll_end": self.kept_nll(rows),
                "rft/sft_steps": float(f.sft_steps), "optim/grad_norm": grad_norm,
                "optim/lr": self.scheduler.get_last_lr()[0]}

    @torch.no_grad()
    def kept_nll(self, rows: KeptRows) -> float:
        """Token-mean negative log-likelihood of every kept completion under the policy as it is now."""
        model, chunk, pad_id = self.opened.model, self.cfg.rft.batch_size, self.opened.tokenizer.pad_token_id
        was_training = model.training
        model.eval()
        total = tokens = 0.0
        for i in range(0, len(rows.targets), chunk):
            masks = rows.loss_masks[i : i + chunk]
            n = sum(map(sum, masks))
            total += n * float(demonstration_loss(model, rows.prompts[i : i + chunk], rows.targets[i : i + chunk],
                                                  masks, pad_id))
            tokens += n
        model.train(was_training)
        return total / tokens

    def log_kept(self, rows: KeptRows) -> None:
        """Append this round's kept samples to ``RUN/rft_kept.jsonl`` (``step`` = the round)."""
        with (self.opened.run / KEPT_LOG).open("a") as out:
            for (prompt, completion), reward in zip(rows.texts, rows.rewards, strict=True):
                out.write(json.dumps({"step": self.state.step, "prompt": prompt, "completion": completion,
                                      "reward": reward}) + "\n")

    def held_out(self) -> dict[str, float]:
        """Held-out evaluation of the policy as it is now, with the run's ``[eval]`` settings."""
        self.engine.sync(engine_weights(self.opened.model, self.engine), self.state.sft_steps)
        return evaluate_config(self.engine, self.opened.tokenizer, self.opened.task, self.eval_examples, self.cfg,
                               self.pool).metrics

    def validate(self) -> dict[str, float]:
        """:meth:`held_out` as the harness logs it (``eval/pass@1``, ...); keeps the best pass@1."""
        ev = self.held_out()
        self.state.best_eval = max(self.state.best_eval, ev["pass@1"])
        return {f"eval/{k}": v for k, v in ev.items()}

    def checkpoint(self) -> Path:
        """Save the run as it is now (after a round: its fine-tuned policy); the checkpoint directory."""
        return self.opened.checkpoint(self.state, self.optimizer, self.scheduler, self.cfg.checkpoint.keep)
