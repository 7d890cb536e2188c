"""``guess_number``: find a hidden number in 1..high from ``higher`` / ``lower`` replies.

The multi-turn game of GEM (``gem/envs/game_env/guess_the_number.py``), tinker-cookbook
(``recipes/multiplayer_rl/guess_number``) and OpenRLHF's agent example, sized for the tiny
character model: the prompt is ``guess 1-16``, an action is the number alone (digits), a reply is
``higher`` or ``lower``. Reward 1.0 when the guess is right (the episode ends, ``success`` 1); an
action that is not a number in range ends the episode with -0.1 (GEM's format-error reward,
``format_errors`` 1); running out of turns scores 0. ``max_turns`` = ceil(log2 high) + 1: binary
search always solves it, a careless guesser does not.

The state key (GiGPO's anchor) is the history of guesses and replies: two episodes of one group
(the same hidden number) that guessed the same so far are in the same state. The expert
demonstration is binary search; with ``noise`` each guess is instead, with that probability, a
random number inside the interval still possible (a careless but never absurd player), so SFT on
noisy transcripts gives a policy RL can sharpen.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from posttrain.envs.base import Message, StepResult, register
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

HIGHER, LOWER = "higher", "lower"


@dataclass
class GuessEpisode:
    """One game: the hidden number and the guesses so far."""

    secret: int
    high: int
    prompt: str
    history: list[str] = field(default_factory=list)

    def reset(self) -> list[Message]:
        """The prompt, ``guess 1-<high>``."""
        self.history = []
        return [{"role": "user", "content": self.prompt}]

    def step(self, action: str) -> StepResult:
        """Score one guess."""
        text = action.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 9) or not 1 <= int(text) <= self.high:
            return StepResult(reward=-0.1, done=True, info={"success": 0.0, "format_errors": 1.0})
        guess = int(text)
        if guess == self.secret:
            return StepResult(reward=1.0, done=True, info={"success": 1.0})
        reply = HIGHER if guess < self.secret else LOWER
        self.history.append(f"{guess}{reply[0]}")
        return StepResult(messages=({"role": "user", "content": reply},), info={"success": 0.0})

    def state_key(self) -> str:
        """The guesses and replies so far (the hidden number is the group's)."""
        return ",".join(self.history)


@register("guess_number")
class GuessNumber:
    """Guess a hidden number in 1..high (see the module docstring)."""

    name = "guess_number"

    def __init__(self, high: int = 16, noise: float = 0.0) -> None:
        if high < 2:
            raise ValueError(f"guess_number: high must be >= 2; got {high}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"guess_number: noise must be in [0, 1]; got {noise}")
        self.high, self.noise = high, noise
        self.max_turns = math.ceil(math.log2(high)) + 1
        self.alphabet = make_alphabet("0123456789", f"guess 1-{high}", HIGHER, LOWER)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Hidden numbers; a problem is (number, a draw index), so both splits hold every number."""
        prompt = f"guess 1-{self.high}"

        def draw(rng: random.Random) -> tuple[str, Example]:
            secret = rng.randint(1, self.high)
            first = str((1 + self.high) // 2)
            return f"guess:{self.high}:{secret}:{rng.randrange(1 << 30)}", Example(
                prompt, str(secret), first, {"secret": secret})

        return sample_split(split, n, seed, draw)

    def start(self, example: Example) -> GuessEpisode:
        """A game on ``example``'s hidden number."""
        return GuessEpisode(int(example.fields["secret"]), self.high, example.prompt)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """Binary search on ``example``, each guess random within the still possible interval with
        probability ``noise``; the transcript ends with the right guess or at the turn limit.
        """
        rng = random.Random(seed)
        ep = self.start(example)
        messages = ep.reset()
        lo, hi = 1, self.high
        for turn in range(self.max_turns):
            guess = rng.randint(lo, hi) if rng.random() < self.noise else (lo + hi) // 2
            messages.append({"role": "assistant", "content": str(guess)})
            res = ep.step(str(guess))
            if res.done or turn == self.max_turns - 1:  # the transcript ends with the policy's turn
                break
            messages.extend(res.messages)
            lo, hi = (guess + 1, hi) if res.messages[0]["content"] == HIGHER else (lo, guess - 1)
        return messages
