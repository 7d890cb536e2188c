"""GRPO steps of posttrain and TRL side by side, in lockstep (shared by grpo_step.py and real_step.py).

Each side runs in its own process, through its public API only:

- posttrain: ``posttrain.config.load_config(None, overrides)`` with dotted overrides (printed, so a
  run can be repeated with ``posttrain train``), ``posttrain.train.rl.train(cfg)``, and the run
  directory's ``metrics.jsonl`` for its own phase timings. The benchmark reward is registered with
  ``posttrain.rewards.register`` as a *batched* reward (``fn.batched = True``, as
  ``reward_model`` is): posttrain calls it once per step, in the trainer's process, with the whole
  batch; ``scoring.workers = 0`` scores the task's verifier (the ``accuracy`` metric) in process too.
- TRL: ``GRPOTrainer`` with a reward function and a ``TrainerCallback``.

The lockstep point is the reward call, the one place both loops hand control to user code once
per step: there a side reports ``done`` to the parent and blocks until the parent says ``go``
(:class:`Baton`). After step 1 of both sides the parent lets them run one step at a time,
alternately, so their steps never overlap and a change of background load hits both alike. A
side's step time runs from its ``go`` at one reward call to its ``done`` at the next: one full
cycle of the loop (the rest of scoring, advantages, the update, logging, the next prompts and
their generation). ``N`` steps give ``N - 1`` such cycles; the first ``warmup`` are discarded.

TRL's cycle is split by its ``on_step_end`` callback: reward call -> step end is its update,
step end -> next reward call its generation. posttrain's phases come from its ``time/generate_s``
and ``time/update_s`` metrics.

Peak memory: each side reports its process's peak resident set (``VmHWM``) over its whole life
and since its first reward call (the peak is reset there through ``/proc/self/clear_refs`` where
Linux allows it), which leaves out model loading and conversion.

Run as a script only by the parent (``--side``): it is the child's entry point.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REWARD_NAME = "bench_digit_fraction"
INSTALL_TRL = "pip install -c .ci/constraints.txt -e '.[bench]'  (the torch pin keeps the CPU wheel)"


@dataclass
class Setting:
    """One benchmark setting, the same on both sides (written to JSON for the side processes)."""

    model: str  # posttrain's model.path (a directory or an alias)
    model_dir: str  # a Hugging Face directory of the same model: TRL's model and both sides' tokenizer
    task: str  # a posttrain task: posttrain draws from it, TRL's dataset is made from its examples()
    task_params: dict = field(default_factory=dict)
    system_prompt: str | None = None
    prompts: int = 8
    group: int = 8
    new_tokens: int = 32
    bf16: bool = False  # mixed precision on both sides: TRL bf16 = True, posttrain model.autocast = "bfloat16"
    steps: int = 10
    lr: float = 1e-4
    suppress_eos: bool = True
    threads: int = 0
    seed: int = 0
    micro_batch_tokens: int = 0  # posttrain's train.micro_batch_tokens (0: each minibatch in one pass)
    lora_rank: int = 16  # model.lora.rank of the posttrain_lora side (posttrain with LoRA adapters)


def digit_fraction(text: str) -> float:
    """The benchmark reward: share of digit characters in a completion (0 for an empty one).
    Cheap and deterministic, and it spreads within a group, so advantages are non-zero.
    """
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def lockstep_sides(no_trl: bool) -> list[str]:
    """``["posttrain", "trl"]``, or posttrain alone with ``--no-trl`` or where trl is not installed (said)."""
    if no_trl:
        return ["posttrain"]
    if not trl_available():
        print(f"trl is not installed: the TRL side is skipped ({INSTALL_TRL})")
        return ["posttrain"]
    return ["posttrain", "trl"]


# ------------------------------------------------------------------------------------------------
# peak memory of this process
# ------------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (``VmHWM``; ``getrusage`` where there is no /proc)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)\s+kB", status).group(1)) / 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current resident set (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# child side: the baton
# ------------------------------------------------------------------------------------------------


class Baton:
    """A side's end of the lockstep: :meth:`step_done` at each reward call reports to the parent and
    blocks until it says go. Cycle ``i`` runs from the go of call ``i`` to the done of call ``i + 1``.
    """

    def __init__(self, go_fd: int, done_fd: int) -> None:
        self.go_fd, self.done_fd = go_fd, done_fd
        self.done_t: list[float] = []
        self.go_t: list[float] = []
        self.peak_reset: bool | None = None

    def step_done(self) -> None:
        self.done_t.append(time.perf_counter())
        if self.peak_reset is None:  # from here on the peak covers training only (not model loading)
            self.peak_reset = reset_peak_rss()
        os.write(self.done_fd, b"d")
        if os.read(self.go_fd, 1) != b"g":
            raise SystemExit("the benchmark's parent process went away")
        self.go_t.append(time.perf_counter())

    def cycles(self) -> list[float]:
        return [done - go for go, done in zip(self.go_t, self.done_t[1:], strict=False)]

    def memory(self) -> dict:
        return {"peak_rss_mb": peak_rss_mb(), "peak_rss_steps_mb": peak_rss_mb() if self.peak_reset else None}


# ------------------------------------------------------------------------------------------------
# posttrain side
# ------------------------------------------------------------------------------------------------


def toml_value(v: object) -> str:
    """A Python value as a TOML value for a dotted override (inline tables for dicts)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def posttrain_overrides(s: Setting, out: str, lora: bool = False, checkpointing: bool = False) -> list[str]:
    """The run as ``posttrain train`` dotted overrides of the default config (``lora``: with
    ``model.lora.rank = s.lora_rank`` on ``[model.lora]``'s default targets, every linear of the blocks;
    ``checkpointing``: with ``train.gradient_checkpointing = true``).
    """
    o = {
        "seed": s.seed,
        "out": out,
        "model.path": s.model,
        "model.dtype": "float32",
        "model.autocast": "bfloat16" if s.bf16 else "off",
        "task.name": s.task,
        "task.params": s.task_params,
        "rollout.group_size": s.group,
        "rollout.prompts_per_step": s.prompts,
        "rollout.max_new_tokens": s.new_tokens,
        "rollout.min_new_tokens": s.new_tokens if s.suppress_eos else 0,  # EOS masked until then
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": 0,
        "algorithm.advantage": "grpo",
        "algorithm.loss": "ppo_clip",
        "algorithm.aggregation": "token_mean",
        "algorithm.kl_coef": 0.0,  # no reference model
        "train.steps": s.steps,
        "train.lr": s.lr,
        "train.warmup_steps": 0,
        "train.schedule": "constant",
        "train.grad_clip": 1.0,
        "train.epochs": 1,
        "train.minibatches": 1,
        "train.micro_batch_tokens": s.micro_batch_tokens,
        "reward": [{"name": REWARD_NAME, "weight": 1.0}],
        "scoring.workers": 0,
        "eval.every": 0,
        "eval.prompts": 1,
        "diagnostics.every": 0,
        "checkpoint.every": 0,
        "checkpoint.keep": 1,
        "log.tensorboard": False,
        "log.progress": False,
        "log.samples": 0,
        "log.plot_groups": False,
        "log.prompt_stats": False,
    }
    if s.system_prompt is not None:
        o["task.system_prompt"] = s.system_prompt
    if lora:
        o["model.lora.rank"] = s.lora_rank
    if checkpointing:
        o["train.gradient_checkpointing"] = True
    return [f"{k}={toml_value(v)}" for k, v in o.items()]


