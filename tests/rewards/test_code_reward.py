"""The ``code`` reward: program extraction, assert and stdin/stdout tests, partial credit."""

from __future__ import annotations

import sys

import pytest

import posttrain.sandbox.programs as code_module
from posttrain.rewards.code import code_reward, extract_program, normalize_output
from posttrain.rewards.registry import REGISTRY

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

DOUBLE = "def f(x):\n    return x * 2\n"


# --- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("x = 1", "x = 1"),  # no fence: the whole text
        ("Here:\n```python\nx = 1\n```\nDone.", "x = 1\n"),
        ("```py\nx = 1\n```", "x = 1\n"),
        ("```Python3\nx = 1\n```", "x = 1\n"),
        # the last python block wins over earlier drafts ...
        ("```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```", "x = 2\n"),
        # ... and over later untagged blocks; untagged only when there is no python block
        ("```python\nx = 1\n```\n```\n$ run\n```", "x = 1\n"),
        ("```\nx = 3\n```\n```\nx = 4\n```", "x = 4\n"),
        # other languages are not the program
        ("```bash\nls\n```\n```\nx = 5\n```", "x = 5\n"),
        ("```bash\nls\n```", "```bash\nls\n```"),
        # a cut-off completion: the unclosed block runs to the end
        ("Sure.\n```python\ndef f(x):\n    return x", "def f(x):\n    return x\n"),
        # fences inside a list item are indented
        ("1. code:\n   ```python\n   y = 2\n   ```", "   y = 2\n"),
    ],
)
def test_extract_program(text, program):
    assert extract_program(text) == program


def test_normalize_output():
    assert normalize_output("a  \nb\t\n\n\n") == ["a", "b"]
    assert normalize_output("\n a\n") == ["", " a"]  # leading whitespace and blank lines count
    assert normalize_output("") == []


# --- scoring ----------------------------------------------------------------------------------


def test_registered():
    assert REGISTRY.get("code") is code_reward


def test_no_tests_is_none():
    assert code_reward("p", DOUBLE, tests=None) is None
    assert code_reward("p", DOUBLE, tests=[]) is None
    assert code_reward("p", DOUBLE) is None


def test_assert_tests_partial_credit():
    # f(1) = 2 passes, f(2) = 4 passes, f(3) = 6 != 7 fails -> 2 / 3
    tests = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]
    assert code_reward("p", f"```python\n{DOUBLE}```", tests=tests) == pytest.approx(2 / 3)
    assert code_reward("p", DOUBLE, tests=tests[:2]) == 1.0


def test_io_tests():
    program = "n = int(input())\nfor i in range(n):\n    print(i * i, '  ')\n"
    tests = [
        {"input": "3\n", "output": "0\n1\n4\n"},  # trailing spaces and newline ignored
        {"input": "1", "output": "0"},
        {"input": "2\n", "output": "0\n2\n"},  # wrong: 1 != 2
    ]
    assert code_reward("p", program, tests=tests) == pytest.approx(2 / 3)


def test_io_test_needs_exit_status_zero():
    program = "print(input())\nraise SystemExit(1)\n"
    assert code_reward("p", program, tests=[{"input": "a", "output": "a"}]) == 0.0


def test_mixed_tests_and_main_guard():
    # Assert tests import the program as module "solution": the __main__ block (reading stdin)
    # does not run there; IO tests run it as a script.
    program = "def f(x):\n    return x + 1\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    tests = ["assert f(1) == 2", {"input": "41", "output": "42"}, "assert __name__ == 'solution'"]
    assert code_reward("p", program, tests=tests) == 1.0


@pytest.mark.parametrize(
    "program",
    [
        "import sys\nsys.exit(0)\n" + DOUBLE,  # exits before the asserts
        "import os\nos._exit(0)\n",
        "def f(x):\n    return 0\nimport builtins\nbuiltins.AssertionError = None\n",  # assert still raises
        "print('ok')\nprint('PASS')\nraise SystemExit(0)\n",  # guessing a marker does not help
        "while True:\n    pass\n",  # times out
    ],
)
def test_cheats_and_failures_score_zero(program):
    assert code_reward("p", program, tests=["assert f(2) == 4"], timeout_s=1) == 0.0


def test_syntax_error_scores_zero_after_one_run(monkeypatch):
    calls = []
    real = code_module.run_python

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(code_module, "run_python", counting)
    tests = ["assert f(1) == 2", "assert f(2) == 4", {"input": "", "output": ""}]
    assert code_reward("p", "def f(x) return x * 2\n", tests=tests) == 0.0
    assert len(calls) == 1  # the first failure shows the program does not compile
    assert code_reward("p", "def f(x):\n\treturn x\n        pass\n", tests=tests[:1]) == 0.0  # TabError


def test_failing_test_statement_is_not_a_syntax_shortcut(monkeypatch):
    # A test with a syntax error fails alone; the program still gets the other tests.
    tests = ["assert f(1) ==", "assert f(2) == 4"]
    assert code_reward("p", DOUBLE, tests=tests) == 0.5


def test_bad_test_item_raises():
    with pytest.raises(ValueError, match="code test"):
        code_reward("p", DOUBLE, tests=[{"stdin": "1"}])


def test_limits_are_passed(monkeypatch):
    seen = {}
    real = code_module.run_python

    def spy(source, **kwargs):
        seen.update(kwargs)
        return real(source, **kwargs)

    monkeypatch.setattr(code_module, "run_python", spy)
    code_reward("p", DOUBLE, tests=["assert f(1) == 2"], timeout_s=3, memory_mb=300, isolation="rlimits")
    assert seen == {"wall_s": 3, "cpu_s": 3, "memory_mb": 300, "isolation": "rlimits"}


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        ("def f(x): return x*2", 2 / 3),  # f(1)=2 ok, f(2)=4 ok, f(3)=6 != 7
        ("def f(x): return x*", 0.0),  # does not compile
        ("import sys\nsys.exit(0)", 0.0),  # exits before the tests: no pass is printed
        ("def f(x):\n    raise ValueError", 0.0),
    ],
)
def test_together_mode_gives_the_same_partial_credit_in_one_run(program, expected):
    tests = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]
    assert code_reward("p", program, tests=tests, together=True, timeout_s=3) == pytest.approx(expected)
    assert code_reward("p", program, tests=tests, timeout_s=3) == pytest.approx(expected)
