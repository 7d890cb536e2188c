"""retry_arith: hand-played episodes (posttrain/envs/retry_arith.py)."""

from __future__ import annotations

import pytest

from posttrain.envs import make_env


def _example(env, a=12, op="+", b=34):
    return env.task.make_example(a, op, b)


def test_wrong_then_right():
    env = make_env("retry_arith", {})
    ex = _example(env)  # 12+34 = 46, written reversed: prompt "21+43=", answer "64"
    assert (ex.prompt, ex.answer, ex.demonstration) == ("21+43=", "64", "64")
    ep = env.start(ex)
    assert ep.reset() == [{"role": "user", "content": "21+43="}]
    assert ep.state_key() == "21+43=|"
    res = ep.step("65")
    assert (res.messages, res.reward, res.done, dict(res.info)) == (
        ({"role": "user", "content": "no"},), 0.0, False, {"success": 0.0})
    assert ep.state_key() == "21+43=|65"
    res = ep.step(" 64 ")
    assert (res.messages, res.reward, res.done, dict(res.info)) == ((), 1.0, True, {"success": 1.0})


def test_turn_discount():
    env = make_env("retry_arith", {"turn_discount": 0.5})
    ep = env.start(_example(env))
    ep.reset()
    assert [ep.step(a).reward for a in ["1", "2", "64"]] == [0.0, 0.0, 0.25]  # 0.5 ** 2 on the third turn


@pytest.mark.parametrize("action", ["", "6 4", "-64", "64.", "sixty", "٦٤"])
def test_unparsable_answer_ends_the_episode(action):
    env = make_env("retry_arith", {})
    ep = env.start(_example(env))
    ep.reset()
    res = ep.step(action)
    assert (res.messages, res.reward, res.done) == ((), 0.0, True)
    assert dict(res.info) == {"success": 0.0, "format_errors": 1.0}


def test_multiplication_and_plain_order():
    env = make_env("retry_arith", {"ops": "*", "reverse": False})
    ex = _example(env, 12, "*", 34)
    assert (ex.prompt, ex.answer) == ("12*34=", "408")
    ep = env.start(ex)
    ep.reset()
    assert ep.step("804").messages[0]["content"] == "no"
    assert ep.step("408").info["success"] == 1.0


def test_state_keys_of_a_group():
    env = make_env("retry_arith", {})
    a, b, c = (env.start(_example(env)) for _ in range(3))
    for ep, action in zip((a, b, c), ("1", "1", "2"), strict=True):
        ep.reset()
        ep.step(action)
    assert a.state_key() == b.state_key() == "21+43=|1" != c.state_key()


def test_noisy_expert_retries_with_new_wrong_answers():
    env = make_env("retry_arith", {"noise": 1.0})
    transcript = env.demonstration(_example(env), 0)
    attempts = [m["content"] for m in transcript if m["role"] == "assistant"]
    assert len(attempts) == 3 and len(set(attempts)) == 3 and "64" not in attempts
    assert [m["content"] for m in transcript if m["role"] == "user"] == ["21+43=", "no", "no"]