def run_posttrain(s: Setting, work: Path, baton: Baton, lora: bool = False, checkpointing: bool = False) -> dict:
    from rich.console import Console

    from posttrain.config import load_config
    from posttrain.models import encode_chat, load_tokenizer
    from posttrain.rewards import is_batched, register
    from posttrain.train.rl import train

    seen: dict[str, list] = {"prompts": []}

    def bench_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        """Digit fraction of each completion (batched: one call per step, the lockstep point)."""
        baton.step_done()
        seen["prompts"] += prompts[:: s.group]  # rows are prompt-major: one text per group
        return [digit_fraction(c) for c in completions]

    bench_reward.batched = True  # type: ignore[attr-defined]
    register(REWARD_NAME)(bench_reward)
    if not is_batched(REWARD_NAME):
        raise SystemExit("posttrain.rewards no longer runs `fn.batched = True` rewards batched: update lockstep.py")
    side = "posttrain_lora" if lora else "posttrain_ckpt" if checkpointing else "posttrain"
    run = work / f"{side}_run"
    overrides = posttrain_overrides(s, str(run), lora, checkpointing)
    print("posttrain train " + " ".join(f"'{o}'" for o in overrides), flush=True)
    cfg = load_config(None, overrides)
    train(cfg, console=Console(file=sys.stdout, width=120))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokenizer = load_tokenizer(s.model_dir)

    def col(key: str) -> list[float]:
        missing = [r["step"] for r in rows if key not in r]
        if missing:
            raise SystemExit(f"posttrain's metrics.jsonl has no {key!r} at steps {missing}; keys: {sorted(rows[0])}")
        return [float(r[key]) for r in rows]

    return {
        "side": side,
        "step_s": baton.cycles(),
        # cycle i = the update of step i + the generation of step i + 1 (its own timings)
        "update_s": col("time/update_s")[:-1],
        "generate_s": col("time/generate_s")[1:],
        "completion_len_mean": col("response/length_mean"),
        "reward_std": col("reward/std"),
        "optimizer_steps": col("train/optimizer_steps"),
        "prompt_tokens": [len(encode_chat(tokenizer, p, s.system_prompt)) for p in seen["prompts"]],
        "reward_calls": len(baton.done_t),
        **baton.memory(),
    }


