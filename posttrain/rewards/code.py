"""Code reward: run the completion's Python program against tests in the sandbox.

``code`` scores ``passed / len(tests)``. Fields and parameters:

* ``tests`` (example field): a list whose items are either
  - a string of Python statements (typically ``assert``) run after the program in the same
    namespace; it passes iff it runs to the end; or
  - ``{"input": str, "output": str}``: the program runs as a script with ``input`` on stdin and
    passes iff it exits 0 and its stdout equals ``output`` after normalising both (each line
    right-stripped, trailing blank lines dropped).
  Missing or empty ``tests`` -> ``None`` (cannot score).
* ``timeout_s`` (recipe, default 5): wall and CPU limit of each run; ``memory_mb`` (512);
  ``isolation`` (``"auto"``: the strongest level available, see :mod:`posttrain.sandbox`).

Every test is its own sandboxed run (correctness first: a test that hangs or crashes the
interpreter costs only itself, and no test sees state left by another), so a completion costs
``len(tests)`` runs of ~30-80 ms each (``bench/sandbox.py``); tasks that need all-or-nothing can
join their asserts into one string (one run). A program that does not compile fails the first run
with a ``SyntaxError`` in ``program.py`` and the remaining runs are skipped (score 0).

Assert tests: the program is executed as module ``solution`` (not ``__main__``, so a script's
``if __name__ == "__main__":`` block that reads stdin does not run), then the test, then a harness
line prints a random per-run nonce; the test passes only if that nonce line is printed and the
exit status is 0. So ``sys.exit(0)`` / ``os._exit(0)`` before the asserts fails, as does printing
a guessed marker. (A program that digs the nonce out of the interpreter's memory could still fake
a pass: the harness and the program share one process. Reading the harness file is not possible:
the source reaches the interpreter through an unlinked file.)

Program extraction (:func:`extract_program`): the *last* fenced block tagged ``python``/``py``/
``python3``, else the last untagged fenced block, else the whole completion. Last, because a
model's final answer usually comes after its drafts and examples. A block whose closing fence is
missing (a cut-off completion) runs to the end of the text.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from posttrain.rewards.registry import register
from posttrain.sandbox import Isolation, SandboxResult, best_isolation, isolation_status, run_python

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


@register("code")
def code_reward(
    prompt: str,
    completion: str,
    *,
    tests: Sequence[str | Mapping[str, str]] | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    isolation: Isolation = "auto",
    together: bool = False,
    **_: object,
) -> float | None:
    """Fraction of ``tests`` the completion's program passes, each run sandboxed (see the module).

    ``together=True`` runs all assert tests in one sandboxed run after one execution of the
    program (each test in its own ``try``; one run instead of ``len(tests)``): faster, but tests
    share the program's state, and a test that hangs or crashes the interpreter fails every test
    after it. Input/output tests always run alone.

    Hand example: program ``def f(x): return x * 2``, tests ``["assert f(1) == 2",
    "assert f(2) == 4", "assert f(3) == 7"]`` -> 2 of 3 pass -> ``0.667``.

    Raises:
        ValueError: on a test that is neither a string nor an ``{"input", "output"}`` mapping.

    """
    if not tests:
        return None
    program = extract_program(completion)
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


def describe(params: Mapping[str, object]) -> str:
    """One log line: which sandbox isolation the ``code`` reward will use here, and why not others."""
    chosen = params.get("isolation", "auto")
    level = best_isolation() if chosen == "auto" else chosen
    others = ", ".join(f"{k}: {v}" for k, v in isolation_status().items())
    return f"reward 'code': sandbox isolation {level!r} (levels here: {others})"


code_reward.describe = describe  # type: ignore[attr-defined]  # printed by the trainer at start-up
