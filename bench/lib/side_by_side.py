"""What the side-by-side run benchmarks (``async_steps.py``, ``learner_processes.py``) share: their
command line (device, dtype, shape, steps, a comma-separated list of settings to compare with the
baseline, ``--smoke``) and the model they run (SmolLM2-135M-Instruct, or random weights of a config).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def run_args(doc: str, *, flag: str, default: str, what: str, least: int, steps: int, skip: int,
             smoke_steps: int) -> tuple[argparse.Namespace, tuple[int, int, int], list[int]]:
    """Parse the command line; the args, the run's shape and the values of ``--flag`` (each >= ``least``)."""
    from step_phases import parse_shapes

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--shape", default="4x4x32", help="PROMPTSxGROUPxTOKENS")
    ap.add_argument(f"--{flag}", default=default, help=f"comma-separated {what}")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--skip", type=int, default=skip, help="first steps discarded")
    ap.add_argument("--config-dir", type=Path, default=None, help="random weights of this config + tokenizer")
    ap.add_argument("--smoke", action="store_true", help=f"2 layers, 2x2x4, {smoke_steps} steps")
    if flag == "staleness":
        ap.add_argument("--partial", default="finish", help="comma-separated rollout.on_new_weights values run at each "
                        "S > 0 (finish, resubmit, continue)")
        ap.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout.engine of every run")
    if flag == "processes":
        ap.add_argument("--ray", action="store_true", help='each M also with cluster.backend = "ray" (rank actors)')
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.steps = "2x2x4", smoke_steps
    values = [int(v) for v in getattr(args, flag).split(",")]
    if flag == "staleness":
        args.partial = [v.strip() for v in args.partial.split(",") if v.strip()]
        if not args.partial or set(args.partial) - {"finish", "resubmit", "continue"}:
            ap.error(f"--partial takes finish, resubmit and continue, got {args.partial}")
    if any(v < least for v in values) or args.steps <= args.skip:
        ap.error(f"--{flag} values must be >= {least} and --steps larger than --skip")
    return args, parse_shapes(args.shape)[0], values


def bench_model(args: argparse.Namespace, work: Path, script: str) -> Path:
    """The model directory of the runs: random weights of ``--config-dir``, else SmolLM2-135M-Instruct
    (its first 2 layers with ``--smoke``).
    """
    from common import smollm2_dir, smollm2_missing
    from step_phases import random_model

    if args.config_dir is not None:
        return random_model(args.config_dir, work / "model")
    if smollm2_missing():
        raise SystemExit(f"{script} needs SmolLM2-135M-Instruct or --config-dir: {smollm2_missing()}")
    layers = 2 if args.smoke else None
    return smollm2_dir(work / f"smollm2-{layers}layers" if layers else work / "smollm2", layers)
