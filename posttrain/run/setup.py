"""Run set-up shared by ``sft``, ``train`` and ``demo``: run directory, model path, seeding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.markup import escape
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.config import Config, ConfigError, ProduceSettings, dump_toml
from posttrain.data import DatasetTask, load_task
from posttrain.models.chat import check_chat_examples, encode_example
from posttrain.models.host_memory import apply_setting as apply_host_memory
from posttrain.models.load import check_model_path, load_model, load_tokenizer, resolve_device
from posttrain.models.lora import (
    AdapterDisabled,
    AdapterSaver,
    apply_lora,
    check_peft,
    export_merged,
    is_adapter_dir,
    load_adapter,
)
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.produce.drivers import SPECS
from posttrain.run.checkpoint import (
    Resume,
    choose_resume_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    remove_stale_writes,
    save_checkpoint,
    set_rng_state,
)
from posttrain.seeds import seed_everything
from posttrain.tasks import make_task
from posttrain.tasks.base import Task

if TYPE_CHECKING:
    from peft import PeftModel


def warn_stderr(message: str) -> None:
    """Print a warning on stderr (what :func:`open_run` says about checkpoints it would not trust)."""
    Console(stderr=True).print(f"[bold yellow]warning:[/] {escape(message)}", soft_wrap=True, highlight=False)


def prepare_run_dir(cfg: Config, resume: Resume, warn: Callable[[str], None] = warn_stderr) -> Path:
    """Create the run directory and write the resolved config.

    Refuses to start a fresh run over an existing run's checkpoints (say ``--resume`` or choose
    another ``--out``), so nothing is overwritten by accident. What a killed first write left
    (``step_N.tmp-<pid>``, no complete checkpoint beside it) is no run to continue: a fresh start
    removes it, named in ``warn``, as a resume would.
    """
    run = Path(cfg.out)
    ckpts = run / "checkpoints"
    if not resume and ckpts.is_dir() and list_checkpoints(ckpts):
        raise ConfigError(
            f"run directory {str(run)!r} already holds checkpoints; pass --resume to continue it "
            "or --out to start a new run elsewhere"
        )
    if resume and not (run / "config.toml").exists():
        raise ConfigError(f"--resume: {str(run)!r} is not a run directory (no config.toml)")
    if not resume:
        remove_stale_writes(ckpts, warn)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(dump_toml(cfg))
    return run


def run_dir_model(path: str) -> str:
    """``path`` itself, or, when it is a run directory, its latest complete checkpoint."""
    root = Path(path) / "checkpoints"
    if root.is_dir():
        ckpt = latest_checkpoint(root)
        if ckpt is None:
            raise ConfigError(f"run directory {path!r} has no complete checkpoint to start from")
        return str(ckpt)
    return path


def resolve_model_path(cfg: Config, task: Task, run: Path) -> str:
    """The model to load: ``cfg.model.path`` (a run directory means its latest checkpoint), or a
    tiny model built once into ``RUN/base_model``.
    """
    if cfg.model.path != "tiny":
        return run_dir_model(cfg.model.path)
    base = run / "base_model"
    if not (base / "config.json").exists():
        t = cfg.model.tiny
        spec = TinySpec(
            alphabet=task.alphabet,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            max_positions=t.max_positions,
            seed=cfg.seed,
        )
        build_tiny(base, spec)
    return str(base)


def build_task(cfg: Config) -> Task:
    """The task the config names: a built-in one, the ``[task.dataset]`` source, or the ``[task.env]``
    environment.
    """
    if cfg.task.dataset is not None:
        return load_task(cfg.task.dataset)
    if cfg.task.env is not None:
        from posttrain.envs.task import EnvTask

        e = cfg.task.env
        return EnvTask.build(e.name, dict(e.params), e.max_turns, e.max_tokens, e.step_timeout_s,
                             cfg.task.system_prompt)
    return make_task(cfg.task.name, **cfg.task.params)


def drop_long_prompts(cfg: Config, task: Task, tokenizer: object, max_positions: int) -> str | None:
    """For a dataset task, drop prompts that leave no room for ``rollout.max_new_tokens``.

    Chat rows (``messages``, ``tools``, ``chat_template_kwargs``) are first rendered once
    (:func:`~posttrain.models.chat.check_chat_examples`): a template that cannot render them fails
    here, at set-up, not mid-run. Returns a line for the log (records read, prompts dropped per
    split), or ``None`` for a built-in task (its prompts have a known size; :func:`check_context`
    checks them).
    """
    if not isinstance(task, DatasetTask):
        return None
    check_chat_examples(tokenizer, task.pools, cfg.task.system_prompt)
    budget = max_positions - cfg.rollout.max_new_tokens
    task.drop_long_prompts(lambda ex: len(encode_example(tokenizer, ex, cfg.task.system_prompt)), budget)
    sizes = ", ".join(f"{split} {len(pool)}" for split, pool in task.pools.items())
    counts = ", ".join(f"{k} {v}" for k, v in task.counts.items())
    return f"data {task.name!r}: {sizes} prompts ({counts}; prompt budget {budget} tokens)"


def longest_prompt(cfg: Config, task: Task, tokenizer: object) -> int:
    """Tokens of the longest of 256 training prompts through the chat template."""
    sample = task.examples("train", 256, seed=0)
    return max(len(encode_example(tokenizer, ex, cfg.task.system_prompt)) for ex in sample)


def check_context(cfg: Config, task: Task, tokenizer: object, max_positions: int) -> int:
    """Fail before training when task prompts plus ``max_new_tokens`` do not fit the context; returns
    the longest prompt's tokens (what ``posttrain.planning.plan`` sizes a run with).
    """
    longest = prompt_tokens = longest_prompt(cfg, task, tokenizer)  # of 256: a built-in task's prompts vary
    if cfg.task.env is not None and longest + cfg.task.env.max_tokens > max_positions:
        raise ConfigError(
            f"prompts of environment {cfg.task.env.name!r} take up to {longest} tokens; with task.env.max_tokens="
            f"{cfg.task.env.max_tokens} (an episode's turns and replies) that exceeds the model's context of "
            f"{max_positions} tokens: lower task.env.max_tokens"
        )
    if longest + cfg.rollout.max_new_tokens > max_positions:
        raise ConfigError(
            f"prompts of task {cfg.task.name!r} take up to {longest} tokens; with rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} that exceeds the model's context of {max_positions} tokens"
        )
    fits = SPECS[cfg.rollout.driver].fits  # a driver whose prompts are longer checks them itself (hint, partial)
    if fits is not None:
        fits(ProduceSettings.of(cfg), task, tokenizer, longest, max_positions)
    return prompt_tokens


@dataclass
class OpenedRun:
    """What ``sft``, ``train`` and ``dpo`` share at start-up."""

    task: Task
    run: Path
    ckpt_root: Path
    ckpt: Path | None  # the checkpoint to resume from, if any
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel  # the policy (with LoRA: the base model, the adapters injected in its modules)
    data_note: str | None = None  # what loading a dataset did (records, dropped prompts), for the log
    lora: PeftModel | None = None  # with model.lora: the peft wrapper of `model` (the adapter's owner)
    base_path: str = ""  # the starting model (what the reference is)
    prompt_tokens: int = 0  # the longest of the task's training prompts, in tokens (check_context)

    @property
    def saved(self) -> PreTrainedModel | AdapterSaver:
        """What a checkpoint writes: the adapter with LoRA, else the whole policy."""
        return AdapterSaver(self.lora) if self.lora is not None else self.model

    def reference(self, cfg: Config) -> torch.nn.Module:
        """The frozen starting model (reference, divergence diagnostics): with LoRA the policy module
        with its adapter switched off (no copy); else a second copy loaded from the starting path.
        """
        if self.lora is not None:
            return AdapterDisabled(self.lora)
        return load_model(self.base_path, cfg.model.dtype, self.model.device).eval().requires_grad_(False)

    def checkpoint(self, loop_state: object, optimizer: torch.optim.Optimizer, scheduler: object, keep: int,
                   extras: dict | None = None) -> Path:
        """:func:`save_trainer_checkpoint` of this run (what :attr:`saved` holds, the tokenizer) into
        ``RUN/checkpoints``; returns the checkpoint directory.
        """
        return save_trainer_checkpoint(self.ckpt_root, loop_state, self.saved, self.tokenizer, optimizer, scheduler,
                                       keep, extras)

    def export(self, cfg: Config) -> Path | None:
        """With ``model.lora.merge_on_export``: the merged plain model in ``RUN/merged`` (in place:
        call it when training is over). Returns its path, or ``None``.
        """
        if self.lora is None or not cfg.model.lora.merge_on_export:
            return None
        return export_merged(self.lora, self.tokenizer, self.run / "merged")


def resume_checkpoint(run: Path, resume: Resume, warn: Callable[[str], None] = warn_stderr) -> Path | None:
    """The verified checkpoint of ``RUN/checkpoints`` to resume from (``resume``: ``True`` for the
    newest intact one, :class:`~posttrain.run.checkpoint.ResumeFrom` for one step), or None: see
    :func:`~posttrain.run.checkpoint.choose_resume_checkpoint`.
    """
    return choose_resume_checkpoint(run / "checkpoints", resume, warn)


def open_run(cfg: Config, resume: Resume, warn: Callable[[str], None] = warn_stderr) -> OpenedRun:
    """Build the task, prepare the run directory, seed, and load the model to start or resume from.

    Checks ``model.device``, ``model.path`` (alias, ``.gguf`` reader, existence) and, for
    ``model.lora``, that peft is installed before the run directory is made or any model loads,
    and that the task's prompts fit the model's context before any training starts. With LoRA the
    base is loaded from the starting path, the adapter injected and, when resuming, the adapter
    read from the checkpoint (which holds no base weights). The checkpoint to resume from is
    verified against its manifest before any of it loads; a damaged one is named (``warn``,
    ``RUN/resume.log``) and the newest intact one is used instead.
    """
    device = resolve_device(cfg.model)
    apply_host_memory(cfg.model.host_memory, device)
    if cfg.model.path != "tiny":
        check_model_path(run_dir_model(cfg.model.path))
    lora_on = cfg.model.lora.enabled
    if lora_on:
        check_peft()
    task = build_task(cfg)
    run = prepare_run_dir(cfg, resume, warn)
    ckpt_root = run / "checkpoints"
    ckpt = resume_checkpoint(run, resume, warn)
    if ckpt is not None and is_adapter_dir(ckpt) and not lora_on:
        raise ConfigError(f"--resume: checkpoint {ckpt} holds a LoRA adapter; resume with the run's own [model.lora] "
                          "settings (model.lora.rank > 0)")
    seed_everything(cfg.seed)
    torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
    base_path = resolve_model_path(cfg, task, run)
    model_path = str(ckpt) if ckpt and not lora_on else base_path
    tokenizer = load_tokenizer(model_path)
    model = load_model(model_path, cfg.model.dtype, device)
    # the adapter's config records its base (absolute when a local path) for load_merged
    recorded = str(Path(base_path).resolve()) if Path(base_path).exists() else base_path
    lora = apply_lora(model, cfg.model.lora, recorded) if lora_on else None
    if lora is not None and ckpt is not None:
        load_adapter(lora, ckpt)
    note = drop_long_prompts(cfg, task, tokenizer, model.config.max_position_embeddings)
    prompt_tokens = check_context(cfg, task, tokenizer, model.config.max_position_embeddings)
    return OpenedRun(task, run, ckpt_root, ckpt, tokenizer, model, note, lora, base_path, prompt_tokens)


def save_trainer_checkpoint(
    ckpt_root: Path,
    loop_state: object,
    model: PreTrainedModel | AdapterSaver,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    keep: int,
    extras: dict[str, tuple[PreTrainedModel, torch.optim.Optimizer]] | None = None,
) -> Path:
    """Checkpoint model (a LoRA run's :class:`AdapterSaver`: the adapter only), tokenizer, optimizer,
    scheduler and the trainer's loop state (a dataclass with a ``step``), atomically; what
    :func:`restore_trainer_state` reads back. ``extras`` are models trained beside the policy
    (``{"critic": (model, optimizer)}``): each model goes to its own subdirectory, each optimizer
    into the trainer state.
    """
    extras = extras or {}
    trainer_state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "loop": asdict(loop_state),
        "extra_optimizers": {name: opt.state_dict() for name, (_, opt) in extras.items()},
    }
    models = {name: m for name, (m, _) in extras.items()}
    return save_checkpoint(ckpt_root, loop_state.step, model, tokenizer, trainer_state, keep, models)


def restore_trainer_state(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    extras: dict[str, tuple[PreTrainedModel, torch.optim.Optimizer]] | None = None,
) -> dict:
    """Load optimizer, scheduler and RNG states from ``ckpt`` (and the optimizers of ``extras``,
    whose models the caller loaded from ``ckpt/<name>``); return the saved loop state dict.
    """
    saved = load_trainer_state(ckpt)
    optimizer.load_state_dict(saved["optimizer"])
    for name, (_, opt) in (extras or {}).items():
        if name not in saved.get("extra_optimizers", {}):
            raise ConfigError(f"checkpoint {ckpt} holds no {name} optimizer state: the run did not train a {name}")
        opt.load_state_dict(saved["extra_optimizers"][name])
    scheduler.load_state_dict(saved["scheduler"])
    set_rng_state(saved["rng"])
    return saved["loop"]
