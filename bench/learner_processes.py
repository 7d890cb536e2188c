r"""Benchmark: the one-process learner against the sharded one (``train.processes``), side by side.

The same short GRPO run of SmolLM2-135M-Instruct as ``bench/async_steps.py`` (word problems through
the chat template, EOS suppressed; ``lib/lockstep.py``'s settings) with a reward that varies within
every group (the share of distinct characters in a completion: every step moves the weights),
with ``train.processes`` = 1 and then each value of ``--processes``, through the public API
(``load_config`` + ``train``). With M > 1 the update runs on M spawned FSDP2 ranks, each with its share
of the micro-batches and 1/M of the weights' and Adam moments' shards, and the driver's copy of the
policy (shared memory) takes the new weights after every update
(``posttrain/learn/distributed/fsdp_learner.py``). The first ``--skip`` steps are discarded; the medians
of the rest are printed, with the largest difference between the final weights of each run and the one-
process run (the runs sample the same batches; only reduction order differs) and how far the weights
moved from the start.

    python bench/learner_processes.py                       # CPU, fp32, 4x4x32, M = 1 and 2, 6 steps
    python bench/learner_processes.py --device cuda --processes 2,4 --shape 16x8x128
    python bench/learner_processes.py --smoke               # 2 layers, 2x2x4, 3 steps
    python bench/learner_processes.py --ray                 # + each M with the ranks as Ray actors

With ``--ray`` each M also runs with ``cluster.backend = "ray"`` (one rollout worker actor samples; the
ranks are actors in a placement group and rank 0 returns the weights with every update, since actors
share no memory with the driver): the table adds those rows, labelled ``M ray``. Their batches come
from the rollout worker's draws, not the one-process run's, so their "max |dw| vs 1" is no check of
equality (``tests/learn/distributed/test_ray_learner.py`` compares Ray runs with Ray runs).

Last line: ``one_update_s=X sharded_update_s=Y speedup=Z`` (the first ``--processes`` value).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from common import machine_line
from lib.lockstep import Setting, posttrain_overrides
from lib.side_by_side import bench_model, run_args

REWARD = "bench_processes_distinct_chars"
TASK, TASK_PARAMS = "word_math", {"ops": "+", "plain_share": 1.0}
KEYS = ("time/step_s", "time/generate_s", "time/update_s")


def run(model_dir: Path, shape: tuple[int, int, int], processes: int, args: argparse.Namespace, work: Path,
        ray: bool = False) -> dict:
    """One short run; the medians of :data:`KEYS` over its steps after the first ``args.skip``, and
    its final weights.
    """
    from rich.console import Console
    from safetensors.torch import load_file

    from posttrain.config import load_config
    from posttrain.train.rl import train

    prompts, group, tokens = shape
    s = Setting(model=str(model_dir), model_dir=str(model_dir), task=TASK, task_params=TASK_PARAMS,
                prompts=prompts, group=group, new_tokens=tokens, steps=args.steps, lr=2e-6)
    out = work / f"run_m{processes}{'_ray' if ray else ''}"
    overrides = [o for o in posttrain_overrides(s, str(out)) if not o.startswith(("reward=", "checkpoint.every"))]
    overrides += [f"model.device={args.device}", f"model.dtype={args.dtype}", f'reward=[{{name = "{REWARD}"}}]',
                  f"train.processes={processes}", f"checkpoint.every={args.steps}"]
    if ray:
        overrides += ["cluster.backend=ray", "cluster.rollout_workers=1"]
    train(load_config(None, overrides), console=Console(file=sys.stderr, quiet=True))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][args.skip:]
    got = {k: statistics.median(float(r.get(k, 0.0)) for r in rows) for k in KEYS}
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    got["weights"] = load_file(str(ckpt / "model.safetensors"))
    return got


def main() -> None:
    from safetensors.torch import load_file

    args, shape, values = run_args(__doc__, flag="processes", default="2", least=2, steps=6,
                                   skip=1, smoke_steps=3, what="train.processes values to compare with 1")
    from posttrain.rewards import register

    register(REWARD)(lambda prompt, completion, **_: len(set(completion)) / max(1, len(completion)))
    print(machine_line())
    print(f"torch threads {torch.get_num_threads()} (one process), {torch.get_num_threads()} // M a rank")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = bench_model(args, work, "learner_processes.py")
        p, g, t = shape
        print(f"shape {p}x{g}x{t}; {args.device}, {args.dtype}; {args.steps} steps, the first {args.skip} "
              "discarded; medians (s)")
        start = load_file(str(next(model_dir.glob("*.safetensors"))))
        print(f"{'processes':>9} {'step':>7} {'generate':>9} {'update':>7} {'max |dw| vs start':>18} "
              f"{'max |dw| vs 1':>14}")
        results = {}
        for m, ray in [(1, False), *((v, False) for v in values), *((v, True) for v in values if args.ray)]:
            r = results[m, ray] = run(model_dir, shape, m, args, work, ray)
            w1, wm = results[1, False]["weights"], r["weights"]
            moved = max(float((wm[k].float() - start[k].float()).abs().max()) for k in start if k in wm)
            diff = max(float((w1[k].float() - wm[k].float()).abs().max()) for k in w1)
            label = f"{m} ray" if ray else str(m)
            print(f"{label:>9} {r['time/step_s']:7.2f} {r['time/generate_s']:9.2f} {r['time/update_s']:7.2f} "
                  f"{moved:18.2e} {diff:14.2e}", flush=True)
    one, sharded = results[1, False]["time/update_s"], results[values[0], False]["time/update_s"]
    print(f"one_update_s={one:.3f} sharded_update_s={sharded:.3f} speedup={one / sharded:.2f}")


if __name__ == "__main__":
    main()
