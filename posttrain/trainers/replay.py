"""``posttrain replay RUN --step N``: re-run one step's prepare and update exactly, from the checkpoint
before it and the batch the run recorded (``log.record_batches``; ``posttrain/run/record.py``).

Nothing of the run directory is written: the replay opens a scratch run directory whose config is
the run's ``config.toml``, whose ``base_model`` (a tiny run's) and checkpoint of step ``N - 1`` are
links into the run, and sets it up with the loop's own set-up (``train/rl.py``'s ``_setup``, resuming
from that checkpoint: weights, optimizer, scheduler, loop state). Step 1 needs no checkpoint: the
fresh set-up is the run's start. The loop's rollout pipeline is swapped for the recorded batch
(:class:`~posttrain.run.record.RecordedBatch`, which also puts the RNG back as it was) and the
loop's own step function runs once, so the metrics have the keys of ``metrics.jsonl`` that the step
itself computes (not ``diag/*`` nor ``eval/*``, measured around the step) and, on the same machine,
the same loss and gradient norm.

``--rows 0,3 --tokens`` also prints, for those rows of the batch, one line per trained token: its
advantage, the behaviour (sampler's) log-prob, the log-prob and entropy of the step's starting
policy (two no-gradient passes before the step, which draw no random numbers), the ratio of the two
log-probs (what the first minibatch of the update sees when ``algorithm.old_logprobs = "behaviour"``;
1 with ``"recompute"``), whether it is outside the loss's clip range (``eps_low``/``eps_high``, when
the loss has them), and the per-token loss of ``algorithm.loss`` at that ratio (before aggregation,
loss weights and regularizers).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

from posttrain.algorithms import losses
from posttrain.config import ConfigError, load_config
from posttrain.learn.forwards import FORWARDS
from posttrain.run.checkpoint import ResumeFrom, checkpoint_step, list_checkpoints
from posttrain.run.record import BATCHES, RecordedBatch, load_record, recorded_steps, rows_table
from posttrain.train.rl import LoopState, RunParts, _setup, _step


def replayable(run: Path) -> list[int]:
    """Steps that can be replayed: recorded, and step 1 or with a checkpoint of the step before."""
    ckpts = {checkpoint_step(p) for p in list_checkpoints(run / "checkpoints")}
    return [s for s in recorded_steps(run) if s == 1 or s - 1 in ckpts]


def _check(run: Path, step: int) -> Path | None:
    """The checkpoint of step ``step - 1`` (None for step 1), or a ConfigError naming what the run holds."""
    if not (run / "config.toml").is_file():
        raise ConfigError(f"replay: {run} is not a run directory (no config.toml)")
    cfg = load_config(run / "config.toml")
    if not recorded_steps(run):
        why = "was not trained with log.record_batches = true" if not cfg.log.record_batches else "recorded none yet"
        raise ConfigError(f"replay: {run} holds no recorded batches ({run / BATCHES}): the run {why}")
    load_record(run, step)  # a clear error when this step has none
    if step == 1:
        return None
    found = {checkpoint_step(p): p for p in list_checkpoints(run / "checkpoints")}
    if step - 1 not in found:
        raise ConfigError(
            f"replay: step {step} starts from the checkpoint of step {step - 1}, which {run / 'checkpoints'} does not "
            f"hold (checkpoints of steps: {sorted(found) or 'none'}; checkpoint.every = {cfg.checkpoint.every}, "
            f"keep = {cfg.checkpoint.keep}). Replayable steps: {replayable(run) or 'none'}"
        )
    return found[step - 1]


def _scratch(run: Path, ckpt: Path | None, tmp: Path) -> Path:
    """A run directory in ``tmp`` that sees the run's base model and checkpoint through links."""
    (tmp / "config.toml").write_text((run / "config.toml").read_text())  # resuming needs one there
    if (run / "base_model").is_dir():
        os.symlink((run / "base_model").resolve(), tmp / "base_model")
    if ckpt is not None:
        (tmp / "checkpoints").mkdir()
        os.symlink(ckpt.resolve(), tmp / "checkpoints" / ckpt.name)
    return tmp


