"""json_tools through the multi-turn driver and the training loop: several calls a turn become tool results
in the context (never trained on), hostile calls cost nothing but an error result, and a tiny run trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posttrain.envs import make_env
from posttrain.envs.tool_parsers import format_calls
from posttrain.models import load_tokenizer
from posttrain.models.tiny import PRINTABLE, build_char_tokenizer
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.rollout.multiturn import Limits, pack, run_episodes
from posttrain.tasks.base import Example
from posttrain.train import rl

# A ChatML-like template whose tool role renders <tool_response> blocks (the Qwen 2.5 convention).
TEMPLATE = ("{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
            "{% elif m.role == 'assistant' %}<a>{{ m.content }}{{ eos_token }}{% else %}<{{ m.role[0] }}>"
            "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
PARALLEL = Example("12*34+56*78", "4776", "", {"operands": [12, 34, 56, 78]})  # 408 + 4368 = 4776


class ScriptedEngine:
    """Returns each round's scripted turns, row by row (as tests/rollout/test_multiturn.py's engine does)."""

    def __init__(self, tokenizer, rounds: list[list[str]]) -> None:
        self.tok, self.rounds, self.pad_id, self.version = tokenizer, list(rounds), tokenizer.pad_token_id, 0

    def generate(self, prompts, sampling, seed=None):
        rows = [self.tok(a, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                for a in self.rounds.pop(0)]
        assert len(rows) == len(prompts)
        width = max(len(r) for r in rows)
        ids, mask = torch.full((len(rows), width), self.pad_id), torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
        return Rollout.single_turn(prompts, ids, mask, -0.5 * mask, torch.ones(len(rows), dtype=torch.bool),
                                   [""] * len(rows), 1, self.version)


def test_episodes_with_several_calls_a_turn_through_the_driver():
    tok = build_char_tokenizer(PRINTABLE + "\n")
    tok.chat_template = TEMPLATE
    env = make_env("json_tools", {"form": "parallel", "announce": "brief"})

    def hermes(*calls):
        return format_calls("hermes", list(calls))

    both = hermes(("mul", {"a": 12, "b": 34}), ("mul", {"a": 56, "b": 78}))
    hostile = hermes(*[("mul", {"a": "12", "b": 34})] * 50) + "<tool_call>{oops"
    rounds = [[both, hostile], [hermes(("add", {"a": 408, "b": 4368})), "4776"], ["4776"]]
    delta = ChatDelta(tok)
    episodes = [env.start(PARALLEL) for _ in range(2)]
    first = [ep.reset() for ep in episodes]
    prompt = delta.prompt_ids(first[0])
    recs = run_episodes(ScriptedEngine(tok, rounds), delta, episodes, [prompt, prompt], first,
                        SamplingParams(max_new_tokens=4096), Limits(max_turns=4, max_tokens=8000), lambda r: r)
    good, bad = recs
    assert (good.end, good.reward, good.success, len(good.turns)) == ("done", 1.0, 1.0, 3)
    assert good.info == {"success": 1.0, "tool_calls": 3.0, **{k: 0.0 for k in good.info if k not in (
        "success", "tool_calls")}}
    assert [m["content"] for m in good.messages if m["role"] == "tool"] == ["408", "4368", "4776"]
    # the two results of turn 0 are one context delta, in order, before turn 1
    assert tok.decode(good.turns[1].context_ids) == "<tool_response>408</tool_response><tool_response>4368" \
                                                    "</tool_response><a>"
    # 50 calls with a string operand and a broken one: 4 error results, one for the rest; then a right answer
    assert (bad.end, bad.reward, bad.success) == ("done", 1.0, 1.0)
    assert bad.info["tool_calls"] == 4.0 and bad.info["tool_bad_args"] == 4.0 and bad.info["tool_too_many"] == 1.0
    assert bad.info["tool_errors"] == 5.0
    assert [m["content"] for m in bad.messages if m["role"] == "tool"][-1] == (
        "error: 47 call(s) past the limit of 4 a turn were not run")  # 50 + the unreadable one, 4 ran
    rollouts, turns = pack(recs, [prompt], 2, 4, tok.pad_token_id, 0)
    for n, rec in enumerate(recs):  # trained: exactly the sampled turns; the tool results are context
        trained = rollouts.token_ids[n][rollouts.loss_mask[n] > 0].tolist()
        assert trained == [t for turn in rec.turns for t in turn.action_ids]
    assert turns.mask[0].sum(1).tolist() == [3, 2]


def test_a_tiny_run_on_json_tools_trains_two_steps(tiny_cfg, quiet, prepare_calls):
    cfg = tiny_cfg("task.name=env", "task.params={}", "model.tiny.max_positions=128",
                   'task.env={name="json_tools", max_tokens=64, params={announce="brief", parser="any"}}',
                   "rollout.max_new_tokens=12", "rollout.prompts_per_step=4", "rollout.group_size=2", "train.steps=2",
                   "checkpoint.every=0", "eval.every=0", "eval.prompts=4", "log.samples_every=1")
    assert cfg.rollout.driver == "multi_turn"
    summary = rl.train(cfg, console=quiet)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("tools/calls", "tools/errors", "tools/timeouts", "episode/turns_mean", "episode/success",
                "episode/format_errors", "reward/task/errors"):
        assert all(key in r for r in rows), key
    assert all(r["reward/task/errors"] == 0 and r["reward/task/timeouts"] == 0 for r in rows)  # no episode lost
    tok = load_tokenizer(str(Path(cfg.out) / "base_model"))
    batch, _ = prepare_calls[-1]
    first = tok.decode(batch.rollouts.prompt_ids[0])
    assert first.startswith("<|bos|><|system|>tools: add(a,b) mul(a,b)<|user|>(")  # the tools announced
    assert 0.0 <= summary["final"]["pass@1"] <= 1.0  # held-out greedy episodes
