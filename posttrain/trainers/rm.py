"""Reward-model training on (prompt, chosen, rejected) pairs: ``posttrain rm``.

The model is the policy-style base at ``model.path`` (or the tiny model) turned into a one-output
``AutoModelForSequenceClassification`` (``posttrain/trainers/rm_model.py``): its transformer, a fresh linear
``score`` head read at the last token of prompt + completion. Per step, for a batch of B pairs drawn
from the pool (without replacement within a step, with replacement across steps): one forward over the
2B responses, the last-token features f and the quality reward r_Q = w_Q . f, then the objective of
``rm.debias``, looked up by name (no branch on the method here):

- ``"none"``: Bradley-Terry, L = mean_B -log sigmoid(r_Q(y_w) - r_Q(y_l) - m) (InstructGPT,
  arXiv:2203.02155, eq. 1; the margin m = ``rm.margin`` as in Llama 2, arXiv:2307.09288);
- ``"odin"``: ODIN (Chen et al. 2024, arXiv:2402.07319): a second linear head r_L = w_L . f on the same
  features; BT ranks r_Q + r_L, plus lambda_L (|rho(r_Q, len)| - rho(r_L, len)) over the batch's 2B
  responses and lambda_O |cos(w_Q, w_L)| (:func:`~posttrain.algorithms.reward_modeling.odin_loss`). The
  length head is trained and checkpointed (in the loop state) but never saved into the model: the saved
  model's single logit is r_Q.
- ``"fimi"``: FiMi-RM's stage 3, provisional (Zhao et al. 2025, arXiv:2505.12843, as rendered in issue 37): a
  fitting model r_hat = f(length) (6,465 parameters) and the reward model trained in turn, every
  ``rm.fimi_every`` steps after ``rm.fimi_warmup_steps`` of plain BT: f on -|rho(sg(r_Q), r_hat)|, the reward
  model on BT + |rho(r_Q, sg(r_hat))| (:class:`~posttrain.trainers.rm_heads.FiMi`); f stays in the loop state.

AdamW with warm-up and gradient clipping. Pairs come from ``posttrain/trainers/dpo_pairs.py`` as DPO's do:
``rm.pairs = "task"`` samples ``rm.group_size`` completions of the base model for ``rm.prompts`` train
prompts once at the start and verifies them (chosen: a correct sample or the demonstration; rejected: an
incorrect sample), and held-out pairs the same way from ``rm.eval_prompts`` test prompts; both pools are
kept in checkpoints. ``rm.pairs = "file"`` reads ``rm.path`` and holds out ``rm.eval_fraction`` of it
(seeded), or reads the held-out pairs from ``rm.eval_path``. Prompts are encoded without
``task.system_prompt``, because the ``reward_model`` reward scores (prompt, completion) without one.

Logged per step: ``rm/loss`` (the whole objective), ``rm/bt_loss``, ``rm/accuracy`` (fraction of the
batch's pairs with r_Q(y_w) > r_Q(y_l)), ``rm/reward_margin`` (mean r_Q(y_w) - r_Q(y_l)),
``rm/length_corr`` (Pearson rho(r_Q, completion tokens) over the batch's 2B responses), with ODIN also
``rm/odin_length_loss``, ``rm/odin_ortho``, ``rm/odin_length_head_corr``, with FiMi ``rm/fimi_corr``,
``rm/fimi_fit_loss`` and ``rm/fimi_phase``; every ``rm.eval_every`` steps and at the end ``rm/val_accuracy``,
``rm/val_margin`` and ``rm/val_length_corr`` on the held-out pairs.
At the end the model and tokenizer are saved to ``RUN/reward_model`` (``save_pretrained``), which
``[[reward]] name = "reward_model" params = {path = "RUN/reward_model"}`` loads unchanged.

Differences from TRL's ``RewardTrainer``: no centering term (``center_rewards_coefficient``), a constant
margin instead of a per-pair column, pairs may be built from a verifiable task, and ODIN and FiMi-RM are built
in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor, nn
from transformers import PreTrainedModel

from posttrain.algorithms.reward_modeling import pearson
from posttrain.config import Config, ConfigError
from posttrain.models.host_memory import apply_setting as apply_host_memory
from posttrain.models.load import _DTYPES, check_model_path, load_model, load_tokenizer, resolve_device
from posttrain.models.precision import autocast_dtype, compute
from posttrain.rollout import engine_for
from posttrain.run.checkpoint import Resume
from posttrain.run.harness import Finish, Loop, StopRun, finish_run, run_loop
from posttrain.run.optim import make_optimizer, make_scheduler
from posttrain.run.setup import (
    OpenedRun,
    build_task,
    prepare_run_dir,
    resolve_model_path,
    restore_trainer_state,
    resume_checkpoint,
    run_dir_model,
    seed_everything,
)
from posttrain.seeds import derive_seed
from posttrain.trainers.dpo_pairs import TokenPair, read_pairs, task_pairs
from posttrain.trainers.rm_heads import DEBIAS
from posttrain.trainers.rm_model import as_reward_model, last_token_features, load_reward_model, pair_rows, score_rows


@dataclass
class RMState:
    """Loop state saved in checkpoints (task pairs are kept, so a resumed run trains on the same ones)."""

    step: int = 0
    pairs_used: int = 0
    best_val: float = 0.0  # best held-out pair accuracy so far
    pool: list = field(default_factory=list)  # task pairs as [prompt, chosen, rejected] id lists
    val_pool: list = field(default_factory=list)  # held-out task pairs, likewise
    # odin: the length head's weight [1, H]; fimi: the fitting model's parameters [6465] (not in the saved model)
    length_head: Tensor | None = None


def open_rm_run(cfg: Config, resume: Resume) -> tuple[OpenedRun, PreTrainedModel | None]:
    """Build the task, prepare the run directory, seed, and load the reward model to start or resume from.

    A fresh run loads the causal LM at ``model.path`` (or builds the tiny one) and converts it
    (:func:`~posttrain.trainers.rm_model.as_reward_model`); the causal LM is returned too, to sample task pairs
    with (``None`` on resume: a checkpoint holds the reward model and the pairs). Checks the device, the
    model path and that LoRA is off before the run directory is made.
    """
    if cfg.model.lora.enabled:
        raise ConfigError(f"model.lora.rank = {cfg.model.lora.rank}: posttrain rm trains the whole reward model; "
                          "LoRA is not supported here (set model.lora.rank=0)")
    device = resolve_device(cfg.model)
    apply_host_memory(cfg.model.host_memory, device)
    if cfg.model.path != "tiny":
        check_model_path(run_dir_model(cfg.model.path))
    task = build_task(cfg)
    run = prepare_run_dir(cfg, resume)
    ckpt = resume_checkpoint(run, resume)  # verified before it loads; a damaged one falls back
    seed_everything(cfg.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
    base_path = resolve_model_path(cfg, task, run)
    tokenizer = load_tokenizer(str(ckpt) if ckpt else base_path)
    policy = None
    if ckpt is not None:
        model = load_reward_model(str(ckpt), _DTYPES[cfg.model.dtype], device)
    else:
        policy = load_model(base_path, cfg.model.dtype, device)
        model = as_reward_model(policy, int(tokenizer.pad_token_id))
    return OpenedRun(task, run, run / "checkpoints", ckpt, tokenizer, model, base_path=base_path), policy


def rm_train(cfg: Config, *, resume: Resume = False, console: Console | None = None) -> dict:
    """Train a reward model as ``cfg.rm`` says; returns the summary (also ``summary.json``)."""
    console = console or Console()
    t_start = time.perf_counter()
    opened, policy = open_rm_run(cfg, resume)
    r = RMRun(cfg, opened, policy, console)
    del policy  # the pairs are built: only the reward model stays
    d = cfg.rm
    loop = Loop("rm", d.steps, lambda: r.state.step, r.step, r.checkpoint,
                [("rm/loss", "loss"), ("rm/accuracy", "acc"), ("rm/val_accuracy", "val_acc")],
                evaluate=r.validate, eval_every=d.eval_every, eval_last=True)
    ended = run_loop(cfg, opened, loop, console)
    exported = opened.run / "reward_model"
    opened.model.save_pretrained(exported, safe_serialization=True)
    opened.tokenizer.save_pretrained(exported)
    st = r.state
    val = ended.metrics.get("rm/val_accuracy", float("nan"))
    finish = Finish(f"posttrain rm: {opened.run}", ["rm/loss", "rm/accuracy", "rm/val_accuracy", "rm/length_corr"],
                    summary={"pairs_used": st.pairs_used, "val_accuracy": val, "best_val": st.best_val,
                             "reward_model": str(exported)},
                    rows=[("pairs used", str(st.pairs_used)), ("held-out pair accuracy", f"{val:.3f}"),
                          ("reward model", str(exported))])
    return finish_run(cfg, opened, loop, ended, finish, time.perf_counter() - t_start, console)


class RMRun:
    """One reward-model run: its model, objective, optimizer, pairs and loop state; the run harness
    (:func:`~posttrain.run.harness.run_loop`) calls :meth:`step`, :meth:`validate` and :meth:`checkpoint`.
    """

    def __init__(self, cfg: Config, opened: OpenedRun, policy: PreTrainedModel | None, console: Console) -> None:
        d = self.d = cfg.rm
        self.cfg, self.opened = cfg, opened
        model, tokenizer = opened.model, opened.tokenizer
        self.eos, self.context = int(tokenizer.eos_token_id), int(model.config.max_position_embeddings)
        self.debias = DEBIAS[d.debias](model, d, derive_seed(cfg.seed, "rm-length-head"))
        self.trainable = nn.ModuleList([model, *self.debias.modules])
        self.optimizer = make_optimizer(self.trainable, d.lr, (0.9, 0.99), d.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, d.warmup_steps, max(d.steps, 1), "constant")
        self.state = RMState()
        self.pair_stats: dict[str, float] = {}
        if opened.ckpt:
            self.state = RMState(**restore_trainer_state(opened.ckpt, self.optimizer, self.scheduler))
            self.debias.load(self.state.length_head)
            console.print(f"[bold]resumed[/] from {opened.ckpt} at step {self.state.step}")
        if d.pairs == "file":
            self.train_pairs, self.val_pairs = self.file_pairs(console)
        else:
            if policy is not None:
                self.sample_task_pairs(policy)
            self.train_pairs = [TokenPair(*p) for p in self.state.pool]
            self.val_pairs = [TokenPair(*p) for p in self.state.val_pool]

    def fits(self, p: TokenPair) -> bool:
        """Whether the prompt plus the longer completion (and an EOS it may get) fits the model's context."""
        return len(p.prompt) + max(len(p.chosen), len(p.rejected)) + 1 <= self.context

    def sample_task_pairs(self, policy: PreTrainedModel) -> None:
        """Task pairs sampled from the base model (``rm.prompts`` train prompts, ``rm.eval_prompts`` test
        prompts) into the loop state; the train pool's statistics are logged with the first step.
        """
        d, cfg, task, tok = self.d, self.cfg, self.opened.task, self.opened.tokenizer
        engine = engine_for(cfg, policy, tok)
        for split, n, key in (("train", d.prompts, "pool"), ("test", d.eval_prompts, "val_pool")):
            seed = derive_seed(cfg.seed, "rm-pairs", split)
            built, stats = task_pairs(engine, tok, task, task.examples(split, n, seed=seed), group_size=d.group_size,
                                      max_new_tokens=cfg.rollout.max_new_tokens, temperature=d.temperature,
                                      system_prompt=None, seed=seed)
            setattr(self.state, key, [[p.prompt, p.chosen, p.rejected] for p in built if self.fits(p)])
            if split == "train":
                self.pair_stats = {k.replace("dpo/", "rm/", 1): v for k, v in stats.items()}

    def file_pairs(self, console: Console) -> tuple[list[TokenPair], list[TokenPair]]:
        """Train and held-out pairs from ``rm.path`` (and ``rm.eval_path``); the split is seeded."""
        d, tok = self.d, self.opened.tokenizer

        def read(path: str) -> list[TokenPair]:
            got = read_pairs(path, tok, fields=d.fields, format=d.format, system_prompt=None)
            kept = [p for p in got if self.fits(p)]
            console.print(f"rm: {len(kept)} pairs from {path} ({len(got) - len(kept)} longer than the context "
                          f"of {self.context} tokens dropped)")
            return kept

        pairs = read(str(d.path))
        if d.eval_path is not None:
            return pairs, read(d.eval_path)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "rm-split"))
        order = torch.randperm(len(pairs), generator=gen).tolist()
        n_val = max(1, round(d.eval_fraction * len(pairs))) if len(pairs) > 1 else 0
        return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]

    def step(self) -> dict[str, float]:
        """One optimizer step on a batch of pairs; its metrics."""
        d, state, model, pool = self.d, self.state, self.opened.model, self.train_pairs
        if not pool:
            raise StopRun("no pairs (every sample of every prompt verified)" if d.pairs == "task" else "no pairs")
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "rm-batch", state.step))
        batch = [pool[i] for i in torch.randperm(len(pool), generator=gen)[: d.batch_size].tolist()]
        rows, lengths_N = pair_rows(batch, self.eos)
        model.train()
        with compute(next(model.parameters()).device, autocast_dtype(self.cfg.model.autocast)):  # model.autocast
            feats_NH = last_token_features(model, rows)
            quality_N = model.score(feats_NH)[:, 0].float()
        lengths_N = lengths_N.to(quality_N.device)
        loss, parts = self.debias.objective(quality_N, feats_NH, lengths_N, step=state.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable.parameters(), d.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        state.step += 1
        state.pairs_used += len(batch)
        q_N, b = quality_N.detach(), len(batch)
        metrics, self.pair_stats = self.pair_stats, {}  # the pairs' statistics go with the first step only
        return metrics | {
            "rm/loss": float(loss.detach()),
            "rm/accuracy": float((q_N[:b] > q_N[b:]).float().mean()),
            "rm/reward_margin": float((q_N[:b] - q_N[b:]).mean()),
            "rm/length_corr": float(pearson(q_N, lengths_N)),
            "rm/pairs": float(len(pool)),
            "rm/pairs_used": float(state.pairs_used),
            "optim/grad_norm": float(grad_norm),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "time/step_s": time.perf_counter() - t0,
            **{k: float(v) for k, v in parts.items()},
        }

    def validate(self) -> dict[str, float]:
        """Held-out pair accuracy (fraction with r_Q(y_w) > r_Q(y_l)), mean margin and rho(r_Q, length)."""
        if not self.val_pairs:
            return {}
        rows, lengths_N = pair_rows(self.val_pairs, self.eos)
        scores_N = score_rows(self.opened.model, rows, 2 * self.d.batch_size)
        b = len(self.val_pairs)
        acc = float((scores_N[:b] > scores_N[b:]).float().mean())
        self.state.best_val = max(self.state.best_val, acc)
        return {"rm/val_accuracy": acc, "rm/val_margin": float((scores_N[:b] - scores_N[b:]).mean()),
                "rm/val_length_corr": float(pearson(scores_N, lengths_N))}

    def checkpoint(self) -> Path:
        """Save the run as it is now (the reward model; ODIN's length head in the loop state)."""
        self.state.length_head = self.debias.state()
        return self.opened.checkpoint(self.state, self.optimizer, self.scheduler, self.cfg.checkpoint.keep)
