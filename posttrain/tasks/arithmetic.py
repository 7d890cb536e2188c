r"""Integer addition and multiplication, written least-significant digit first by default.

Prompt: the two operands with the operator between them, then ``=``: ``"321+654="`` asks for
123 + 456 when ``reverse=True`` (digits least-significant first; small char-level transformers learn
carries far better in that order), ``"123+456="`` when ``reverse=False``.

Answer: the digits of the exact result, reversed when ``reverse``: ``"975"`` (579) or ``"579"``.

Demonstration: the answer; with ``steps=True`` a scratchpad, then ``>``, then the answer:

* addition: the column sums ``a_i + b_i + carry_i`` from the least-significant column up (always
  in that order, the order they are computed), in decimal, separated by ``,``. A column sum of 10
  or more carries 1 into the next column; the last column's carry is the result's leading digit.
  ``58+67``: ``8+7=15``, ``5+6+1=12`` -> ``"15,12>521"`` (reversed) or ``"15,12>125"``.
* multiplication: the partial products ``a * b_j * 10**j`` for each digit ``b_j`` of ``b``,
  least-significant first, written like the operands (reversed when ``reverse``), separated by
  ``,``. ``12*34``: ``12*4=48``, ``12*3*10=360`` -> ``"84,063>804"`` (reversed) or ``"48,360>408"``.

Hint (``Example.hint``, for HINT's re-roll): guidance that does not give the answer away. For
``+`` the carry out of each column, ``1`` or ``0``, in the order the digits are written
(least-significant column first when ``reverse``): ``58+67`` -> ``"11"``, ``12+34`` -> ``"00"``; the
carries are what a small model gets wrong. For ``*`` the number of digits of the result:
``12*34`` -> ``"3"``. Both are digits, so the hint needs no characters beyond the task's alphabet.

With ``steps=True`` and ``steps_share`` below 1, only that share of the problems has the scratchpad in its
demonstration; the others are the answer alone (a fixed choice per problem, drawn from its operands). SFT on
them gives a model that sometimes writes the scratchpad and sometimes does not: a miniature of responses
longer than they need to be, where a length method can cut tokens (``bench/claims.py``'s length family).

With ``boxed=True`` the answer in the demonstration is written ``\boxed{...}`` (``"15,12>\boxed{521}"``),
the convention of math datasets, so the task can be scored by the ``math`` reward (math-verify)
instead of its own verifier; :meth:`ArithmeticTask.extract` then reads the last box.

Operands have exactly ``digits`` digits (0-9 for one digit), or, with ``min_digits``, a digit count
drawn uniformly from ``min_digits..digits`` per operand, then a value uniform among those lengths.
"""

from __future__ import annotations

import random
import re

from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

DIGITS = "0123456789"
OPS = "+*"
STEP_SEPARATOR = ","
ANSWER_MARKER = ">"
_DIGIT_RUN = re.compile(r"[0-9]+")
_BOX = re.compile(r"\\boxed\{([^{}]*)\}")
BOX_CHARS = "\\boxed{}"


