"""``posttrain demo --agent``: a tiny model learns a multi-turn game, and turn-level credit is compared
with episode-level credit.

1. build a tiny LLaMA over the environment's characters; 2. SFT warm-up on a small pool of noisy
expert transcripts (the environment's ``demonstration``); 3. held-out success (greedy episodes) of
the SFT model: the baseline; 4. from that checkpoint, the same RL run with each advantage
estimator: ``grpo`` (one number per episode on all its turns), ``trloo`` (turn returns with a
leave-one-out baseline per turn index, KernelGYM) and ``gigpo`` (episode term plus a step term over
turns taken from the same state, GiGPO); 5. held-out success and mean turns to solve of each, a
table, plots and ``summary.json``.

The default game is ``guess_number`` (a hidden number in 1..16, replies ``higher`` / ``lower``): the
expert is binary search, its noisy demonstrations make the warm-up model guess carelessly, and RL
rewards solving it within the turn limit.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from posttrain.config import Config, config_from_dict
from posttrain.evaluation import evaluate_samples
from posttrain.models.load import load_model, load_tokenizer
from posttrain.reporting.plots import plot_metrics
from posttrain.reporting.sinks import read_metrics
from posttrain.rollout import engine_for
from posttrain.run.setup import build_task
from posttrain.seeds import derive_seed
from posttrain.train.rl import train
from posttrain.trainers.sft import sft

ENV = {"name": "guess_number", "params": {"high": 16, "noise": 0.8}, "max_tokens": 96}
ESTIMATORS = ("grpo", "trloo", "gigpo")
SFT_STEPS = 150
RL_STEPS = 240


def agent_config(out: str, seed: int, quick: bool) -> dict:
    """The demo's settings as a plain config dict (the keys a recipe uses)."""
    cfg: dict = {
        "seed": seed,
        "out": out,
        "task": {"name": "env", "env": ENV},
        "model": {"path": "tiny", "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 3,
                                           "num_heads": 4, "max_positions": 128}},
        "sft": {"steps": SFT_STEPS, "demos": 400, "batch_size": 32, "lr": 1e-3, "eval_every": 50,
                "eval_prompts": 100, "target_accuracy": None},
        "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 4, "temperature": 1.0},
        "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "loss_params": {"eps_low": 0.2, "eps_high": 0.2}},
        "train": {"steps": RL_STEPS, "lr": 3e-4, "warmup_steps": 5},
        "eval": {"every": 40, "prompts": 200},
        "checkpoint": {"every": 0},
        "log": {"samples_every": 20},
    }
    if quick:
        cfg["train"]["steps"] = RL_STEPS // 3
        cfg["eval"] = {"every": 20, "prompts": 100}
    return cfg


def run_agent_demo(
    out: str = "runs/demo-agent",
    seed: int = 0,
    quick: bool = False,
    max_steps: int | None = None,
    estimators: tuple[str, ...] = ESTIMATORS,
    console: Console | None = None,
) -> dict:
    """Run the whole agent demo; returns and writes ``summary.json`` in ``out``."""
    console = console or Console()
    t_start = time.perf_counter()
    root = Path(out)
    base = agent_config(str(root), seed, quick)
    if max_steps is not None:
        base["train"]["steps"] = max_steps

    def sub(name: str, **changes: dict) -> Config:
        d = json.loads(json.dumps(base))
        d["out"] = str(root / name)
        for section, values in changes.items():
            d[section] = {**d.get(section, {}), **values}
        return config_from_dict(d)

    console.rule(f"[bold]1-2. tiny model + SFT on noisy expert transcripts of {ENV['name']}")
    sft_sum = sft(sub("sft"), console=console)
    start = sft_sum["checkpoint"]
    console.rule("[bold]3. baseline: held-out success of the SFT model (greedy episodes)")
    baseline = _evaluate(start, sub("baseline"))
    console.print(f"baseline success = {baseline['pass@1']:.3f}, turns to solve = {baseline['turns_to_solve']:.2f}")
    runs = {}
    for name in estimators:
        console.rule(f"[bold]4. RL from the SFT checkpoint: {name}")
        s = train(sub(name, model={"path": start}, algorithm={"advantage": name}), console=console)
        rows = read_metrics(root / name / "metrics.jsonl")
        runs[name] = {"final": s["final"], "steps": s["steps"], "train_s": sum(r["time/step_s"] for r in rows)}
        plot_metrics(rows, ["episode/success", "episode/turns_mean", "reward/mean"], root / "plots" / f"{name}.png",
                     title=f"{name} on {ENV['name']}")
    summary = {"env": ENV, "seed": seed, "quick": quick, "sft_steps": sft_sum["steps"], "baseline": baseline,
               "runs": runs, "wall_s": time.perf_counter() - t_start}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_table(console, summary)
    return summary


def _evaluate(model_dir: str, cfg: Config) -> dict[str, float]:
    task = build_task(cfg)
    tok = load_tokenizer(model_dir)
    engine = engine_for(cfg, load_model(model_dir), tok)
    examples = task.examples("test", cfg.eval.prompts, seed=derive_seed(cfg.seed, "eval"))
    return evaluate_samples(engine, tok, task, examples, max_new_tokens=cfg.rollout.max_new_tokens).metrics


def _fmt_turns(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _print_table(console: Console, s: dict) -> None:
    table = Table(title=f"posttrain demo --agent (seed {s['seed']}): held-out {s['env']['name']}, greedy")
    for col in ("model", "success", "turns to solve", "train steps", "train time"):
        table.add_column(col, justify="right" if col != "model" else "left")
    b = s["baseline"]
    table.add_row("SFT warm-up (baseline)", f"{b['pass@1']:.1%}", _fmt_turns(b["turns_to_solve"]),
                  str(s["sft_steps"]), "")
    for name, r in s["runs"].items():
        f = r["final"]
        table.add_row(f"+ RL, {name}", f"{f['pass@1']:.1%}", _fmt_turns(f["turns_to_solve"]), str(r["steps"]),
                      f"{r['train_s']:.0f}s")
    console.print(table)
    console.print(f"total wall time {s['wall_s']:.0f}s")
