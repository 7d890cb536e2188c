"""calc_tool: hand-played episodes with the calculator (posttrain/envs/calc_tool.py)."""

from __future__ import annotations

import pytest

from posttrain.envs import make_env
from posttrain.envs.calc_tool import HERMES_SYSTEM
from posttrain.envs.tools import CALCULATOR_ERRORS, PARSE_ERRORS
from posttrain.tasks.base import Example

EX = Example("37*48", "1776", "=37*48", {})
NO_TOOL = {"tool_calls": 1.0, "tool_errors": 1.0, "tool_timeouts": 0.0}


def _play(env, actions):
    ep = env.start(EX)
    first = ep.reset()
    out = []
    for action in actions:
        res = ep.step(action)
        out.append(([(m["role"], m["content"]) for m in res.messages], res.reward, res.done, dict(res.info)))
    return first, out, ep


def test_call_then_answer():
    first, out, _ = _play(make_env("calc_tool", {}), ["=37*48", "1776"])
    assert first == [{"role": "user", "content": "37*48"}]
    assert out == [
        ([("tool", "1776")], 0.0, False, {"success": 0.0, "tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}),
        ([], 1.0, True, {"success": 1.0}),
    ]


def test_answer_without_the_tool_and_wrong_answers():
    env = make_env("calc_tool", {})
    assert _play(env, ["1776"])[1] == [([], 1.0, True, {"success": 1.0})]
    assert _play(env, ["01776"])[1] == [([], 1.0, True, {"success": 1.0})]  # the same number
    assert _play(env, ["1777"])[1] == [([], 0.0, True, {"success": 0.0})]
    assert _play(env, ["=37*48", "1,776"])[1][1] == ([], 0.0, True, {"success": 0.0, "format_errors": 1.0})


@pytest.mark.parametrize(
    ("call", "reply"),
    [
        ("=37*", "error: syntax"),
        ("=2**8", "error: only integers and + - * / ( )"),
        ("=37/0", "error: division by zero"),
        ("=", PARSE_ERRORS["bad_args"]),
        ("!python print(1)", PARSE_ERRORS["unknown_tool"]),  # only the calculator here
    ],
)
def test_tool_errors_are_observations(call, reply):
    env = make_env("calc_tool", {"tool_error_penalty": 0.05})
    _, out, ep = _play(env, [call, "=37*48", "1776"])
    assert out[0] == ([("tool", reply)], -0.05, False, {"success": 0.0, **NO_TOOL})
    assert out[1][0] == [("tool", "1776")] and out[1][1] == 0.0
    assert out[2][1:3] == (1.0, True)
    assert (ep.box.calls, ep.box.errors) == (2, 1)


def test_other_results_can_be_signed_or_decimal():
    _, out, _ = _play(make_env("calc_tool", {}), ["=1-48/5"])
    assert out[0][0] == [("tool", "-8.6")]


def test_alphabet_spells_every_error():
    alphabet = set(make_env("calc_tool", {"digits": 4}).alphabet)
    for text in [*CALCULATOR_ERRORS, *PARSE_ERRORS.values(), "-8.6", "=1234*5678", "7006652"]:
        assert set(text) <= alphabet, text


def test_state_keys():
    env = make_env("calc_tool", {})
    a, b, c = (env.start(EX) for _ in range(3))
    for ep, action in zip((a, b, c), ("=37*48", "=37*48", "=37*49"), strict=True):
        ep.reset()
        assert ep.state_key() == "37*48"
        ep.step(action)
    assert a.state_key() == b.state_key() == "37*48|=37*48>1776"
    assert c.state_key() == "37*48|=37*49>1813"


def test_hermes_syntax():
    env = make_env("calc_tool", {"syntax": "hermes"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
    first, out, _ = _play(env, [call, "1776"])
    assert first == [{"role": "system", "content": HERMES_SYSTEM}, {"role": "user", "content": "37*48"}]
    assert out[0][0] == [("tool", "1776")] and out[1][1:3] == (1.0, True)
    # the compact form is not a call in hermes syntax: it is a malformed final answer
    assert _play(env, ["=37*48"])[1] == [([], 0.0, True, {"success": 0.0, "format_errors": 1.0})]
    _, out, _ = _play(env, ["<tool_call>{oops</tool_call>"])
    assert out[0][0] == [("tool", "error: invalid json")] and out[0][3]["tool_errors"] == 1.0


def test_expert_transcripts():
    env = make_env("calc_tool", {})
    assert [m["content"] for m in env.demonstration(EX, 0)] == ["37*48", "=37*48", "1776", "1776"]
    noisy = make_env("calc_tool", {"noise": 1.0}).demonstration(EX, 0)
    contents = [m["content"] for m in noisy]
    assert len(contents) == 6 and contents[1] != "=37*48" and contents[3:] == ["=37*48", "1776", "1776"]
    a, b = contents[1][1:].split("*")
    assert contents[2] == str(int(a) * int(b))  # the typo's product: the tool told the truth


def test_without_the_tool_a_call_is_an_error_and_the_expert_answers_at_once():
    env = make_env("calc_tool", {"tool": False})
    first, out, _ = _play(env, ["=37*48", "1776"])
    assert first == [{"role": "user", "content": "37*48"}]
    assert out == [([("tool", "error: no calculator")], 0.0, False, {"success": 0.0, **NO_TOOL}),
                   ([], 1.0, True, {"success": 1.0})]
    assert env.demonstration(EX, seed=0) == [{"role": "user", "content": "37*48"},
                                             {"role": "assistant", "content": "1776"}]
    assert set("error: no calculator") <= set(env.alphabet)
    hermes = make_env("calc_tool", {"tool": False, "syntax": "hermes"})
    assert hermes.start(EX).reset() == [{"role": "user", "content": "37*48"}]  # no tool announced
