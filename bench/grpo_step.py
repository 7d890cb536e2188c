"""Benchmark: one GRPO step of posttrain vs TRL's ``GRPOTrainer`` (not a test).

Setting (both sides): a freshly initialised LLaMA (hidden 256, intermediate 512, 4 layers, 4
heads) over posttrain's ``PRINTABLE`` character vocabulary (95 characters + 7 specials = 102
tokens), fp32 on CPU; 8 prompts x 8 completions per step, 32 new tokens, temperature 1.0, no
top-k / top-p, no reference model (beta / kl_coef = 0), one optimizer step per batch (one
generation per step, so neither side recomputes old log-probs), AdamW, grad clip 1.0.

Prompts: 2-digit additions such as ``"21+43="`` through the tokenizer's chat template
(``<|bos|><|user|>21+43=<|assistant|>``): 9 tokens on both sides (printed). posttrain draws them
from its ``arithmetic`` task; TRL gets the same kind of prompts as a conversational
``datasets.Dataset`` and applies the same chat template itself.

Reward (both sides): the fraction of digits in the completion text, so that groups have
non-zero reward spread and the advantages are non-zero.

Equal work: a random model over 102 tokens samples EOS with probability ~1/102 per token, so
about 27 % of 32-token completions would stop early (measured: ~33 %, mean length ~27 tokens)
and the two sides would not train on the same number of tokens. By default EOS is therefore
suppressed on both sides (TRL: ``generation_kwargs={"suppress_tokens": [eos]}``; posttrain: the
``rollout.min_new_tokens=32``, its sampler's EOS mask), so every completion
has exactly 32 tokens; the script prints the mean completion length of each side.
``--allow-eos`` turns this off.

Timing: each side runs in its own subprocess for ``--steps`` steps, the two in lockstep: after
step 1 the parent lets them take one step at a time, alternately (``Baton``), so their steps never
overlap and a change of background load hits both alike. A step's time runs from its go to its
end (TRL: ``on_step_end`` callback; posttrain: its metric write, the last thing of a step), so it
includes everything the loop does per step. The first 2 steps are discarded (warm-up) and the
median is reported, with the fastest step of each side. posttrain's own ``time/step_s``, split
into generate and update, and TRL's time in generation + scoring are printed too.
The achieved FLOP/s of posttrain's update phase (``time/update_s``), counted both as the nominal
work (6 x non-embedding params x prompt+completion tokens, + lm_head) and as the work it executes
(posttrain's shared-prefix forward runs each distinct prompt once), is compared with a plain
``[tokens, 256] @ [256, 512]`` fp32 matmul timed (best run) on the same machine.

TRL version: written against trl 1.16.0 (transformers 5.24.0, torch 2.13.0+cpu, accelerate
1.16.0, datasets 5.2.0), installed in a separate venv; see bench/README.md. GRPOConfig semantics
there: ``generation_batch_size = per_device_train_batch_size * num_processes *
steps_per_generation``, ``steps_per_generation`` defaults to ``gradient_accumulation_steps``; so
``per_device_train_batch_size=64``, ``gradient_accumulation_steps=1``, ``num_generations=8``,
``num_iterations=1`` gives one generation of 8 prompts x 8 completions per optimizer step.

Run alone on the machine (2 cores: anything else running skews the figures 2-4x):

    .venv-bench/bin/python bench/grpo_step.py              # 10 steps per side, median of steps 3..10
    .venv-bench/bin/python bench/grpo_step.py --steps 20
    .venv-bench/bin/python bench/grpo_step.py --threads 1   # 1 torch thread per process

Last line: ``posttrain_step_s=X trl_step_s=Y speedup=Z`` (speedup = Y / X; > 1 means posttrain
is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import GROUP, NEW_TOKENS, PROMPTS, SPEC, build_model, machine_line, median, prompt_texts

WARMUP_STEPS = 2
LR = 1e-4


def digit_fraction(text: str) -> float:
    """The benchmark reward: share of digit characters in a completion (0 for an empty one)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class Baton:
    """Lockstep between the two side processes: after each step a side reports ``done`` to the parent
    and blocks until the parent says ``go``; the parent lets the sides run one step at a time,
    alternately, so that steps 2.. of the two sides never overlap and a change of background load
    hits both sides alike. A step's time runs from its ``go`` (or the start of training) to its end.
    """

    def __init__(self, go_fd: int, done_fd: int) -> None:
        self.go_fd, self.done_fd = go_fd, done_fd
        self.starts: list[float] = []
        self.ends: list[float] = []

    def start(self) -> None:
        self.starts.append(time.perf_counter())

    def step_done(self) -> None:
        self.ends.append(time.perf_counter())
        os.write(self.done_fd, b"d")
        if os.read(self.go_fd, 1) != b"g":
            raise SystemExit("the benchmark's parent process went away")
        self.starts.append(time.perf_counter())

    def step_s(self) -> list[float]:
        return [end - start for start, end in zip(self.starts, self.ends, strict=False)]