def replay(run: str | Path, step: int, rows: list[int] | None = None, tokens: bool = False,
           console: Console | None = None) -> dict:
    """Re-run step ``step`` of ``run`` (see the module docstring); returns its metrics with ``step``
    (``None`` where ``metrics.jsonl`` writes null: a non-finite value) and, with ``tokens``, the per-token
    rows under ``"tokens"``.
    """
    run, console = Path(run), console or Console()
    ckpt = _check(run, step)
    record = load_record(run, step)
    console.print(f"replay: step {step} of {run} from {ckpt or 'the run start'} and {run / BATCHES}/step_{step:06d}.pt",
                  soft_wrap=True, highlight=False)
    with tempfile.TemporaryDirectory(prefix="posttrain-replay-") as tmp:
        scratch = _scratch(run, ckpt, Path(tmp))
        cfg = load_config(run / "config.toml", [f'out="{scratch}"', "log.record_batches=false"])
        rp, state = _setup(cfg, ResumeFrom(step - 1) if ckpt is not None else False, console, None)
        try:
            rp.pipeline.close()  # built, never started: the recorded batch stands in its place
            rp.pipeline = RecordedBatch(record)
            if state.step != step - 1:
                raise ConfigError(f"replay: the checkpoint {ckpt} holds step {state.step}, not {step - 1}")
            state = LoopState(**{**record["loop"], "pipeline": state.pipeline})  # the loop state the step read
            table = _token_table(rp, record["batch"], rows) if tokens and rows else None
            metrics, _, prep = _step(rp, state, console)
        finally:
            rp.learner.close()
            if hasattr(rp.engine, "close"):
                rp.engine.close()
    out = {"step": step, **{k: v if not isinstance(v, float) or math.isfinite(v) else None
                            for k, v in metrics.items()}}
    if table is not None:
        out["tokens"] = table(prep.adv, prep.mask_NT)
    return out


def _token_table(rp: RunParts, batch: object, rows: list[int]) -> Callable[[Tensor, Tensor], list[dict]]:
    """Per-token columns of the starting policy for ``rows`` (computed now, before the update), as a
    function of the step's advantages and mask (known after prepare).
    """
    rollouts = batch.rollouts
    N = rollouts.token_ids.shape[0]
    bad = [r for r in rows if not 0 <= r < N]
    if bad:
        raise ConfigError(f"replay --rows: rows {bad} are not in the batch (rows 0..{N - 1})")
    learner, G = rp.learner, rollouts.n
    row_prompts = [batch.prompt_ids[i // G] for i in range(N)]
    fn, _ = FORWARDS["reference_logprobs"]  # the chunked log-prob pass, here over the policy
    logp = fn(learner.model, row_prompts=row_prompts, rollouts=rollouts, pad_id=learner.pad_id,
              temperature=learner.temperature, budget=learner.budget).float()
    entropy = learner.token_entropies(row_prompts, rollouts).float()
    behaviour = rollouts.behaviour_logprobs.float()
    a = rp.cfg.algorithm
    old = behaviour if a.old_logprobs == "behaviour" else logp
    ratio = torch.exp(logp - old)
    tok = rp.tokenizer
    texts = [[tok.decode([i]) for i in rollouts.token_ids[r].tolist()] if r in rows else [] for r in range(N)]

    def table(adv: Tensor, mask_NT: Tensor) -> list[dict]:
        adv_NT = adv.reshape(N, *adv.shape[2:]).float()
        adv_NT = adv_NT if adv_NT.dim() == 2 else adv_NT[:, None].expand_as(logp)
        cols = {"adv": adv_NT, "logp_behaviour": behaviour, "logp": logp, "ratio": ratio, "entropy": entropy}
        params = dict(a.loss_params)
        if "eps_low" in losses.REGISTRY.params(a.loss):
            sig = losses.REGISTRY.get(a.loss).__kwdefaults__ or {}
            lo, hi = params.get("eps_low", sig.get("eps_low", 0.2)), params.get("eps_high", sig.get("eps_high", 0.2))
            cols["clipped"] = ((ratio < 1 - lo) | (ratio > 1 + hi)).float()
        try:
            cols["loss"] = losses.compute(a.loss, logp, old, adv_NT, mask_NT, **params)
        except TypeError:  # a loss that reads per-row inputs (RL-PLUS's external rows, ...): left out
            pass
        return rows_table(rows, cols, mask_NT, texts)

    return table


def print_tokens(rows: list[dict], console: Console) -> None:
    """The per-token rows as a plain fixed-width table (readable in a log or a pipe, whatever its width)."""
    if not rows:
        console.print("no trained tokens in the chosen rows")
        return
    keys = list(rows[0])
    width = {k: max(len(k), 9 if isinstance(rows[0][k], float) else max(len(repr(r[k])) for r in rows)) for k in keys}

    def cell(k: str, v: object) -> str:
        text = f"{v:.4f}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)
        return text.rjust(width[k]) if not isinstance(v, str) else text.ljust(width[k])

    print("  ".join(k.rjust(width[k]) for k in keys))
    for r in rows:
        print("  ".join(cell(k, r[k]) for k in keys))


def cli_replay(args: object, console: Console) -> int:
    """``posttrain replay RUN --step N [--rows 0,3 --tokens]``: the step's metrics as the last stdout line."""
    rows = [int(x) for x in args.rows.split(",") if x.strip()] if args.rows else []
    if args.tokens and not rows:
        raise ConfigError("replay --tokens: name the rows to show with --rows (e.g. --rows 0,3)")
    out = replay(args.run, args.step, rows, args.tokens, console)
    token_rows = out.pop("tokens", None)
    if token_rows is not None:
        print_tokens(token_rows, console)
    print(json.dumps(out), flush=True)
    return 0
