"""The task contract: an :class:`Example` and the :class:`Task` protocol, plus the split helpers.

A task generates problems, reads the answer out of a completion and scores it (1.0 or 0.0).

Splits are disjoint by construction: every underlying problem has a canonical key (for example
``"arithmetic:+:12:34"``, with commutative operands sorted so ``12+34`` and ``34+12`` are the same
problem), and :func:`split_of` assigns the key to ``"test"`` when a stable hash of it (blake2b, not
Python's salted ``hash()``) is 0 modulo :data:`TEST_MODULUS`, else to ``"train"``. Sampling draws
problems from a seeded ``random.Random`` and keeps the ones whose key falls in the requested split.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Split = Literal["train", "test"]

TEST_MODULUS = 10
"""One problem in ``TEST_MODULUS`` (by hash of its key) belongs to the test split."""

_SPLIT_SEED_OFFSET: dict[str, int] = {"train": 0, "test": 1 << 32}
"""Each split draws from its own stream, ``random.Random(seed + offset)``."""


@dataclass(frozen=True)
class Example:
    """One problem of a task.

    Attributes:
        prompt: the user message text (the trainer puts it through the tokenizer's chat template).
        answer: the canonical answer string.
        demonstration: the reference completion for SFT: what a perfect model writes after the
            prompt, with no special tokens.
        fields: extra per-example fields (operands, numbers, target, ...).
        hint: guidance that helps without giving the answer away, or ``None`` when the task has
            none. HINT's re-roll (``rollout.hint_reroll``) samples an all-wrong group again from
            the prompt with the hint appended (``posttrain.produce.drivers.hint``).
        messages: a chat prompt's turns (``{"role", "content"}`` dicts: system, few-shot user and
            assistant turns, the final user turn), or ``None`` for a one-turn prompt. With messages
            ``prompt`` is the final user turn's text (what rewards and logs read) and the model sees
            the whole chat (``posttrain.models.chat.encode_example``).
        tools: OpenAI-style tool schemas passed to the chat template (``tools=``), or ``None``.
        chat_template_kwargs: extra keyword arguments of the chat template (``enable_thinking``, ...),
            or ``None``.

    """

    prompt: str
    answer: str
    demonstration: str
    fields: Mapping[str, object] = field(default_factory=dict)
    hint: str | None = None
    messages: Sequence[Mapping[str, object]] | None = None
    tools: Sequence[Mapping[str, object]] | None = None
    chat_template_kwargs: Mapping[str, object] | None = None


class Task(Protocol):
    """A verifiable task: generates examples, extracts and scores answers."""

    name: str
    alphabet: str
    """Every character any prompt or demonstration of this task can contain (sorted, unique)."""

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split``, deterministic in ``(split, n, seed)``."""
        ...

    def extract(self, completion: str) -> str | None:
        """Return the answer written in ``completion``, or ``None`` if there is none."""
        ...

    def verify(self, completion: str, example: Example) -> float:
        """Score ``completion``: 1.0 if it solves ``example``, else 0.0."""
        ...


def split_of(key: str) -> Split:
    """Return the split of the problem with canonical key ``key`` (stable across runs)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % TEST_MODULUS == 0 else "train"


def sample_split(
    split: Split,
    n: int,
    seed: int,
    draw: Callable[[random.Random], tuple[str, Example] | None],
    max_tries_per_example: int = 10_000,
) -> list[Example]:
    """Draw problems with ``draw(rng)`` until ``n`` of them have keys in ``split``.

    ``draw`` returns ``(key, example)``, or ``None`` to reject the draw (the generator's own
    constraints). Sampling is with replacement: a split smaller than ``n`` problems (the test split
    of a tiny config, e.g. 1-digit addition has about 6 test problems) yields duplicates. The
    result for ``n`` is a prefix of the result for any larger ``n`` with the same seed.

    Raises:
        ValueError: on an unknown split, a negative ``n``, or if a split looks empty (no accepted
            problem in ``max_tries_per_example`` consecutive draws).

    """
    if split not in _SPLIT_SEED_OFFSET:
        raise ValueError(f"unknown split {split!r}; choices: train, test")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed + _SPLIT_SEED_OFFSET[split])
    out: list[Example] = []
    misses = 0
    while len(out) < n:
        drawn = draw(rng)
        if drawn is not None and split_of(drawn[0]) == split:
            out.append(drawn[1])
            misses = 0
            continue
        misses += 1
        if misses >= max_tries_per_example:
            raise ValueError(f"no {split} problem found in {misses} draws; is the {split} split empty?")
    return out


def make_alphabet(*parts: str) -> str:
    """Return the sorted unique characters of ``parts``."""
    return "".join(sorted(set("".join(parts))))
