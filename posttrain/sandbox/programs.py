"""Programs against tests, in the sandbox: the program in a completion (:func:`extract_program`) and the
share of tests it passes (:func:`score_program`). The ``code`` reward (``rewards/code.py``), the ``pycode``
task and the ``code_feedback`` environment use it; the module docstring of ``rewards/code.py`` states the
test kinds and the pass rule.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from posttrain.sandbox.isolation import Isolation
from posttrain.sandbox.run import SandboxResult, run_python

PYTHON_TAGS = frozenset({"python", "py", "python3"})

_HARNESS = """import linecache, sys, types
_program, _test = {program!r}, {test!r}
linecache.cache["program.py"] = (len(_program), None, _program.splitlines(True), "program.py")
linecache.cache["test.py"] = (len(_test), None, _test.splitlines(True), "test.py")
_module = types.ModuleType("solution")
sys.modules["solution"] = _module
exec(compile(_program, "program.py", "exec"), _module.__dict__)
exec(compile(_test, "test.py", "exec"), _module.__dict__)
print("\\n" + {nonce!r})
"""


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(tag, body)`` of every fenced block, in order; an unclosed last block runs to the end."""
    blocks: list[tuple[str, str]] = []
    tag: str | None = None  # None: outside a block
    body: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if tag is None:
                tag, body = stripped[3:].strip().lower(), []
            else:
                blocks.append((tag, "\n".join(body)))
                tag = None
            continue
        if tag is not None:
            body.append(line)
    if tag is not None:
        blocks.append((tag, "\n".join(body)))
    return blocks


def extract_program(text: str) -> str:
    """The program in ``text``: last ``python`` block, else last untagged block, else all of it."""
    blocks = _fenced_blocks(text)
    for wanted in (lambda t: t in PYTHON_TAGS, lambda t: t == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1] + "\n"
    return text


def normalize_output(text: str) -> list[str]:
    """Lines of ``text``, each right-stripped, without trailing blank lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_HARNESS_TOGETHER = """import linecache, sys, types
_program, _tests = {program!r}, {tests!r}
linecache.cache["program.py"] = (len(_program), None, _program.splitlines(True), "program.py")
_module = types.ModuleType("solution")
sys.modules["solution"] = _module
exec(compile(_program, "program.py", "exec"), _module.__dict__)
for _i, _test in enumerate(_tests):
    try:
        exec(compile(_test, f"test{{_i}}.py", "exec"), _module.__dict__)
    except Exception:
        continue
    print("\\n" + {nonce!r} + ":" + str(_i), flush=True)
"""


def _together(program: str, tests: list[str], limits: dict) -> float:
    """Run every assert test after one execution of the program; the fraction that passed."""
    nonce = secrets.token_hex(16)
    res = run_python(_HARNESS_TOGETHER.format(program=program, tests=tests, nonce=nonce), **limits)
    if _syntax_error_in(res, "program.py"):
        return 0.0
    lines = set(res.stdout.splitlines())
    return sum(f"{nonce}:{i}" in lines for i in range(len(tests))) / len(tests)


def _syntax_error_in(res: SandboxResult, filename: str) -> bool:
    """Whether the run failed because ``filename`` (the program) does not compile."""
    tail = res.stderr.rstrip().rsplit("\n", 1)[-1]
    return (
        res.returncode != 0
        and tail.startswith(("SyntaxError", "IndentationError", "TabError"))
        and f'File "{filename}"' in res.stderr
    )


def score_program(
    program: str,
    tests: Sequence[str | Mapping[str, str]] | None,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    isolation: Isolation = "auto",
    together: bool = False,
) -> float | None:
    """Fraction of ``tests`` that ``program`` passes, each run sandboxed (the ``code`` reward's core; see
    :mod:`posttrain.rewards.code` for the two kinds of test and how a pass is recognised).

    ``together=True`` runs all assert tests in one sandboxed run after one execution of the program.
    ``None`` when there are no tests (cannot score).

    Raises:
        ValueError: on a test that is neither a string nor an ``{"input", "output"}`` mapping.

    """
    if not tests:
        return None
    limits = {"wall_s": timeout_s, "cpu_s": timeout_s, "memory_mb": memory_mb, "isolation": isolation}
    if together and all(isinstance(t, str) for t in tests):
        return _together(program, list(tests), limits)
    passed = 0
    for test in tests:
        if isinstance(test, str):
            nonce = secrets.token_hex(16)
            res = run_python(_HARNESS.format(program=program, test=test, nonce=nonce), **limits)
            ok = res.ok and nonce in res.stdout.splitlines()
            filename = "program.py"
        elif isinstance(test, Mapping) and {"input", "output"} <= set(test):
            res = run_python(program, stdin=str(test["input"]), **limits)
            ok = res.ok and normalize_output(res.stdout) == normalize_output(str(test["output"]))
            filename = "main.py"
        else:
            raise ValueError(f"a code test must be a string or an {{'input', 'output'}} mapping, got {test!r:.80}")
        if not ok and _syntax_error_in(res, filename):
            return 0.0  # every other run would fail the same way
        passed += ok
    return passed / len(tests)