# ------------------------------------------------------------------------------------------------
# TRL side
# ------------------------------------------------------------------------------------------------


def trl_dataset_texts(s: Setting) -> list[str]:
    """TRL's prompts: the same task's ``examples`` (public API), one per prompt of every step."""
    from posttrain.tasks import make_task

    return [ex.prompt for ex in make_task(s.task, **s.task_params).examples("train", s.prompts * s.steps, seed=1)]


def run_trl(s: Setting, work: Path, baton: Baton) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.models import load_tokenizer

    tokenizer = load_tokenizer(s.model_dir)
    model = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32)
    system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt is not None else []
    rows = [{"prompt": [*system, {"role": "user", "content": t}]} for t in trl_dataset_texts(s)]
    dataset = Dataset.from_list(rows)
    # the prompt tokens TRL feeds: its own chat-template call (as GRPOTrainer tokenizes prompts)
    prompt_tokens = [
        len(ids)
        for ids in tokenizer.apply_chat_template(
            [r["prompt"] for r in rows], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    ]
    gen_eos = model.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
    seen: dict[str, list] = {"len": [], "eos": [], "reward_std": []}
    step_end: list[float] = []

    def digit_reward(prompts: list, completions: list, completion_ids: list, **_: object) -> list[float]:
        baton.step_done()
        rewards = [digit_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]
        seen["len"].append(sum(len(ids) for ids in completion_ids) / len(completion_ids))
        seen["eos"].append(sum(any(t in eos_ids for t in ids) for ids in completion_ids))
        seen["reward_std"].append(float(torch.tensor(rewards).std()))
        return rewards

    class Clock(TrainerCallback):
        def on_step_end(self, args: object, state: object, control: object, **kw: object) -> None:
            step_end.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(work / "trl_run"),
        per_device_train_batch_size=s.prompts * s.group,
        gradient_accumulation_steps=1,
        num_generations=s.group,
        num_iterations=1,
        max_completion_length=s.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no reference model
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=s.steps,
        bf16=s.bf16,
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=True,
        generation_kwargs={"suppress_tokens": eos_ids} if s.suppress_eos else None,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=s.seed,
    )
    if config.steps_per_generation != 1 or config.generation_batch_size != s.prompts * s.group:
        raise SystemExit(
            f"TRL {trl.__version__}: steps_per_generation={config.steps_per_generation}, generation_batch_size="
            f"{config.generation_batch_size}: not one generation of {s.prompts} x {s.group} per optimizer step"
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    go, done = baton.go_t, baton.done_t
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "step_s": baton.cycles(),
        # cycle i = reward call i -> end of step i (the rest of scoring, loss, backward, optimizer) ...
        "update_s": [end - g for g, end in zip(go, step_end[: len(done) - 1], strict=False)],
        # ... + end of step i -> reward call i + 1 (the next prompts and their generation)
        "generate_s": [d - end for end, d in zip(step_end, done[1:], strict=False)],
        "completion_len_mean": seen["len"],
        "eos_completions": seen["eos"],
        "reward_std": seen["reward_std"],
        "optimizer_steps": [trainer.state.global_step / max(len(seen["len"]), 1)] * trainer.state.global_step,
        "prompt_tokens": prompt_tokens,
        "reward_calls": len(done),
        "optim": str(config.optim),
        **baton.memory(),
    }


