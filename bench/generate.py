"""Benchmark: posttrain's HF rollout engine vs ``transformers``' ``model.generate`` (not a test).

Same model, same prompts, same work: a freshly initialised tiny LLaMA (hidden 256, intermediate
512, 4 layers, 4 heads, 102-token character vocabulary, fp32, CPU), 8 prompts x 8 samples,
exactly 32 new tokens per sample, temperature 1.0, no top-k / top-p. posttrain's engine comes from
its public factory, ``posttrain.rollout.make_engine("hf", model, tokenizer)``.

Equal length on both sides: ``model.generate`` gets ``min_new_tokens=32`` (its logits processor
sets the EOS logit to -inf until 32 tokens exist); posttrain's ``HFEngine`` gets the same EOS
mask (``SamplingParams(min_new_tokens=32)``). The script checks that both
produced 8 x 8 x 32 = 2048 tokens and prints the tokens with the times.

Differences that are the implementations' own (and so part of what is measured):
``HFEngine`` prefills each prompt once and repeats its KV cache 8 times; ``model.generate`` with
``num_return_sequences=8`` repeats the prompt 8 times before the prefill.

Run alone on the machine (2 cores: anything else running skews the figures 2-4x):

    python bench/generate.py                # 2 warm-up runs each, then 7 timed runs each, alternating
    python bench/generate.py --runs 11
    python bench/generate.py --threads 1    # 1 torch thread
    python bench/generate.py --smoke        # 2 x 2 samples of 4 tokens, 1 run each: checks it runs

Last line: ``posttrain_gen_s=X hf_generate_s=Y speedup=Z`` (speedup = Y / X; > 1 means posttrain
is faster).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import (
    GROUP,
    NEW_TOKENS,
    PROMPTS,
    build_model,
    machine_line,
    median,
    prompt_ids,
    prompt_texts,
    timed_interleaved,
)

from posttrain.models import load_model, load_tokenizer
from posttrain.rollout import SamplingParams, make_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--model-dir", type=Path, default=None, help="where to build/reuse the model (default: a temporary directory)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--smoke", action="store_true", help="2 x 2 samples of 4 tokens, 1 run each: checks it runs")
    args = ap.parse_args()
    prompts_n, group, new_tokens = PROMPTS, GROUP, NEW_TOKENS
    if args.smoke:
        prompts_n, group, new_tokens, args.warmup, args.runs = 2, 2, 4, 1, 1
        args.threads = args.threads or 1  # robust to a busy machine; the figures mean nothing here
    elif args.runs < 5:
        ap.error("--runs must be >= 5")
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.model_dir or Path(tmp) / "model")
        tokenizer = load_tokenizer(str(path))
        model = load_model(str(path), "float32").eval()
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        prompts = prompt_ids(tokenizer, prompt_texts(prompts_n))
        print(machine_line())
        print(
            f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}; "
            f"{prompts_n} prompts x {group} samples x {new_tokens} new tokens; prompt tokens "
            f"{[len(p) for p in prompts]}"
        )

        # --- posttrain's hf engine ----------------------------------------------------------
        engine = make_engine("hf", model, tokenizer)
        sampling = SamplingParams(
            max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0, n=group, min_new_tokens=new_tokens
        )

        def ours() -> int:
            rollouts = engine.generate(prompts, sampling, seed=0)
            return int(rollouts.num_tokens)

        # --- transformers model.generate ----------------------------------------------------
        padded = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # left (generation)
        ids, attn = padded["input_ids"], padded["attention_mask"]
        width = ids.shape[1]

        def theirs() -> int:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    num_return_sequences=group,
                    pad_token_id=pad,
                    eos_token_id=eos,
                )
            new = out[:, width:]
            # tokens up to and including the first EOS, as posttrain counts them
            is_eos = new == eos
            return int(((is_eos.long().cumsum(1) - is_eos.long()) == 0).sum())

        torch.manual_seed(0)
        res = timed_interleaved({"ours": ours, "hf": theirs}, args.warmup, args.runs)
        (ours_times, ours_tokens), (hf_times, hf_tokens) = res["ours"], res["hf"]

    expected = prompts_n * group * new_tokens
    for name, times, tokens in (
        ("posttrain engine.generate", ours_times, ours_tokens),
        ("transformers model.generate", hf_times, hf_tokens),
    ):
        m = median(times)
        print(
            f"{name:28s} median {m:.3f} s over {len(times)} runs (min {min(times):.3f}, "
            f"max {max(times):.3f}); {tokens} tokens -> {tokens / m:,.0f} tokens/s"
        )
        if tokens != expected:
            print(f"  WARNING: {tokens} generated tokens, expected {expected}: not equal work")
    ours_s, hf_s = median(ours_times), median(hf_times)
    print(
        f"fastest runs (less sensitive to background load): posttrain {min(ours_times):.3f} s, "
        f"transformers {min(hf_times):.3f} s, speedup {min(hf_times) / min(ours_times):.2f}"
    )
    print(f"posttrain_gen_s={ours_s:.4f} hf_generate_s={hf_s:.4f} speedup={hf_s / ours_s:.2f}")


if __name__ == "__main__":
    main()
