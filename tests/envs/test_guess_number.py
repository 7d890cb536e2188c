"""guess_number: hand-played games (posttrain/envs/guess_number.py)."""

from __future__ import annotations

import pytest

from posttrain.envs import make_env
from posttrain.tasks.base import Example

EX = Example("guess 1-16", "11", "8", {"secret": 11})


def test_binary_search_game():
    env = make_env("guess_number", {})
    assert env.max_turns == 5  # ceil(log2 16) + 1
    ep = env.start(EX)
    assert ep.reset() == [{"role": "user", "content": "guess 1-16"}]
    assert ep.state_key() == ""
    played = []
    for action in ["8", " 12\n", "10", "11"]:
        res = ep.step(action)
        played.append(([m["content"] for m in res.messages], res.reward, res.done, dict(res.info)))
    assert played == [
        (["higher"], 0.0, False, {"success": 0.0}),
        (["lower"], 0.0, False, {"success": 0.0}),
        (["higher"], 0.0, False, {"success": 0.0}),
        ([], 1.0, True, {"success": 1.0}),
    ]


@pytest.mark.parametrize("action", ["eight", "", "17", "0", "-3", "8 9", "²", "1" * 5000])
def test_unparsable_or_out_of_range_guess_ends_with_penalty(action):
    ep = make_env("guess_number", {}).start(EX)
    ep.reset()
    res = ep.step(action)
    assert (res.messages, res.reward, res.done) == ((), -0.1, True)
    assert dict(res.info) == {"success": 0.0, "format_errors": 1.0}


def test_state_key_is_the_history():
    env = make_env("guess_number", {})
    a, b, c = (env.start(EX) for _ in range(3))
    for ep in (a, b, c):
        ep.reset()
    a.step("8"), b.step("8"), c.step("4")
    assert a.state_key() == b.state_key() == "8h"
    assert c.state_key() == "4h" != a.state_key()
    a.step("12")
    assert a.state_key() == "8h,12l"


def test_expert_is_binary_search():
    env = make_env("guess_number", {})
    transcript = env.demonstration(EX, 0)
    assert [m["content"] for m in transcript] == ["guess 1-16", "8", "higher", "12", "lower", "10", "higher", "11"]