# ------------------------------------------------------------------------------------------------
# parent side
# ------------------------------------------------------------------------------------------------


class Side:
    """A side's subprocess and its two pipes (see :class:`Baton`)."""

    def __init__(self, name: str, setting_path: Path, work: Path, verbose: bool) -> None:
        self.name, self.result_path = name, work / f"{name}.json"
        self.log_path = work / f"{name}.log"
        go_r, self.go_w = os.pipe()
        self.done_r, done_w = os.pipe()
        cmd = [
            sys.executable,
            __file__,
            "--side", name,
            "--setting", str(setting_path),
            "--work-dir", str(work / name),
            "--result", str(self.result_path),
            "--go-fd", str(go_r),
            "--done-fd", str(done_w),
        ]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
        log = None if verbose else self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT if log else None, env=env, pass_fds=(go_r, done_w)
        )
        os.close(go_r)
        os.close(done_w)

    def wait_done(self) -> None:
        if os.read(self.done_r, 1) != b"d":
            self.fail()

    def go(self) -> None:
        try:
            os.write(self.go_w, b"g")
        except BrokenPipeError:  # the side has died
            self.fail()

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
        why = " (killed: out of memory? try --one-at-a-time)" if self.proc.returncode == -9 else ""
        raise SystemExit(f"the {self.name} run failed (exit {self.proc.returncode}){why}")


def run_lockstep(
    s: Setting, work: Path, sides: list[str], verbose: bool = False, one_at_a_time: bool = False
) -> dict[str, dict]:
    """Start the sides; after step 1 of each, run their steps one at a time, alternately.

    ``one_at_a_time``: run each side's whole run before the next side starts (for a machine whose
    memory does not hold both processes at once; background load then no longer hits both alike).
    """
    if one_at_a_time and len(sides) > 1:
        return {name: run_lockstep(s, work, [name], verbose)[name] for name in sides}
    setting_path = work / "setting.json"
    setting_path.write_text(json.dumps(asdict(s)))
    print(f"running {' and '.join(sides)} in lockstep ({s.steps} steps each) ...", flush=True)
    t0 = time.perf_counter()
    procs = [Side(name, setting_path, work, verbose) for name in sides]
    try:
        for side in procs:  # step 1 (set-up and step 1 of the sides may overlap: it is not measured)
            side.wait_done()
        t1 = time.perf_counter()
        for step in range(2, s.steps + 1):
            for side in procs if step % 2 else procs[::-1]:  # alternate which side goes first
                side.go()
                side.wait_done()
        t2 = time.perf_counter()
        results = {side.name: side.finish() for side in procs}
        print(
            f"set-up and step 1 {t1 - t0:.1f} s, steps 2..{s.steps} {t2 - t1:.1f} s, "
            f"the rest (final checkpoint, evaluation, exit) {time.perf_counter() - t2:.1f} s",
            flush=True,
        )
        return results
    finally:
        for side in procs:
            if side.proc.poll() is None:
                side.proc.kill()
                side.proc.wait()


def _die_with_parent() -> None:
    """On Linux, have this side SIGKILLed when the parent benchmark dies (Ctrl-C, kill), so no side
    is left running to skew the next measurement.
    """
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


SIDES = {
    "posttrain": run_posttrain,
    "posttrain_lora": lambda s, work, baton: run_posttrain(s, work, baton, lora=True),
    "posttrain_ckpt": lambda s, work, baton: run_posttrain(s, work, baton, checkpointing=True),
    "trl": run_trl,
}


def side_main() -> None:
    ap = argparse.ArgumentParser(description="one side of a lockstep benchmark (started by the parent)")
    ap.add_argument("--side", choices=list(SIDES), required=True)
    ap.add_argument("--setting", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    ap.add_argument("--go-fd", type=int, required=True)
    ap.add_argument("--done-fd", type=int, required=True)
    args = ap.parse_args()
    _die_with_parent()
    import torch

    s = Setting(**json.loads(args.setting.read_text()))
    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = SIDES[args.side](s, args.work_dir, Baton(args.go_fd, args.done_fd))
    args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    side_main()
