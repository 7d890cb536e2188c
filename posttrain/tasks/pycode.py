"""Tiny Python programs: write ``f`` from a formula in math notation, checked in the sandbox.

Prompt: a formula for ``f(x)`` as a person writes it, e.g. ``"f(x)=3x+1"``, ``"f(x)=2(x+5)"``,
``"f(x)=x^2+4x"``.
Answer and demonstration: a one-line Python definition (no newline, so a character-level model
over the task's alphabet can write it), e.g. ``"def f(x):return 3*x+1"`` -- at most 23 characters
with one-digit constants. The model must turn implicit multiplication into ``*`` and ``^`` into
``**``.

Forms, with ``a`` in ``2..max_const`` and ``b`` in ``1..max_const``::

    ax+b -> a*x+b      ax-b -> a*x-b      a(x+b) -> a*(x+b)      x^2+b -> x**2+b      x^2+ax -> x**2+a*x

``fields["tests"]``: three asserts, ``assert f(-2)==...``, ``assert f(0)==...``, ``assert f(3)==...``
(the ``code`` reward gives partial credit over them). :meth:`PyCodeTask.verify` runs the
extracted program with all three asserts joined into one test, in one sandboxed run
(:mod:`posttrain.sandbox`), and scores 1.0 only if all pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import cast

from posttrain.sandbox import Isolation
from posttrain.sandbox.programs import extract_program, score_program
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

TEST_INPUTS = (-2, 0, 3)

# form name -> (prompt formula, Python expression, value) for constants a, b
_FORMS: dict[str, tuple[str, str, Callable[[int, int, int], int]]] = {
    "ax+b": ("{a}x+{b}", "{a}*x+{b}", lambda x, a, b: a * x + b),
    "ax-b": ("{a}x-{b}", "{a}*x-{b}", lambda x, a, b: a * x - b),
    "a(x+b)": ("{a}(x+{b})", "{a}*(x+{b})", lambda x, a, b: a * (x + b)),
    "x^2+b": ("x^2+{b}", "x**2+{b}", lambda x, a, b: x * x + b),
    "x^2+ax": ("x^2+{a}x", "x**2+{a}*x", lambda x, a, b: x * x + a * x),
}


class PyCodeTask:
    """Write ``f(x)`` in Python from a formula; see the module docstring for formats."""

    name: str = "pycode"

    def __init__(self, max_const: int = 9, timeout_s: float = 2.0, isolation: Isolation = "auto") -> None:
        if max_const < 2:
            raise ValueError(f"max_const must be >= 2, got {max_const}")
        self.max_const = max_const
        self.timeout_s = timeout_s
        self.isolation = isolation
        constants = [str(c) for c in range(1, max_const + 1)]
        self.alphabet = make_alphabet("f(x)=+-^", "def f(x):return *", *constants)

    def __repr__(self) -> str:
        return f"PyCodeTask(max_const={self.max_const}, timeout_s={self.timeout_s}, isolation={self.isolation!r})"

    def make_example(self, form: str, a: int, b: int) -> Example:
        """Build the example of ``form`` (a key of the forms table) with constants ``a``, ``b``."""
        formula, expr, value = _FORMS[form]
        program = f"def f(x):return {expr.format(a=a, b=b)}"
        tests = [f"assert f({x})=={value(x, a, b)}" for x in TEST_INPUTS]
        return Example(
            prompt=f"f(x)={formula.format(a=a, b=b)}",
            answer=program,
            demonstration=program,
            fields={"form": form, "a": a, "b": b, "tests": tests},
        )

    def _draw(self, rng: random.Random) -> tuple[str, Example]:
        form = rng.choice(sorted(_FORMS))
        a, b = rng.randint(2, self.max_const), rng.randint(1, self.max_const)
        example = self.make_example(form, a, b)
        # The prompt is the problem: forms that ignore a constant share it across draws.
        return f"pycode:{example.prompt}", example

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split``, sampled with replacement (see :func:`sample_split`)."""
        return sample_split(split, n, seed, self._draw)

    def extract(self, completion: str) -> str | None:
        """Return the program in ``completion`` (see :func:`~posttrain.sandbox.programs.extract_program`)."""
        program = extract_program(completion).strip()
        return program or None

    def verify(self, completion: str, example: Example) -> float:
        """Score 1.0 iff the program passes every assert of ``example`` in the sandbox, else 0.0."""
        program = self.extract(completion)
        if program is None:
            return 0.0
        tests = cast(list[str], example.fields["tests"])
        score = score_program(
            program,
            ["\n".join(tests)],
            timeout_s=self.timeout_s,
            isolation=self.isolation,
        )
        return 1.0 if score == 1.0 else 0.0