class ArithmeticTask:
    """Addition/multiplication of random integers; see the module docstring for the formats."""

    name: str = "arithmetic"
    hints: bool = True  # every example has a hint (see the module docstring)

    def __init__(
        self,
        digits: int = 3,
        ops: str = "+",
        reverse: bool = True,
        steps: bool = False,
        min_digits: int | None = None,
        boxed: bool = False,
        steps_share: float = 1.0,
    ) -> None:
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty string of operators from {OPS!r}, got {ops!r}")
        if min_digits is not None and not 1 <= min_digits <= digits:
            raise ValueError(f"min_digits must be in 1..digits={digits}, got {min_digits}")
        if not 0.0 <= steps_share <= 1.0:
            raise ValueError(f"steps_share must be in [0, 1], got {steps_share}")
        if steps_share < 1.0 and not steps:
            raise ValueError("steps_share < 1 thins out the scratchpads of steps=True; set steps=True")
        self.steps_share = steps_share
        self.digits = digits
        self.ops = "".join(sorted(set(ops)))
        self.reverse = reverse
        self.steps = steps
        self.min_digits = digits if min_digits is None else min_digits
        self.boxed = boxed
        markers = ""
        if steps:
            # ',' separates steps; with one column / one partial product there is only one step.
            markers = ANSWER_MARKER + (STEP_SEPARATOR if digits >= 2 else "")
        self.alphabet = make_alphabet(DIGITS, self.ops, "=", markers, BOX_CHARS if boxed else "")

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(digits={self.digits}, ops={self.ops!r}, reverse={self.reverse}, "
            f"steps={self.steps}, min_digits={self.min_digits}, boxed={self.boxed}, steps_share={self.steps_share})"
        )

    def _write(self, value: int) -> str:
        """``value`` in decimal, reversed when ``self.reverse``."""
        text = str(value)
        return text[::-1] if self.reverse else text

    def _operand(self, rng: random.Random) -> int:
        n_digits = rng.randint(self.min_digits, self.digits)
        low = 0 if n_digits == 1 else 10 ** (n_digits - 1)
        return rng.randint(low, 10**n_digits - 1)

    def _steps(self, a: int, op: str, b: int) -> str:
        """Write the scratchpad that precedes the answer marker (see the module docstring)."""
        if op == "+":
            width = max(len(str(a)), len(str(b)))
            sums, carry = [], 0
            for a_i, b_i in zip(str(a).zfill(width)[::-1], str(b).zfill(width)[::-1], strict=True):
                # s_i = a_i + b_i + c_i ;  c_{i+1} = s_i // 10
                s = int(a_i) + int(b_i) + carry
                sums.append(str(s))
                carry = s // 10
            return STEP_SEPARATOR.join(sums)
        partials = [self._write(a * int(d) * 10**j) for j, d in enumerate(str(b)[::-1])]
        return STEP_SEPARATOR.join(partials)

    def reference_steps(self, example: Example) -> list[str]:
        """The right scratchpad steps of ``example`` (``[]`` unless ``steps``): ``58+67`` -> ``["15", "12"]``."""
        if not self.steps:
            return []
        f = example.fields
        return self._steps(int(f["a"]), str(f["op"]), int(f["b"])).split(STEP_SEPARATOR)

    def split_steps(self, completion: str) -> list[str]:
        """The steps a completion wrote: its text before the last ``>``, split at ``,`` (stripped);
        ``[]`` without a ``>`` (:meth:`extract` then reads the whole text as the answer) or when
        nothing precedes it.
        """
        text = completion.strip()
        if ANSWER_MARKER not in text:
            return []
        scratch = text.rsplit(ANSWER_MARKER, 1)[0]
        return [s.strip() for s in scratch.split(STEP_SEPARATOR)] if scratch.strip() else []

    def _hint(self, a: int, op: str, b: int) -> str:
        """The hint (module docstring): the column carries for ``+``, the result's digit count for ``*``."""
        if op == "*":
            return str(len(str(a * b)))
        width = max(len(str(a)), len(str(b)))
        carries, carry = [], 0
        for a_i, b_i in zip(str(a).zfill(width)[::-1], str(b).zfill(width)[::-1], strict=True):
            carry = (int(a_i) + int(b_i) + carry) // 10  # c_{i+1} = (a_i + b_i + c_i) // 10
            carries.append(str(carry))
        text = "".join(carries)  # least-significant column first
        return text if self.reverse else text[::-1]

    def make_example(self, a: int, op: str, b: int) -> Example:
        """Build the example for ``a op b`` in this task's format."""
        result = a + b if op == "+" else a * b
        answer = self._write(result)
        written = f"\\boxed{{{answer}}}" if self.boxed else answer
        demonstration = f"{self._steps(a, op, b)}{ANSWER_MARKER}{written}" if self._scratch(a, op, b) else written
        return Example(
            prompt=f"{self._write(a)}{op}{self._write(b)}=",
            answer=answer,
            demonstration=demonstration,
            fields={"a": a, "op": op, "b": b, "result": result},
            hint=self._hint(a, op, b),
        )

    def _scratch(self, a: int, op: str, b: int) -> bool:
        """Whether the demonstration of ``a op b`` carries the scratchpad: always with ``steps`` and
        ``steps_share = 1``; else a draw fixed by the problem (``a op b`` and ``b op a`` alike).
        """
        if not self.steps or self.steps_share >= 1.0:
            return self.steps
        return random.Random(f"scratch:{op}:{min(a, b)}:{max(a, b)}").random() < self.steps_share

    def _draw(self, rng: random.Random) -> tuple[str, Example]:
        op = rng.choice(self.ops)
        a, b = self._operand(rng), self._operand(rng)
        # Both operators commute: a+b and b+a are one problem, so they share a split.
        key = f"arithmetic:{op}:{min(a, b)}:{max(a, b)}"
        return key, self.make_example(a, op, b)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split``, sampled with replacement (see :func:`sample_split`)."""
        return sample_split(split, n, seed, self._draw)

    def extract(self, completion: str) -> str | None:
        r"""Return the answer in ``completion``, or ``None``.

        With ``boxed``: the content of the last ``\boxed{...}`` (``None`` if there is none).
        Otherwise the first digit run after the last ``>`` if there is a ``>`` (``None`` if none
        follows); else the whole stripped completion if it is all digits; else its last digit run;
        else ``None``.
        """
        text = completion.strip()
        if self.boxed:
            boxes = _BOX.findall(text)
            return boxes[-1].strip() if boxes else None
        if ANSWER_MARKER in text:
            match = _DIGIT_RUN.match(text.rsplit(ANSWER_MARKER, 1)[1].lstrip())
            return match.group(0) if match else None
        if _DIGIT_RUN.fullmatch(text):
            return text
        runs = _DIGIT_RUN.findall(text)
        return runs[-1] if runs else None

    def verify(self, completion: str, example: Example) -> float:
        """Score 1.0 iff the extracted answer equals ``example.answer`` exactly, else 0.0."""
        return 1.0 if self.extract(completion) == example.answer.strip() else 0.0
