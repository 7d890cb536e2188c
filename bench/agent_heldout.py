r"""Benchmark: an agent that runs outside posttrain, trained by the ``agent`` driver, and its held-out reward
before and after (not a test).

Setting: ``recipes/agent_openai.toml`` (the tiny model of ``tiny.toml``, its 2-digit reversed-addition task;
``recipes/agents/openai_arith.py``, written with the ``openai`` package, makes two chat calls an episode, the
second with the draft answer in its history, and returns the share of the answer's characters right in place).
A random tiny model earns almost nothing, so the policy first gets ``--sft-steps`` of ``posttrain sft`` on the
task's demonstrations (one call, no second turn); then ``--steps`` of agent RL from that checkpoint, once
synchronously and once with ``rollout.max_staleness = 1``. Held-out: the same agent, through the same driver,
on ``--prompts`` prompts of the task's *test* split x 4 episodes, sampled at the run's temperature, against
the SFT checkpoint and each RL run's last checkpoint. Also printed: each run's sampler-vs-learner gap
(``offpolicy/mismatch_k3``, first step and largest: the synchronous run's stays at float noise, the
asynchronous run's first step too, its later ones measure the one-step lag) and the most segments an episode
had (a step's mean; 1: every second call extended the first).

    python bench/agent_heldout.py              # SFT 200 steps, RL 60 steps each, 128 held-out prompts x 4
    python bench/agent_heldout.py --seed 1
    python bench/agent_heldout.py --smoke      # SFT 5 steps, RL 2 steps, 32 prompts x 4

Last line: ``sft_reward=A sync_reward=B async_reward=C episodes=N`` (mean held-out rewards).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from common import machine_line
from rich.console import Console

from posttrain.api import load_config, sft, train
from posttrain.config import ProduceSettings
from posttrain.models.load import load_model, load_tokenizer
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.rollout import SamplingParams, make_engine
from posttrain.run.setup import build_task, run_dir_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "agent_openai.toml"
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false"]


class HeldOut:
    """The task with its test split in place of its training split: what the driver draws is held out."""

    def __init__(self, task: object) -> None:
        self.task = task

    def examples(self, split: str, n: int, seed: int) -> list:
        return self.task.examples("test", n, seed)

    def __getattr__(self, name: str) -> object:
        return getattr(self.task, name)


def heldout(path: str, prompts: int, seed: int) -> float:
    """The agent's mean reward on ``prompts`` test prompts x 4 episodes against the model at ``path``."""
    cfg = load_config(RECIPE, [f"rollout.prompts_per_step={prompts}", "rollout.group_size=4", f"seed={seed}"])
    tok = load_tokenizer(path)
    engine = make_engine("hf", load_model(path).eval(), tok)
    r = cfg.rollout
    ctx = ProduceContext(HeldOut(build_task(cfg)), tok, engine,
                         SamplingParams(n=4, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    batch, _ = DRIVERS.get("agent")(ctx, None, 10**6, 0, 0)
    return batch.metrics["reward/task/mean"]


def rl(start: str, out: Path, steps: int, staleness: int, seed: int) -> tuple[str, float, float, float]:
    """Agent RL from ``start``; its last checkpoint, its first step's and largest ``offpolicy/mismatch_k3``, and
    the most segments an episode had (a step's mean).
    """
    train(RECIPE, overrides=[f'out="{out}"', f'model.path="{start}"', f"train.steps={steps}",
                             f"checkpoint.every={steps}", f"rollout.max_staleness={staleness}", f"seed={seed}",
                             "eval.every=0", *QUIET], console=Console(quiet=True))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return (run_dir_model(str(out)), rows[0]["offpolicy/mismatch_k3"], max(r["offpolicy/mismatch_k3"] for r in rows),
            max(r["agent/segments_mean"] for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="SFT 5 steps, RL 2 steps, 32 held-out prompts")
    a = ap.parse_args()
    if a.smoke:
        a.sft_steps, a.steps, a.prompts = 5, 2, 32
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft(RECIPE, overrides=[f'out="{root / "sft"}"', f"sft.steps={a.sft_steps}",
                               f"sft.eval_every={max(1, a.sft_steps)}", f"seed={a.seed}", *QUIET],
            console=Console(quiet=True))
        start = run_dir_model(str(root / "sft"))
        rewards = {"sft": heldout(start, a.prompts, a.seed)}
        for name, staleness in (("sync", 0), ("async", 1)):
            ckpt, first, k3, segs = rl(start, root / name, a.steps, staleness, a.seed)
            rewards[name] = heldout(ckpt, a.prompts, a.seed)
            print(f"{name:5s} (max_staleness={staleness}): held-out reward {rewards['sft']:.3f} -> {rewards[name]:.3f}"
                  f"  offpolicy/mismatch_k3 step 1 {first:.1e}, max {k3:.1e}  segments an episode <= {segs:.2f}")
    print(f"sft_reward={rewards['sft']:.4f} sync_reward={rewards['sync']:.4f} async_reward={rewards['async']:.4f} "
          f"episodes={a.prompts * 4}")


if __name__ == "__main__":
    main()
