"""``posttrain eval``: sample a model on a task's held-out prompts and report pass@k, maj@k, calibration."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.console import Console

from posttrain.config import Config, ConfigError, load_config
from posttrain.evaluation.sampled import evaluate_config
from posttrain.models.host_memory import apply_setting as apply_host_memory
from posttrain.models.load import load_model, load_tokenizer, resolve_device
from posttrain.models.parameterization import REGISTRY as PARAMETERIZATIONS
from posttrain.reporting.progress import summary_table
from posttrain.rewards import pool_for
from posttrain.rollout import engine_for
from posttrain.run.setup import (
    build_task,
    check_context,
    drop_long_prompts,
    resolve_model_path,
    run_dir_model,
)
from posttrain.seeds import derive_seed


def run_eval(cfg: Config, *, model: str | None = None, out: str | None = None, console: Console | None = None) -> dict:
    """Evaluate ``model`` (default ``cfg.model.path``) on ``cfg.eval.prompts`` held-out prompts.

    Samples ``cfg.eval.n`` completions per prompt (``eval.temperature``, ``eval.top_p``), scores
    them with the task's verifier through the reward workers, prints a table and writes a JSON
    file (``out``, default ``<cfg.out>/eval.json``) with the metrics and every problem's samples.
    """
    console = console or Console()
    path = model or cfg.model.path
    if path == "tiny":
        raise ConfigError("posttrain eval needs a trained model: give --model PATH (a model, checkpoint or run dir)")
    path = run_dir_model(path)
    t0 = time.perf_counter()
    task = build_task(cfg)
    tokenizer = load_tokenizer(path)
    device = resolve_device(cfg.model)
    apply_host_memory(cfg.model.host_memory, device)
    policy = load_model(path, cfg.model.dtype, device).eval()
    policy, parameterization = _as_trained(cfg, policy, model or cfg.model.path, path, device, console)
    ctx = policy.config.max_position_embeddings
    note = drop_long_prompts(cfg, task, tokenizer, ctx)
    if note:
        console.print(note)
    check_context(cfg, task, tokenizer, ctx)
    examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    pool = pool_for(cfg.scoring)
    try:
        engine = engine_for(cfg, policy, tokenizer)
        result = evaluate_config(engine, tokenizer, task, examples, cfg, pool)
    finally:
        if pool is not None:
            pool.close()
    report = {
        "model": path,
        "parameterization": parameterization,
        "task": cfg.task.model_dump(mode="json"),
        "prompts": len(examples),
        "n": cfg.eval.n,
        "k": cfg.eval.k,
        "temperature": cfg.eval.temperature,
        "metrics": result.metrics,
        "wall_s": time.perf_counter() - t0,
        "problems": result.problems,
    }
    dest = Path(out) if out else Path(cfg.out) / "eval.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1))
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in result.metrics.items()]
    title = f"posttrain eval: {path} on {task.name} ({len(examples)} prompts x {cfg.eval.n} samples)"
    console.print(summary_table(title, rows))
    console.print(f"written {dest} in {report['wall_s']:.1f} s")
    return report


def _as_trained(cfg: Config, policy: torch.nn.Module, given: str, path: str, device: torch.device,
                console: Console) -> tuple[torch.nn.Module, str]:
    """The policy as its run trained and sampled it, and the parameterization's name: a run directory's
    (or its checkpoint's) ``algorithm.parameterization`` from its ``config.toml``, else the recipe's. A
    run of ``ref_logit_mix`` saved theta alone; the mixture needs the run's starting model beside it.
    """
    run = Path(given)
    if not (run / "config.toml").exists() and Path(path).parent.name == "checkpoints":
        run = Path(path).parent.parent
    run_cfg = load_config(run / "config.toml") if (run / "config.toml").exists() else None
    a = (run_cfg or cfg).algorithm
    if a.parameterization == "plain":
        return policy, "plain"
    if run_cfg is None:
        raise ConfigError(f"algorithm.parameterization = {a.parameterization!r}: give --model the run directory "
                          f"(or one of its checkpoints) so that eval finds the starting model it needs; {given!r} is "
                          "neither (or set algorithm.parameterization = 'plain' to evaluate the weights alone)")
    start = resolve_model_path(run_cfg, build_task(run_cfg), run)
    console.print(f"evaluating the run's policy: algorithm.parameterization = {a.parameterization!r} over {start}")
    build = PARAMETERIZATIONS.get(a.parameterization)
    return build(policy, lambda: load_model(start, cfg.model.dtype, device), **a.parameterization_params), \
        a.parameterization
