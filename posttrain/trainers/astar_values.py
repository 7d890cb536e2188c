"""``posttrain astar-values RECIPE``: A*-PO's offline V* stage, as a command.

A*-PO (arXiv:2505.20686; authors' code ZhaolinGao/A-PO @ c8823a32ae) samples N responses per training prompt
from the frozen reference policy before training and keeps V*(x) = beta1 log( (1/N) sum_j exp(r_j / beta1) )
(N = 8, beta1 = 0.5; beta1 = 0: the mean). A run of the recipe does the same lazily
(``produce/ref_samples.py``); this command does it up front and writes the file a run reads with
``algorithm.reference_values`` (format: ``produce/ref_values.py``):

- the starting model is the recipe's ``model.path`` (a run directory: its latest checkpoint; ``"tiny"``: the
  tiny model built, as the run builds it, into ``RUN/base_model``, where the run then finds it);
- the prompts are the run's training prompts in the order it meets them: a dataset's whole training pool
  (one epoch of its seeded stream, after the too-long prompts are dropped), or for a built-in task the
  prompts drawn at every data cursor of ``train.steps x rollout.max_gen_batches`` generation batches;
  ``--limit N`` keeps the first N;
- each prompt's M = the run's reference samples (``a_star``'s ``samples``, or par's) are drawn by
  :meth:`ReferenceRewards.for_run`, the run's own sampler (seed from the run seed and the prompt text), so
  the file holds exactly the rewards the run would sample; the run's ``[[reward]]`` components score them
  (the task's verifier gives ``all_failed``);
- V* is at the recipe's ``a_star`` beta1 (the estimator's default when the recipe does not run ``a_star``).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

from rich.console import Console

from posttrain.algorithms import advantages
from posttrain.config import Config, ConfigError, ProduceSettings
from posttrain.models.host_memory import apply_setting as apply_host_memory
from posttrain.models.load import load_model, load_tokenizer, resolve_device
from posttrain.produce.drivers import draw_prompts, score
from posttrain.produce.parts import reference_samples
from posttrain.produce.ref_samples import ReferenceRewards
from posttrain.produce.ref_values import value_row, write_values
from posttrain.reporting.progress import make_progress, summary_table
from posttrain.rewards import pool_for
from posttrain.run.setup import build_task, check_context, drop_long_prompts, resolve_model_path
from posttrain.tasks.base import Example, Task


def run_astar_values(cfg: Config, *, out: str | None = None, limit: int | None = None, recipe: str | None = None,
                     console: Console | None = None) -> dict:
    """Sample, score and write the reference rewards and V* of the run's training prompts (module
    docstring); print a summary and return it. ``out``: the file (default :func:`default_out`).
    """
    console = console or Console()
    samples, beta1 = check_astar_values(cfg)
    dest = Path(out) if out else default_out(cfg, recipe)
    if dest.is_dir():
        raise ConfigError(f"--out: {str(dest)!r} is a directory; give the JSONL file to write")
    t0 = time.perf_counter()
    pool = pool_for(cfg.scoring)  # the reward workers fork before any model loads
    try:
        task = build_task(cfg)
        device = resolve_device(cfg.model)
        apply_host_memory(cfg.model.host_memory, device)
        path = resolve_model_path(cfg, task, Path(cfg.out))
        tokenizer = load_tokenizer(path)
        model = load_model(path, cfg.model.dtype, device).eval().requires_grad_(False)
        note = drop_long_prompts(cfg, task, tokenizer, model.config.max_position_embeddings)
        if note:
            console.print(note)
        check_context(cfg, task, tokenizer, model.config.max_position_embeddings)
        examples = training_prompts(cfg, task, limit)
        if not examples:
            raise ConfigError(f"posttrain astar-values: task {task.name!r} has no training prompts")
        rewards = [(s.name, dict(s.params)) for s in cfg.reward]
        ref = ReferenceRewards.for_run(ProduceSettings.of(cfg), model, tokenizer,
                                       lambda exs, rollouts: score(rewards, task, exs, rollouts, cfg, pool), samples)
        rows = sample_rows(ref, examples, beta1, console, cfg.log.progress)
    finally:
        if pool is not None:
            pool.close()
    write_values(dest, rows)
    summary = {
        "file": str(dest), "model": path, "prompts": len(rows), "samples": samples, "beta1": beta1,
        "v_star_mean": sum(r["v_star"] for r in rows) / len(rows),
        "all_failed_frac": sum(r["all_failed"] for r in rows) / len(rows),
        "wall_s": time.perf_counter() - t0,
    }
    console.print(summary_table(f"posttrain astar-values: {task.name}", [
        ("model", path), ("prompts", str(summary["prompts"])), ("reference samples (M)", str(samples)),
        ("beta1", f"{beta1:g}"), ("mean V*", f"{summary['v_star_mean']:.4f}"),
        ("all failed", f"{summary['all_failed_frac']:.1%}"), ("time", f"{summary['wall_s']:.1f} s"),
    ]))
    console.print(f"written {dest}; train with it: algorithm.reference_values=\"{dest}\" "
                  "(and algorithm.filter_unsolved=true to drop the all-failed prompts of a dataset)", soft_wrap=True)
    return summary


def check_astar_values(cfg: Config) -> tuple[int, float]:
    """(M, beta1) of the recipe: its reference samples per prompt and ``a_star``'s beta1; a ConfigError
    when the recipe samples no reference responses or its prompts are multi-turn episodes.
    """
    samples = reference_samples(cfg.algorithm)
    if not samples:
        raise ConfigError("posttrain astar-values: this recipe samples no reference responses; set "
                          "algorithm.advantage = 'a_star' (algorithm.advantage_params.samples = N) or a par shaper "
                          "with samples > 0 (e.g. recipes/a_star_po.toml)")
    if cfg.task.env is not None:
        raise ConfigError("posttrain astar-values: task.name = 'env' has multi-turn episodes; reference samples "
                          "are single responses")
    a = cfg.algorithm
    default = inspect.signature(advantages.REGISTRY.get("a_star")).parameters["beta1"].default
    beta1 = float(a.advantage_params.get("beta1", default)) if a.advantage == "a_star" else float(default)
    return samples, beta1


def default_out(cfg: Config, recipe: str | None) -> Path:
    """Where the file goes without ``--out``: the recipe's ``algorithm.reference_values`` (where its run will
    read it), else ``<recipe>.values.jsonl`` next to the recipe, else ``astar_values.jsonl`` here.
    """
    if cfg.algorithm.reference_values:
        return Path(cfg.algorithm.reference_values)
    if recipe:
        return Path(recipe).with_suffix(".values.jsonl")
    return Path("astar_values.jsonl")


def training_prompts(cfg: Config, task: Task, limit: int | None) -> list[Example]:
    """The run's training prompts, each once, in the order the run draws them (module docstring); the
    first ``limit`` of them when given.
    """
    pools = getattr(task, "pools", None)
    if pools is not None:  # a dataset: one epoch of its stream (every training prompt once)
        n = len(pools["train"]) if limit is None else min(limit, len(pools["train"]))
        batches = [draw_prompts(task, n, cfg.seed, 0)]
    else:  # a built-in task: a generation batch takes P prompts at data cursor b P
        P = cfg.rollout.prompts_per_step
        batches = (draw_prompts(task, P, cfg.seed, b * P) for b in range(cfg.train.steps * cfg.rollout.max_gen_batches))
    out: dict[str, Example] = {}  # the first of a repeated prompt (its rewards are the same: keyed by the text)
    for batch in batches:
        for ex in batch:
            out.setdefault(ex.prompt, ex)
        if limit is not None and len(out) >= limit:
            break
    return list(out.values())[:limit]


def sample_rows(ref: ReferenceRewards, examples: list[Example], beta1: float, console: Console,
                progress: bool) -> list[dict]:
    """One file row per example (``ref_values.value_row``), sampled prompt by prompt with a progress bar."""
    rows: list[dict] = []
    with make_progress(console, "astar-values", progress) as bar:
        task_id = bar.add_task("astar-values", total=len(examples), metrics="")
        for ex in examples:
            rewards_M = ref([ex], ref.sampling.n)[0]
            rows.append(value_row(ex, rewards_M, ref.correct.get(ex.prompt), beta1))
            mean_v = sum(r["v_star"] for r in rows) / len(rows)
            failed = sum(r["all_failed"] for r in rows) / len(rows)
            bar.update(task_id, advance=1, metrics=f"V*={mean_v:.3g} all_failed={failed:.0%}")
    return rows