# ------------------------------------------------------------------------------------------------
# posttrain side
# ------------------------------------------------------------------------------------------------


def run_posttrain(model_dir: Path, steps: int, out_dir: Path, suppress_eos: bool, baton: Baton) -> dict:
    from posttrain.config import config_from_dict
    from posttrain.models import load_tokenizer
    from posttrain.reporting.sinks import MetricSinks
    from posttrain.rewards import REGISTRY as REWARDS
    from posttrain.train.rl import train

    if "bench_digit_fraction" not in REWARDS:
        REWARDS.register("bench_digit_fraction")(lambda prompt, completion, **_: digit_fraction(completion))

    cfg = config_from_dict(
        {
            "seed": 0,
            "out": str(out_dir / "posttrain_run"),
            "model": {"path": str(model_dir), "dtype": "float32"},
            "task": {"name": "arithmetic", "params": {"digits": 2, "ops": "+", "reverse": True}},
            "rollout": {
                "group_size": GROUP,
                "prompts_per_step": PROMPTS,
                "max_new_tokens": NEW_TOKENS,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "min_new_tokens": NEW_TOKENS if suppress_eos else 0,
            },
            "algorithm": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "token_mean", "kl_coef": 0.0},
            "train": {
                "steps": steps,
                "lr": LR,
                "warmup_steps": 0,
                "schedule": "constant",
                "grad_clip": 1.0,
                "epochs": 1,
                "minibatches": 1,
            },
            "reward": [{"name": "bench_digit_fraction", "weight": 1.0}],
            "eval": {"every": 0, "prompts": 8},
            "checkpoint": {"every": 0, "keep": 1},
            "log": {"tensorboard": False, "progress": False, "samples": 0},
        }
    )
    import posttrain.train.rl as rl

    load_tokenizer(str(model_dir))  # fails early if the model directory is broken
    # record the length of every prompt the loop encodes (the token ids it generates from)
    seen_lens: set[int] = set()
    original_encode = rl.encode_chat

    def encode_chat(*a: object, **kw: object) -> list[int]:
        ids = original_encode(*a, **kw)
        seen_lens.add(len(ids))
        return ids

    rl.encode_chat = encode_chat
    original_write = MetricSinks.write

    def write(self: MetricSinks, step: int, metrics: dict) -> None:  # the last thing of each step
        original_write(self, step, metrics)
        baton.step_done()

    MetricSinks.write = write
    baton.start()
    try:
        train(cfg)
    finally:
        MetricSinks.write = original_write
        rl.encode_chat = original_encode
    metrics_path = out_dir / "posttrain_run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    return {
        "side": "posttrain",
        "step_s": baton.step_s(),
        "internal_step_s": [r["time/step_s"] for r in rows],
        "generate_s": [r["time/generate_s"] for r in rows],
        "update_s": [r["time/update_s"] for r in rows],
        "completion_len_mean": [r["response/length_mean"] for r in rows],
        "reward_std": [r["reward/std"] for r in rows],
        "optimizer_steps": [r["train/optimizer_steps"] for r in rows],
        "prompt_tokens": sorted(seen_lens),
    }


# ------------------------------------------------------------------------------------------------
# TRL side
# ------------------------------------------------------------------------------------------------


