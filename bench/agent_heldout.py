r"""Benchmark: an agent that runs outside posttrain, trained by the ``agent`` driver, and its held-out reward
before and after (not a test).

Setting (``--recipe``, default ``recipes/agent_openai.toml``): the tiny model of ``tiny.toml``, its 2-digit
reversed-addition task; ``recipes/agents/openai_arith.py``, written with the ``openai`` package, makes two chat
calls an episode, the second with the draft answer in its history, and returns the share of the answer's
characters right in place. With ``--recipe recipes/agent_openai_tools.toml``: ``recipes/agents/openai_tools.py``
offers ``mul`` and ``add`` as tools on json_tools' ``a*b+c*d`` problems, runs the calls the server parses and
returns 1 for the exact answer.
A random tiny model earns almost nothing, so the policy first gets ``--sft-steps`` of ``posttrain sft`` on the
task's demonstrations (the arithmetic task: one call, no second turn; the tools task: the environment's expert
transcripts, which the tool agent's conversation reproduces token for token); then ``--steps`` of agent RL from
that checkpoint, once synchronously and once with ``rollout.max_staleness = 1``. Held-out: the same agent,
through the same driver, on ``--prompts`` prompts of the task's *test* split x 4 episodes, sampled at the run's
temperature, against the SFT checkpoint and each RL run's last checkpoint; an agent file that also defines
``run_without_tools`` (the tools agent) is measured on the SFT checkpoint that way too (no tools offered).
Also printed: each run's sampler-vs-learner gap (``offpolicy/mismatch_k3``, first step and largest: the
synchronous run's stays at float noise, the asynchronous run's first step too, its later ones measure the
one-step lag), the most segments an episode had (a step's mean; 1: every call extended the one before), and
per held-out episode the chat calls, the tool calls written (read back with the recipe's ``tool_parser``, when
it sets one) and the segments.

    python bench/agent_heldout.py              # SFT 200 steps, RL 60 steps each, 128 held-out prompts x 4
    python bench/agent_heldout.py --seed 1
    python bench/agent_heldout.py --recipe recipes/agent_openai_tools.toml   # the recipe's SFT 500, RL 30 steps
    python bench/agent_heldout.py --smoke      # SFT 5 steps, RL 2 steps, 32 prompts x 4

Last line: ``sft_reward=A sync_reward=B async_reward=C episodes=N`` (mean held-out rewards), with
``no_tools_reward=D`` in front of ``episodes`` when the agent has ``run_without_tools``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from common import machine_line
from rich.console import Console

from posttrain.api import load_config, sft, train
from posttrain.config import ProduceSettings
from posttrain.envs.tool_parsers import parse_calls
from posttrain.models.load import load_model, load_tokenizer
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.produce.drivers.agent import load_agent
from posttrain.rollout import SamplingParams, make_engine
from posttrain.run.setup import build_task, run_dir_model

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPE = RECIPES / "agent_openai.toml"
STEPS = {RECIPE: (200, 60)}  # the documented run; other recipes: their own sft.steps and train.steps
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false"]
WITHOUT_TOOLS = "run_without_tools"


class HeldOut:
    """The task with its test split in place of its training split: what the driver draws is held out."""

    def __init__(self, task: object) -> None:
        self.task = task

    def examples(self, split: str, n: int, seed: int) -> list:
        return self.task.examples("test", n, seed)

    def __getattr__(self, name: str) -> object:
        return getattr(self.task, name)


def tool_calls(batch: object, tokenizer: object, parser: str) -> float:
    """Tool calls written per episode: every trained turn of every row decoded and read with ``parser``."""
    r, total = batch.rollouts, 0
    for n in range(r.token_ids.shape[0]):
        trained = r.loss_mask[n] > 0
        for k in r.turn_ids[n][trained].unique().tolist():
            ids = r.token_ids[n][trained & (r.turn_ids[n] == k)].tolist()
            total += len(parse_calls(parser, tokenizer.decode(ids, skip_special_tokens=True)).calls)
    return total / max(r.token_ids.shape[0], 1)


def heldout(recipe: Path, path: str, prompts: int, seed: int, agent: str | None = None) -> dict[str, float]:
    """The agent's mean reward on ``prompts`` test prompts x 4 episodes against the model at ``path`` (``agent``:
    another function of the recipe's agent file), and per episode its chat calls, tool calls (NaN when the recipe
    sets no ``driver_params.tool_parser``: no tools) and segments.
    """
    cfg = load_config(recipe, [f"rollout.prompts_per_step={prompts}", "rollout.group_size=4", f"seed={seed}"])
    r = cfg.rollout
    if agent is not None:
        r.driver_params = {**r.driver_params, "agent": r.params().agent.rpartition(":")[0] + ":" + agent}
    r.driver_params = {**r.driver_params, "timeout_s": 3600.0}  # a measurement, not cut short by a busy machine
    tok = load_tokenizer(path)
    engine = make_engine("hf", load_model(path).eval(), tok)
    ctx = ProduceContext(HeldOut(build_task(cfg)), tok, engine,
                         SamplingParams(n=4, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    batch, _ = DRIVERS.get("agent")(ctx, None, 10**6, 0, 0)
    m = batch.metrics
    return {"reward": m["reward/task/mean"], "calls": m["agent/calls_mean"], "segments": m["agent/segments_mean"],
            "tool_calls": tool_calls(batch, tok, parser) if (parser := r.params().tool_parser) else float("nan"),
            "failed": m["reward/task/errors"] + m["reward/task/timeouts"]}


def rl(recipe: Path, start: str, out: Path, steps: int, staleness: int, seed: int) -> tuple[str, float, float, float]:
    """Agent RL from ``start``; its last checkpoint, its first step's and largest ``offpolicy/mismatch_k3``, and
    the most segments an episode had (a step's mean).
    """
    train(recipe, overrides=[f'out="{out}"', f'model.path="{start}"', f"train.steps={steps}",
                             f"checkpoint.every={steps}", f"rollout.max_staleness={staleness}", f"seed={seed}",
                             "eval.every=0", *QUIET], console=Console(quiet=True))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return (run_dir_model(str(out)), rows[0]["offpolicy/mismatch_k3"], max(r["offpolicy/mismatch_k3"] for r in rows),
            max(r["agent/segments_mean"] for r in rows))


def has_no_tools_variant(recipe: Path) -> bool:
    """Whether the recipe's agent file also defines :data:`WITHOUT_TOOLS`."""
    spec = load_config(recipe, []).rollout.params().agent
    try:
        load_agent(spec.rpartition(":")[0] + ":" + WITHOUT_TOOLS)
    except ValueError:
        return False
    return True


def line(name: str, h: dict[str, float]) -> str:
    tools = "" if math.isnan(h["tool_calls"]) else f"{h['tool_calls']:.2f} tool calls, "
    return (f"  held-out {name}: reward {h['reward']:.3f}, per episode {h['calls']:.2f} chat calls, {tools}"
            f"{h['segments']:.2f} segments ({h['failed']:.0f} agents failed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=RECIPE)
    ap.add_argument("--sft-steps", type=int, default=None, help="default: 200 for agent_openai.toml, else the "
                    "recipe's sft.steps")
    ap.add_argument("--steps", type=int, default=None, help="default: 60 for agent_openai.toml, else the recipe's "
                    "train.steps")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="SFT 5 steps, RL 2 steps, 32 held-out prompts")
    a = ap.parse_args()
    recipe = a.recipe.resolve()
    cfg = load_config(recipe, [])
    sft_steps, steps = STEPS.get(recipe, (cfg.sft.steps, cfg.train.steps))
    a.sft_steps, a.steps = a.sft_steps or sft_steps, a.steps or steps
    if a.smoke:
        a.sft_steps, a.steps, a.prompts = 5, 2, 32
    print(machine_line())
    t0 = time.perf_counter()
    print(f"{recipe.name}: SFT {a.sft_steps} steps, agent RL {a.steps} steps, {a.prompts} held-out prompts x 4, "
          f"seed {a.seed}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft(recipe, overrides=[f'out="{root / "sft"}"', f"sft.steps={a.sft_steps}",
                               f"sft.eval_every={max(1, a.sft_steps)}", f"seed={a.seed}", *QUIET],
            console=Console(quiet=True))
        start = run_dir_model(str(root / "sft"))
        held = {"sft": heldout(recipe, start, a.prompts, a.seed)}
        print(line("after SFT", held["sft"]))
        if has_no_tools_variant(recipe):
            held["no_tools"] = heldout(recipe, start, a.prompts, a.seed, agent=WITHOUT_TOOLS)
            print(line("after SFT, no tools offered", held["no_tools"]))
        for name, staleness in (("sync", 0), ("async", 1)):
            ckpt, first, k3, segs = rl(recipe, start, root / name, a.steps, staleness, a.seed)
            held[name] = heldout(recipe, ckpt, a.prompts, a.seed)
            print(f"{name:5s} (max_staleness={staleness}): held-out reward {held['sft']['reward']:.3f} -> "
                  f"{held[name]['reward']:.3f}  offpolicy/mismatch_k3 step 1 {first:.1e}, max {k3:.1e}  "
                  f"segments an episode <= {segs:.2f}")
            print(line(f"after {name} RL", held[name]))
    print(f"wall {(time.perf_counter() - t0) / 60:.1f} min")
    extra = f"no_tools_reward={held['no_tools']['reward']:.4f} " if "no_tools" in held else ""
    print(f"sft_reward={held['sft']['reward']:.4f} sync_reward={held['sync']['reward']:.4f} "
          f"async_reward={held['async']['reward']:.4f} {extra}episodes={a.prompts * 4}")


if __name__ == "__main__":
    main()
