"""Benchmark: one GRPO step of posttrain vs TRL's ``GRPOTrainer`` on a tiny model (not a test).

Setting (both sides): a freshly initialised LLaMA (hidden 256, intermediate 512, 4 layers, 4
heads) over posttrain's ``PRINTABLE`` character vocabulary (95 characters + 7 specials = 102
tokens), fp32 on CPU; 8 prompts x 8 completions per step, 32 new tokens, temperature 1.0, no
top-k / top-p, no reference model (beta / kl_coef = 0), one optimizer step per batch (one
generation per step, so neither side recomputes old log-probs), AdamW, lr 1e-4, grad clip 1.0.

Prompts: 2-digit additions such as ``"21+43="`` through the tokenizer's chat template
(``<|bos|><|user|>21+43=<|assistant|>``): 9 tokens on both sides (printed). posttrain draws them
from its ``arithmetic`` task; TRL gets a conversational ``datasets.Dataset`` made from the same
task's public ``examples()`` and applies the same chat template itself.

Reward (both sides): the fraction of digits in the completion text, so that groups have
non-zero reward spread and the advantages are non-zero.

Equal work: a random model over 102 tokens samples EOS with probability ~1/102 per token, so
about a third of 32-token completions would stop early and the two sides would not train on the
same number of tokens. EOS is therefore suppressed on both sides (TRL:
``generation_kwargs={"suppress_tokens": [eos]}``; posttrain: ``rollout.min_new_tokens=32``), so
every completion has exactly 32 tokens; the script prints the token counts of each side.
``--allow-eos`` turns this off.

How it runs (``lib/lockstep.py``): each side in its own process through its public API only
(posttrain: ``load_config`` with dotted overrides, printed with ``--verbose``, and
``posttrain.train.rl.train``; TRL: ``GRPOTrainer``), in lockstep at the reward call, one step at
a time, alternately. A step is one full cycle of a loop, reward call to reward call; ``--steps``
steps give ``steps - 1`` such cycles, the first two are discarded and the median of the rest is
reported, with the fastest and slowest. It also prints each side's generation and update, its peak memory, and both
phases against floors measured on this machine (``lib/report.py``).

TRL version: written against trl 1.16.0 (transformers 5.24.0, torch 2.13.0+cpu, accelerate
1.16.0, datasets 5.2.0). GRPOConfig semantics there: ``generation_batch_size =
per_device_train_batch_size * num_processes * steps_per_generation``, ``steps_per_generation``
defaults to ``gradient_accumulation_steps``; so ``per_device_train_batch_size=64``,
``gradient_accumulation_steps=1``, ``num_generations=8`` gives one generation of 8 prompts x 8
completions per optimizer step. Without TRL installed only the posttrain side runs.

Run alone on the machine (2 cores: anything else running skews the figures 2-4x):

    python bench/grpo_step.py              # 11 steps per side: 10 full steps, median of the last 8
    python bench/grpo_step.py --steps 20
    python bench/grpo_step.py --threads 1  # 1 torch thread per process
    python bench/grpo_step.py --smoke      # 2 x 2 completions of 4 tokens, 2 steps: checks it runs

Last line: ``posttrain_step_s=X trl_step_s=Y speedup=Z`` (speedup = Y / X; > 1 means posttrain
is faster; ``n/a`` for the TRL side when it is not installed).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import GROUP, NEW_TOKENS, PROMPTS, build_model, machine_line
from lib.lockstep import Setting, lockstep_sides, run_lockstep
from lib.report import Dims, final_line, floors, print_floors, print_report

WARMUP = 2  # full steps discarded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=11, help="steps per side (the first 2 full steps are discarded)")
    ap.add_argument("--allow-eos", action="store_true", help="let completions stop at EOS (unequal work)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to build/reuse the model")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (default: one per core)")
    ap.add_argument("--verbose", action="store_true", help="show the side processes' output")
    ap.add_argument("--no-trl", action="store_true", help="run the posttrain side alone (trl_step_s=n/a)")
    ap.add_argument("--smoke", action="store_true", help="2 x 2 completions of 4 tokens, 2 steps: checks it runs")
    args = ap.parse_args()
    prompts, group, new_tokens, warmup = PROMPTS, GROUP, NEW_TOKENS, WARMUP
    if args.smoke:
        prompts, group, new_tokens, warmup, args.steps = 2, 2, 4, 0, 2
        args.threads = args.threads or 1  # robust to a busy machine; the figures mean nothing here
    elif args.steps < warmup + 3:
        ap.error(f"--steps must be >= {warmup + 3}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    sides = lockstep_sides(args.no_trl)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_model(args.model_dir or work / "model")
        setting = Setting(
            model=str(model_dir),
            model_dir=str(model_dir),
            task="arithmetic",
            task_params={"digits": 2, "ops": "+", "reverse": True},
            prompts=prompts,
            group=group,
            new_tokens=new_tokens,
            steps=args.steps,
            lr=1e-4,
            suppress_eos=not args.allow_eos,
            threads=args.threads,
        )
        results = run_lockstep(setting, work, sides, args.verbose)
        dims = Dims.from_dir(model_dir)
    print(
        f"\nsetting: tiny LLaMA ({dims.params:,} parameters), {prompts} prompts x {group} completions, "
        f"{new_tokens} new tokens, fp32, beta=0, EOS {'allowed' if args.allow_eos else 'suppressed on both sides'}; "
        f"{args.steps} steps per side in lockstep, {warmup} full step(s) discarded"
    )
    if "trl" in results:
        print(f"TRL {results['trl']['trl_version']} (optimizer {results['trl']['optim']}); posttrain AdamW")
    step_s = print_report(results, prompts, group, new_tokens, warmup)
    pt = results["posttrain"]["prompt_tokens"]
    f = floors(dims, prompts, group, sum(pt) / len(pt), new_tokens, reps=3 if args.smoke else 30)
    print_floors(f, results, warmup)
    print(final_line(step_s))


if __name__ == "__main__":
    main()
