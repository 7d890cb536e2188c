r"""Arithmetic word problems with ``\boxed{}`` answers, for real (tokenizer-based) models.

Prompt: a question, then the instruction ``Give the final answer in \boxed{}.``. Either plain
(``"What is 47 + 38? Give the final answer in \boxed{}."``) or one of a few word-problem
templates per operator (apples, pages, marbles, passengers, boxes of pencils, rows of flowers):
``"Maya has 47 apples and buys 38 more. How many apples does Maya have now? Give the final answer
in \boxed{}."``.

Answer: the exact result in decimal (``"85"``). Demonstration (for SFT): the equation, then the
boxed answer: ``"47 + 38 = 85. The answer is \boxed{85}."``. The ``math`` reward (math-verify on
the last ``\boxed{}``) scores it 1.0, and so does :meth:`WordMathTask.verify`, which reads the last
``\boxed{}`` (the first number in it: ``\boxed{85 \text{ apples}}`` is 85), else the completion's
last number (``"47 + 38 = 85"``), and compares numbers (``85.0`` and ``1,085`` read as such).

Problems: ``+``: both operands in ``1..max_number``; ``-``: ``a`` in ``1..max_number``, ``b`` in
``1..a`` (results are never negative); ``*``: both factors in ``2..max_factor``. The operator is
drawn uniformly from ``ops``, then the style: plain with probability ``plain_share``, else a word
template drawn uniformly for that operator (with a name drawn from a short list). The split of a
problem is that of its arithmetic (``word_math:+:38:47``; ``+`` and ``*`` sorted), so the same sum
phrased two ways is never in both splits.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from posttrain.tasks.answers import last_boxed
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

OPS = "+-*"
INSTRUCTION = "Give the final answer in \\boxed{}."
SYMBOLS = {"+": "+", "-": "-", "*": "×"}
NAMES = ("Maya", "Tom", "Ana", "Ben", "Lena", "Sam")
# Word templates per operator: {n} is a name, {a} and {b} the operands in that order.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{n} has {a} apples and buys {b} more. How many apples does {n} have now?",
        "A book has {a} pages in its first part and {b} pages in its second part. How many pages does it have?",
        "A bag holds {a} red marbles and {b} blue marbles. How many marbles are in the bag?",
    ),
    "-": (
        "{n} has {a} apples and gives {b} of them to a friend. How many apples does {n} have left?",
        "A book has {a} pages and {n} has read {b} of them. How many pages are left to read?",
        "A bus carries {a} passengers. At the next stop {b} passengers get off. How many are still on the bus?",
    ),
    "*": (
        "{n} buys {a} boxes with {b} pencils in each box. How many pencils does {n} have?",
        "A garden has {a} rows with {b} flowers in each row. How many flowers are in the garden?",
    ),
}
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _as_number(text: str) -> Fraction | None:
    """``text`` (``"85"``, ``"1,085"``, ``"85.0"``, ``"-3"``) as an exact number, else ``None``."""
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


class WordMathTask:
    r"""Arithmetic word problems answered in ``\boxed{}``; see the module docstring."""

    name: str = "word_math"

    def __init__(self, ops: str = OPS, max_number: int = 99, max_factor: int = 12, plain_share: float = 0.5) -> None:
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty string of operators from {OPS!r}, got {ops!r}")
        if max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {max_number}")
        if max_factor < 3:
            raise ValueError(f"max_factor must be >= 3, got {max_factor}")
        if not 0.0 <= plain_share <= 1.0:
            raise ValueError(f"plain_share must be in [0, 1], got {plain_share}")
        self.ops = "".join(sorted(set(ops), key=OPS.index))
        self.max_number = max_number
        self.max_factor = max_factor
        self.plain_share = plain_share
        texts = [t for op in self.ops for t in TEMPLATES[op]] + list(NAMES)
        symbols = "".join(SYMBOLS[op] for op in self.ops)
        self.alphabet = make_alphabet(
            "What is ? ", INSTRUCTION, "0123456789", symbols, " = . The answer is \\boxed{}", *texts
        )

    def __repr__(self) -> str:
        return (
            f"WordMathTask(ops={self.ops!r}, max_number={self.max_number}, max_factor={self.max_factor}, "
            f"plain_share={self.plain_share})"
        )

    def make_example(self, a: int, op: str, b: int, template: str | None = None, who: str = NAMES[0]) -> Example:
        r"""The example ``a op b``: plain (``template=None``) or worded by ``template`` for ``who``."""
        result = a + b if op == "+" else a - b if op == "-" else a * b
        equation = f"{a} {SYMBOLS[op]} {b}"
        question = f"What is {equation}?" if template is None else template.format(n=who, a=a, b=b)
        return Example(
            prompt=f"{question} {INSTRUCTION}",
            answer=str(result),
            demonstration=f"{equation} = {result}. The answer is \\boxed{{{result}}}.",
            fields={"a": a, "op": op, "b": b, "result": result},
        )

    def _draw(self, rng: random.Random) -> tuple[str, Example]:
        op = rng.choice(self.ops)
        if op == "*":
            a, b = rng.randint(2, self.max_factor), rng.randint(2, self.max_factor)
        else:
            a = rng.randint(1, self.max_number)
            b = rng.randint(1, self.max_number) if op == "+" else rng.randint(1, a)
        template = None if rng.random() < self.plain_share else rng.choice(TEMPLATES[op])
        who = rng.choice(NAMES)
        # + and * commute: a+b and b+a are one problem, so they share a split.
        x, y = (min(a, b), max(a, b)) if op in "+*" else (a, b)
        return f"word_math:{op}:{x}:{y}", self.make_example(a, op, b, template, who)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split``, sampled with replacement (see :func:`sample_split`)."""
        return sample_split(split, n, seed, self._draw)

    def extract(self, completion: str) -> str | None:
        r"""The answer in ``completion``: the first number in its last ``\boxed{}``; without a box,
        its last number; ``None`` when there is none (or the box holds no number).
        """
        boxed = last_boxed(completion)
        if boxed is not None:
            found = _NUMBER.search(boxed)
            return found.group(0) if found else None
        numbers = _NUMBER.findall(completion)
        return numbers[-1] if numbers else None

    def verify(self, completion: str, example: Example) -> float:
        """Score 1.0 iff the extracted answer equals ``example.answer`` as a number, else 0.0."""
        found = self.extract(completion)
        value = None if found is None else _as_number(found)
        return 1.0 if value is not None and value == _as_number(example.answer) else 0.0
