r"""Benchmark: GRPO on a reasoning-gym dataset with SmolLM2-135M-Instruct, held-out accuracy before and after,
over several seeds (not a test).

Setting: ``recipes/reasoning_gym.toml`` as it stands (reasoning-gym's ``chain_sum``: sums and differences of 2
or 3 one-digit numbers, scored by the dataset's own ``score_answer``; 4 prompts x 4 completions of up to 48
tokens a step, 60 steps, lr 2e-6), run through the public API (``posttrain.evaluate`` and ``posttrain.train``).
For each seed: the model as shipped is evaluated on ``--prompts`` held-out problems (greedy pass@1, the test
split, which training never draws from), then the recipe trains with that seed and the run's own final
evaluation scores the same problems. Wall time is measured around each part; ``train_s`` is the whole
``posttrain.train`` call (model load, steps, checkpoints, the final evaluation).

    python bench/reasoning_gym_heldout.py                 # seeds 0 1 2, 60 steps, 200 held-out problems
    python bench/reasoning_gym_heldout.py --seeds 3 --steps 30
    python bench/reasoning_gym_heldout.py --smoke         # one seed, 2 steps, 8 problems, short answers

Needs the ``real`` and ``reasoning_gym`` extras. Run it alone: with 2 cores, anything beside it skews the times.
Last line: ``seeds=N baseline_mean=A final_mean=B gain_min=C wall_max_s=D``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import machine_line
from rich.console import Console
from rich.table import Table

import posttrain

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "reasoning_gym.toml"
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false"]
SMOKE = ["train.steps=2", "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8",
         "checkpoint.every=0"]


def one_seed(seed: int, steps: int, prompts: int, out: Path, extra: list[str], console: Console) -> dict:
    """Baseline, training and final held-out accuracy of one seed; the times of each part."""
    common = [f"seed={seed}", f"eval.prompts={prompts}", *QUIET, *extra]
    t0 = time.perf_counter()
    base = posttrain.evaluate(RECIPE, overrides=[*common, f"out={out}"], out=out / "baseline.json",
                              console=console)
    t1 = time.perf_counter()
    summary = posttrain.train(RECIPE, overrides=[*common, f"train.steps={steps}", f"out={out / 'rl'}"],
                              console=console)
    t2 = time.perf_counter()
    return {"seed": seed, "baseline": base["metrics"]["pass@1"], "final": summary["final"]["pass@1"],
            "steps": summary["steps"], "eval_s": t1 - t0, "train_s": t2 - t1, "wall_s": t2 - t0}


def report(rows: list[dict], prompts: int) -> str:
    """The table (printed) and the last line."""
    table = Table(title=f"reasoning-gym chain_sum, SmolLM2-135M-Instruct: held-out pass@1 on {prompts} problems "
                        "(greedy)")
    for col in ("seed", "baseline", "after GRPO", "gain", "steps", "train time", "wall time"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["seed"]), f"{r['baseline']:.1%}", f"{r['final']:.1%}",
                      f"{r['final'] - r['baseline']:+.1%}", str(r["steps"]), f"{r['train_s'] / 60:.1f} min",
                      f"{r['wall_s'] / 60:.1f} min")
    Console().print(table)
    return (f"seeds={len(rows)} baseline_mean={statistics.mean(r['baseline'] for r in rows):.3f} "
            f"final_mean={statistics.mean(r['final'] for r in rows):.3f} "
            f"gain_min={min(r['final'] - r['baseline'] for r in rows):+.3f} "
            f"wall_max_s={max(r['wall_s'] for r in rows):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=200, help="held-out problems")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--smoke", action="store_true", help="one seed, 2 steps, 8 problems: proves the script runs")
    args = ap.parse_args()
    seeds, steps, prompts, extra = args.seeds, args.steps, args.prompts, []
    if args.smoke:
        seeds, steps, prompts, extra = seeds[:1], 2, 8, SMOKE
    print(machine_line())
    console = Console(quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        rows = []
        for seed in seeds:
            rows.append(one_seed(seed, steps, prompts, root / f"seed{seed}", extra, console))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(report(rows, prompts))


if __name__ == "__main__":
    main()
