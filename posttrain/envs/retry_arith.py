"""``retry_arith``: answer an arithmetic problem, told ``no`` after a wrong answer, until right.

The retry-with-feedback environment of SkyRL (``examples/train/multiply/env.py``: "incorrect, try
again", max_turns 5) and AReaL (``areal/workflow/multi_turn.py``: a retry prompt, the reward
discounted per turn), on the foundation's arithmetic task (:class:`ArithmeticTask`: its
generator, its prompt format -- operands least-significant digit first when ``reverse`` -- and its
split keys, so ``retry_arith`` and ``arithmetic`` agree on which problems are test problems).

Prompt: the task's, e.g. ``21+43=`` (12 + 34, reversed). An action is the answer, digits only,
written like the task's answer (``64``, i.e. 46 reversed). Per turn: right -> reward
``turn_discount ** t`` (t = 0 for the first turn; 1.0 by default) and the episode ends
(``success`` 1); wrong -> reward 0 and the reply ``no``; the driver's turn limit (``max_turns`` 3)
ends an episode that never gets it. An action that is not digits (SkyRL's "not boxed") ends the
episode with reward 0 and ``format_errors`` 1: a malformed answer is not an attempt worth
feedback, as in ``guess_number`` and ``grid``.

The state key (GiGPO's anchor) is the problem and the attempts so far: ``21+43=|65,66``.
The expert answers right; with ``noise`` each answer is instead, with that probability, a wrong
one (the right one with one digit changed, never an earlier attempt), so SFT transcripts show
retries after ``no``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from posttrain.envs.base import Message, StepResult, register
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.tasks.base import Example, Split, make_alphabet

WRONG = "no"


@dataclass
class RetryEpisode:
    """One problem and the attempts so far."""

    prompt: str
    answer: str
    turn_discount: float = 1.0
    attempts: list[str] = field(default_factory=list)

    def reset(self) -> list[Message]:
        """The problem, e.g. ``21+43=``."""
        self.attempts = []
        return [{"role": "user", "content": self.prompt}]

    def step(self, action: str) -> StepResult:
        """Score one answer."""
        text = action.strip()
        if not (text.isascii() and text.isdigit()):
            return StepResult(reward=0.0, done=True, info={"success": 0.0, "format_errors": 1.0})
        turn = len(self.attempts)
        self.attempts.append(text)
        if text == self.answer:
            return StepResult(reward=self.turn_discount**turn, done=True, info={"success": 1.0})
        return StepResult(messages=({"role": "user", "content": WRONG},), info={"success": 0.0})

    def state_key(self) -> str:
        """The problem and the attempts so far."""
        return f"{self.prompt}|{','.join(self.attempts)}"


def _wrong_answer(answer: str, avoid: set[str], rng: random.Random) -> str:
    """``answer`` with one digit changed, not in ``avoid`` (falls back to appending digits)."""
    for _ in range(100):
        i = rng.randrange(len(answer))
        candidate = answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1 :]
        if candidate not in avoid:
            return candidate
    candidate = answer + "0"
    while candidate in avoid:
        candidate += "0"
    return candidate


@register("retry_arith")
class RetryArith:
    """Arithmetic with retries after ``no`` (see the module docstring)."""

    name = "retry_arith"
    max_turns = 3

    def __init__(
        self, digits: int = 2, ops: str = "+", reverse: bool = True, turn_discount: float = 1.0, noise: float = 0.0
    ) -> None:
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"retry_arith: turn_discount must be in (0, 1]; got {turn_discount}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"retry_arith: noise must be in [0, 1]; got {noise}")
        self.task = ArithmeticTask(digits=digits, ops=ops, reverse=reverse)
        self.turn_discount, self.noise = turn_discount, noise
        self.alphabet = make_alphabet(self.task.alphabet, WRONG)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """The arithmetic task's problems (the same splits); ``demonstration`` is the answer."""
        return self.task.examples(split, n, seed)

    def start(self, example: Example) -> RetryEpisode:
        """An episode on ``example``."""
        return RetryEpisode(example.prompt, example.answer, self.turn_discount)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """Right answers, each wrong instead with probability ``noise``; ends when right or at the limit."""
        rng = random.Random(seed)
        ep = self.start(example)
        messages = ep.reset()
        for turn in range(self.max_turns):
            wrong = rng.random() < self.noise
            action = _wrong_answer(example.answer, set(ep.attempts), rng) if wrong else example.answer
            messages.append({"role": "assistant", "content": action})
            res = ep.step(action)
            if res.done or turn == self.max_turns - 1:  # the transcript ends with the policy's turn
                break
            messages.extend(res.messages)
        return messages
