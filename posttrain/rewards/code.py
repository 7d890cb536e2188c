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

from collections.abc import Mapping, Sequence

from posttrain.rewards.registry import register
from posttrain.sandbox import Isolation, best_isolation, isolation_status
from posttrain.sandbox.programs import extract_program, normalize_output, score_program

__all__ = ["code_reward", "extract_program", "normalize_output", "score_program"]


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
    return score_program(extract_program(completion), tests, timeout_s=timeout_s, memory_mb=memory_mb,
                         isolation=isolation, together=together)


def describe(params: Mapping[str, object]) -> str:
    """One log line: which sandbox isolation the ``code`` reward will use here, and why not others."""
    chosen = params.get("isolation", "auto")
    level = best_isolation() if chosen == "auto" else chosen
    others = ", ".join(f"{k}: {v}" for k, v in isolation_status().items())
    return f"reward 'code': sandbox isolation {level!r} (levels here: {others})"


code_reward.describe = describe  # type: ignore[attr-defined]  # printed by the trainer at start-up