def run_trl(model_dir: Path, steps: int, out_dir: Path, suppress_eos: bool, baton: Baton) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.models import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    texts = prompt_texts(PROMPTS * steps, seed=1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    # the prompt tokens TRL will feed: its own chat-template call, as in GRPOTrainer._tokenize_prompts
    prompt_lens = sorted(
        {
            len(ids)
            for ids in tokenizer.apply_chat_template(
                [row["prompt"] for row in dataset],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        }
    )

    seen: dict[str, list] = {"len": [], "eos": [], "reward_std": []}

    def digit_reward(prompts: list, completions: list, completion_ids: list, **_: object) -> list[float]:
        rewards = [digit_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]
        seen["len"].append(sum(len(ids) for ids in completion_ids) / len(completion_ids))
        seen["eos"].append(sum(tokenizer.eos_token_id in ids for ids in completion_ids))
        seen["reward_std"].append(float(torch.tensor(rewards).std()))
        return rewards

    class Clock(TrainerCallback):
        def on_train_begin(self, args: object, state: object, control: object, **kw: object) -> None:
            baton.start()

        def on_step_end(self, args: object, state: object, control: object, **kw: object) -> None:
            baton.step_done()

    config = GRPOConfig(
        output_dir=str(out_dir / "trl_run"),
        per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        num_iterations=1,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=steps,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=True,
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id]} if suppress_eos else None,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    assert config.steps_per_generation == 1 and config.generation_batch_size == PROMPTS * GROUP, (
        config.steps_per_generation,
        config.generation_batch_size,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    # where TRL's step goes: generation + rewards + advantages happen in _generate_and_score_completions
    gen_s: list[float] = []
    original_gen = trainer._generate_and_score_completions

    def generate_and_score(*a: object, **kw: object) -> object:
        t0 = time.perf_counter()
        out = original_gen(*a, **kw)
        gen_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = generate_and_score
    trainer.train()
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "step_s": baton.step_s(),
        "generate_score_s": gen_s,
        "completion_len_mean": seen["len"],
        "eos_completions": seen["eos"],
        "reward_std": seen["reward_std"],
        # one reward call per generation: generations per optimizer step, as a per-step list
        "optimizer_steps": [trainer.state.global_step / len(seen["len"])] * trainer.state.global_step,
        "prompt_tokens": prompt_lens,
        "optim": str(config.optim),
    }


# ------------------------------------------------------------------------------------------------
# FLOPs and the matmul reference
# ------------------------------------------------------------------------------------------------


def posttrain_shares_prefix() -> bool:
    """Whether posttrain's training forward runs each distinct prompt once (``share_prefix``)."""
    import inspect

    from posttrain.train.logprobs import completion_logprobs

    param = inspect.signature(completion_logprobs).parameters.get("share_prefix")
    return param is not None and param.default is True


def update_flops(prompt_tokens: int, shared_prefix: bool) -> dict:
    """Training FLOPs of one update, forward + backward = 6 x params x positions.

    ``nominal``: the work as the task defines it, every row's prompt + completion through the body
    and the lm_head on the T positions that predict completion tokens (what TRL computes, bar its
    lm_head on all positions). ``executed``: what posttrain runs; with a shared prefix each of the
    P distinct prompts goes through the model once and the last completion token is never input.
    """
    h, i, n_layers = SPEC.hidden_size, SPEC.intermediate_size, SPEC.num_layers
    vocab = len(SPEC.alphabet) + 7  # characters + specials
    body = n_layers * (4 * h * h + 3 * h * i + 2 * h) + h  # attention, MLP, norms, final norm
    rows, L, T = PROMPTS * GROUP, prompt_tokens, NEW_TOKENS
    tokens = rows * (L + T)
    nominal = 6 * body * tokens + 6 * h * vocab * rows * T
    if shared_prefix:
        body_pos, head_pos = PROMPTS * L + rows * (T - 1), PROMPTS + rows * (T - 1)
    else:
        body_pos, head_pos = tokens, rows * (T + 1)  # logits_to_keep = T + 1
    executed = 6 * body * body_pos + 6 * h * vocab * head_pos
    attn = 6 * n_layers * 2 * rows * (L + T) ** 2 * h  # QK^T and AV, unshared (not in the 6N rule)
    return {
        "tokens": tokens,
        "body_params": body,
        "nominal": nominal,
        "executed": executed,
        "body_positions": body_pos,
        "attention_flops": attn,
    }


def matmul_flops_per_s(m: int, k: int, n: int, reps: int = 50) -> float:
    """Best-of-``reps`` FLOP/s of an fp32 ``[m, k] @ [k, n]`` (the best run: the limit on this machine)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times)


# ------------------------------------------------------------------------------------------------


def side_main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fn = run_posttrain if args.side == "posttrain" else run_trl
    baton = Baton(args.go_fd, args.done_fd)
    result = fn(args.model_dir, args.steps, Path(args.work_dir), not args.allow_eos, baton)
    Path(args.result).write_text(json.dumps(result))


class Side:
    """A side's subprocess and its two pipes (see :class:`Baton`)."""

    def __init__(self, name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> None:
        self.name, self.result_path = name, work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        go_r, self.go_w = os.pipe()
        self.done_r, done_w = os.pipe()
        cmd = [
            sys.executable,
            __file__,
            "--side",
            name,
            "--model-dir",
            str(model_dir),
            "--steps",
            str(args.steps),
            "--work-dir",
            str(work / name),
            "--result",
            str(self.result_path),
            "--go-fd",
            str(go_r),
            "--done-fd",
            str(done_w),
        ]
        if args.allow_eos:
            cmd.append("--allow-eos")
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
        log = None if args.verbose else self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT if log else None, env=env, pass_fds=(go_r, done_w)
        )
        os.close(go_r)
        os.close(done_w)

    def wait_done(self) -> None:
        if os.read(self.done_r, 1) != b"d":
            self.fail()

    def go(self) -> None:
        os.write(self.go_w, b"g")

    def finish(self) -> dict:
        self.go()  # release it after its last step
        os.close(self.go_w)
        if self.proc.wait() != 0:
            self.fail()
        return json.loads(self.result_path.read_text())

    def fail(self) -> None:
        self.proc.wait()
        if self.log_path.exists():
            print(self.log_path.read_text()[-6000:])
        raise SystemExit(f"the {self.name} run failed (exit {self.proc.returncode})")


def run_lockstep(model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Start both sides; after step 1 of each, run their steps one at a time, alternately."""
    print(f"running posttrain and trl in lockstep ({args.steps} steps each) ...", flush=True)
    sides = [Side(name, model_dir, work, args) for name in ("posttrain", "trl")]
    for side in sides:  # step 1 (set-up and step 1 of the two sides may overlap: it is discarded)
        side.wait_done()
    for step in range(2, args.steps + 1):
        for side in sides if step % 2 else sides[::-1]:  # alternate which side goes first
            side.go()
            side.wait_done()
    return {side.name: side.finish() for side in sides}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per side (the first 2 are warm-up)")
    ap.add_argument("--allow-eos", action="store_true", help="let completions stop at EOS (unequal work)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads in every process (default: torch's, one per core)"
    )
    ap.add_argument("--verbose", action="store_true", help="show the subprocesses' output")
    ap.add_argument("--side", choices=["posttrain", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--go-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--done-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        side_main(args)
        return
    if args.steps < WARMUP_STEPS + 3:
        ap.error(f"--steps must be >= {WARMUP_STEPS + 3}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_model(args.model_dir or work / "model")
        results = run_lockstep(model_dir, work, args)

    def measured(side: str, key: str) -> list[float]:
        return results[side][key][WARMUP_STEPS:]

    def all_values(side: str, key: str) -> list[float]:
        return results[side][key]

    print(
        f"\nsetting: {PROMPTS} prompts x {GROUP} completions, {NEW_TOKENS} new tokens, fp32, beta=0, "
        f"EOS {'allowed' if args.allow_eos else 'suppressed on both sides'}; {args.steps} steps per side "
        f"in lockstep, first {WARMUP_STEPS} discarded"
    )
    print(f"TRL {results['trl']['trl_version']} (optimizer {results['trl']['optim']}); posttrain AdamW(foreach)")
    for side in ("posttrain", "trl"):
        lens = all_values(side, "completion_len_mean")
        print(
            f"{side:9s}: prompt tokens {results[side]['prompt_tokens']}, mean completion length "
            f"{sum(lens) / len(lens):.2f} tokens (per step min {min(lens):.2f}), optimizer steps per "
            f"generation {set(all_values(side, 'optimizer_steps'))}, median batch reward std "
            f"{median(all_values(side, 'reward_std')):.3f}"
        )
    eos_rows = sum(all_values("trl", "eos_completions"))
    if eos_rows:
        print(f"trl      : {eos_rows} completions ended with EOS")
    pt_steps, tr_steps = measured("posttrain", "step_s"), measured("trl", "step_s")
    pt, tr = median(pt_steps), median(tr_steps)
    internal = {k: median(measured("posttrain", k)) for k in ("internal_step_s", "generate_s", "update_s")}
    print(
        f"posttrain step: median {pt:.3f} s (min {min(pt_steps):.3f}, max {max(pt_steps):.3f}, "
        f"n={len(pt_steps)}); its time/step_s median {internal['internal_step_s']:.3f} s = generate "
        f"{internal['generate_s']:.3f} s + update {internal['update_s']:.3f} s (+ reward)"
    )
    print(
        f"trl step      : median {tr:.3f} s (min {min(tr_steps):.3f}, max {max(tr_steps):.3f}, "
        f"n={len(tr_steps)}); generate + reward + advantages median "
        f"{median(measured('trl', 'generate_score_s')):.3f} s, the rest (loss, backward, optimizer) ~"
        f"{tr - median(measured('trl', 'generate_score_s')):.3f} s"
    )
    print(
        f"ratio trl / posttrain: {tr / pt:.2f} (fastest steps, less sensitive to background load: "
        f"{min(tr_steps) / min(pt_steps):.2f})"
    )

    # distance to the limit: posttrain's update phase vs a plain matmul of the same size
    prompt_tokens = results["posttrain"]["prompt_tokens"][0]
    shared = posttrain_shares_prefix()
    f = update_flops(prompt_tokens, shared)
    update_s = median(measured("posttrain", "update_s"))
    nominal, executed = f["nominal"] / update_s, f["executed"] / update_s
    h, i = SPEC.hidden_size, SPEC.intermediate_size
    mm = matmul_flops_per_s(f["tokens"], h, i)
    big = matmul_flops_per_s(2048, 2048, 2048, reps=10)
    print(
        f"posttrain update phase (time/update_s median {update_s:.3f} s): nominal {f['nominal'] / 1e9:.1f} GFLOP "
        f"(6 x {f['body_params']:,} non-embedding params x {f['tokens']} prompt+completion tokens + lm_head) "
        f"= {nominal / 1e9:.2f} GFLOP/s; executed {f['executed'] / 1e9:.1f} GFLOP ("
        + (f"shared prefix: {f['body_positions']} positions" if shared else "no prefix sharing")
        + f") = {executed / 1e9:.2f} GFLOP/s; attention scores (~{f['attention_flops'] / 1e9:.1f} GFLOP) not counted"
    )
    print(
        f"plain fp32 matmul, best of its runs: [{f['tokens']}x{h}] @ [{h}x{i}] {mm / 1e9:.2f} GFLOP/s; "
        f"[2048x2048] @ [2048x2048] {big / 1e9:.2f} GFLOP/s"
    )
    print(
        f"distance to the limit: the update executes at {executed / mm:.1%} of the same-size matmul rate "
        f"({mm / executed:.2f}x headroom) and {executed / big:.1%} of the large-matmul rate; counted as nominal "
        f"work it runs at {nominal / mm:.1%} of the same-size matmul rate"
    )
    print(f"posttrain_step_s={pt:.4f} trl_step_s={tr:.4f} speedup={tr / pt:.2f}")


if __name__ == "__main__":
    main()
