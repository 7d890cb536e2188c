"""An outside agent that calls tools (recipes/agents/openai_tools.py, recipes/agent_openai_tools.toml): through the
agent driver's server, the calls a completion writes come back as ``message.tool_calls``, the agent runs them and
sends the results as tool messages, and the episode it plays is the json_tools environment's own demonstration
token for token (what ``posttrain sft`` trains the policy on); the recipe trains, sync and with
``max_staleness = 1``, with the sampler's log-probs the learner recomputes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.config import ProduceSettings, load_config
from posttrain.models.tiny import build_char_tokenizer
from posttrain.produce.drivers import DRIVERS, ProduceContext, draw_prompts
from posttrain.rollout import SamplingParams
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.run.setup import build_task
from posttrain.train.rl import train
from tests.rollout.test_multiturn import LP, ScriptedEngine

pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "agent_openai_tools.toml"
AGENT = ROOT / "recipes" / "agents" / "openai_tools.py"
P, G = 2, 2


class ExpertEngine(ScriptedEngine):
    """Writes turn k of the expert's demonstration of the problem a prompt asks (found by its user turn)."""

    def __init__(self, tokenizer, demos: dict[str, list[dict]]) -> None:
        super().__init__(tokenizer, [])
        self.demos = demos

    def generate(self, prompts, sampling, seed=None):
        actions = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=False)
            problem = next(q for q in self.demos if f"<|user|>{q}<|assistant|>" in text)
            turns = [m["content"] for m in self.demos[problem] if m["role"] == "assistant"]
            actions.append(turns[text.count("<|assistant|>") - 1])
        self.rounds = [actions]
        return super().generate(prompts, sampling, seed)


def expert_batch(noise: float, agent: str = "run", context: int | None = None):
    """One generation batch of the agent driver over :class:`ExpertEngine` (a model context of ``context``
    tokens when set), and the demonstrations it plays.
    """
    cfg = load_config(RECIPE, ['out="unused"', "rollout.prompts_per_step=2", f"rollout.group_size={G}",
                               f'task.params={{digits = 2, form = "parallel", parser = "llama3_json", '
                               f'announce = "brief", noise = {noise}}}',
                               f'rollout.driver_params={{agent = "{AGENT}:{agent}", timeout_s = 60, '
                               'tool_parser = "llama3_json"}'])
    task = build_task(cfg)
    tok = build_char_tokenizer(task.alphabet)
    examples = draw_prompts(task, P, cfg.seed, 0)
    demos = {ex.prompt: task.demonstration(ex, seed=3) for ex in examples}
    engine = ExpertEngine(tok, demos)
    if context is not None:
        engine.max_positions = context
    ctx = ProduceContext(task, tok, engine, SamplingParams(n=G, max_new_tokens=112, temperature=1.0),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    batch, _ = DRIVERS.get("agent")(ctx, None, 1, 0, 0)
    return batch, tok, examples, demos


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_the_agent_plays_the_environments_demonstration_token_for_token(noise):
    # noise 1: the expert's first turn passes an operand as a string; the agent answers it with the environment's
    # error text, and the expert retries (four calls an episode instead of three)
    batch, tok, examples, demos = expert_batch(noise)
    r, m = batch.rollouts, batch.metrics
    calls = 3 + (noise == 1.0)
    assert m["agent/calls_mean"] == calls and m["agent/turns_mean"] == calls
    assert m["agent/segments_mean"] == 1.0 and m["agent/spliced"] == 0.0  # every call extended the episode
    assert batch.rewards_PGK.flatten().tolist() == [1.0] * (P * G) and m["accuracy"] == 1.0
    delta = ChatDelta(tok)
    for n in range(P * G):
        prompt, ids, mask = delta.transcript_ids(demos[examples[n // G].prompt])  # what SFT trains on
        width = int(r.attention_mask[n].sum())
        assert r.prompt_ids[n // G] + r.token_ids[n, :width].tolist() == prompt + ids
        assert r.loss_mask[n, :width].tolist() == mask
        assert r.behaviour_logprobs[n][r.loss_mask[n] > 0].tolist() == pytest.approx([LP] * int(sum(mask)))
        assert r.turn_ids[n][r.loss_mask[n] > 0].max() == calls - 1
    text = batch.scored_texts[0]
    assert '{"name": "mul", "parameters": {"a": ' in text and f"<|user|>{examples[0].answer}" in text
    if noise:
        assert "error: mul: argument 'a' must be integer, got string" in text


def test_without_tools_the_first_reply_is_the_answer():
    # no tools offered: the server parses no call, the expert's first turn of calls is the answer, and wrong
    # (its last integer is the second product's factor, two digits, not the four-digit sum)
    batch, *_ = expert_batch(0.0, agent="run_without_tools")
    assert batch.metrics["agent/calls_mean"] == 1.0 and batch.rewards_PGK.sum() == 0.0


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_recipe_trains_with_the_sampled_log_probs(staleness, tmp_path, quiet):
    cfg = load_config(RECIPE, [f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false",
                               "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0",
                               "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
                               "model.tiny.num_layers=1", f"rollout.max_staleness={staleness}"])
    assert train(cfg, console=quiet)["steps"] == 2
    rows = [json.loads(x) for x in (Path(tmp_path) / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent/calls_mean"] >= 1 and math.isfinite(r["loss"]) for r in rows)
    for r in rows[: 2 if staleness == 0 else 1]:  # sampled by the weights the learner recomputes with
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-4) and r["offpolicy/mismatch_k3"] < 1e-6


def test_a_history_that_fills_the_context_scores_zero_not_none():
    # a context that holds the first prompt and the first turn of calls, no more: the first turn's calls are read
    # and run, the next prompt does not fit; the server answers 400 context_length_exceeded and the agent scores
    # the episode 0 (a policy failure, not an agent's error)
    prompt = 2 + len("tools: add(a,b) mul(a,b)") + 1 + len("12*34+56*78") + 1  # <|bos|><|system|>..: 2+24+1+11+1 = 39
    turn = len("; ".join([json.dumps({"name": "mul", "parameters": {"a": 12, "b": 34}})] * 2)) + 1  # 49+2+49+1 = 101
    batch, *_ = expert_batch(0.0, context=prompt + turn)
    assert batch.metrics["agent/calls_mean"] == 1.0 and batch.rollouts.loss_mask.sum() == P * G * turn
    assert batch.rewards_PGK.sum() == 0.0 and not batch.failures and batch.metrics["reward/task/errors"] == 0
