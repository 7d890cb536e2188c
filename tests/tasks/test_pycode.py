"""PyCodeTask: formats, splits, alphabet, sandboxed verification."""

from __future__ import annotations

import sys

import pytest

from posttrain.rewards.code import code_reward
from posttrain.tasks.base import split_of
from posttrain.tasks.pycode import PyCodeTask

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")


def test_hand_example():
    # 2(x+5): f(-2) = 2*3 = 6, f(0) = 10, f(3) = 16
    ex = PyCodeTask().make_example("a(x+b)", 2, 5)
    assert (ex.prompt, ex.answer, ex.demonstration) == ("f(x)=2(x+5)", "def f(x):return 2*(x+5)", ex.answer)
    assert ex.fields["tests"] == ["assert f(-2)==6", "assert f(0)==10", "assert f(3)==16"]
    sq = PyCodeTask().make_example("x^2+ax", 4, 1)  # x^2+4x: f(-2) = 4-8 = -4, f(0) = 0, f(3) = 9+12 = 21
    assert (sq.prompt, sq.demonstration) == ("f(x)=x^2+4x", "def f(x):return x**2+4*x")
    assert sq.fields["tests"] == ["assert f(-2)==-4", "assert f(0)==0", "assert f(3)==21"]


def test_splits_are_disjoint_and_deterministic():
    task = PyCodeTask()
    train = task.examples("train", 400, seed=0)
    test = task.examples("test", 40, seed=0)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in test})
    assert all(split_of(f"pycode:{e.prompt}") == "test" for e in test)
    assert train == task.examples("train", 400, seed=0)
    assert task.examples("train", 10, seed=0) == train[:10]
    assert task.examples("train", 50, seed=1) != train[:50]


def test_alphabet_is_exact_and_programs_are_short():
    task = PyCodeTask()
    seen = set()
    for ex in task.examples("train", 500, seed=0):
        seen.update(ex.prompt + ex.demonstration)
        assert len(ex.demonstration) < 40 and "\n" not in ex.demonstration
    assert task.alphabet == "".join(sorted(seen))
    assert PyCodeTask(max_const=3).alphabet == "".join(sorted(set(" ()*+-123:=^defnrtux")))
    with pytest.raises(ValueError, match="max_const"):
        PyCodeTask(max_const=1)


def test_demonstrations_verify():
    task = PyCodeTask()
    for ex in task.examples("train", 8, seed=0) + task.examples("test", 4, seed=0):
        assert task.verify(ex.demonstration, ex) == 1.0, ex
        assert task.extract(ex.demonstration) == ex.answer
    ex = task.make_example("ax+b", 3, 1)
    assert task.verify(f"Here you go:\n```python\n{ex.demonstration}\n```", ex) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "def f(x):return 3*x+2",  # wrong constant
        "def f(x):return 3x+1",  # math notation is not Python
        "def f(x):return 4",  # right at one point only
        "",
        "import sys;sys.exit(0)",
        "def g(x):return 3*x+1",
    ],
)
def test_wrong_programs_score_zero(completion):
    task = PyCodeTask()
    ex = task.make_example("ax+b", 3, 1)
    assert task.verify(completion, ex) == 0.0


def test_code_reward_partial_credit_on_task_fields():
    ex = PyCodeTask().make_example("a(x+b)", 2, 5)  # true values 6, 10, 16
    # 3*x+10 gives 4, 10, 19: only f(0) matches -> 1/3
    assert code_reward(ex.prompt, "def f(x):return 3*x+10", tests=ex.fields["tests"]) == pytest.approx(1 / 3)
