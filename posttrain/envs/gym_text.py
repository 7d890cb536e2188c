"""``gym_text``: bring your own gymnasium-style text environment, named by an import path.

``params = { make = "my_module:make_env", ... }``: ``make(**rest)`` (``rest`` the other params, those
not this adapter's own) returns a fresh environment object with

- ``reset(seed=int) -> (observation: str, info: dict)``, deterministic in the seed;
- ``step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)``.

A problem is a seed (``examples`` draws ``gym_text:<make>:<seed>`` keys, split by
``tasks.base.split_of``, so train and test never share one); the prompt is the observation of
``reset(seed)``, every later observation is the next user message, every step's reward is the
turn's reward (the episode reward is their sum), and ``terminated or truncated`` ends the episode.
``success`` is the step's ``info["success"]`` when it is a number, else 1 when the episode terminated
(not truncated) with a summed reward of at least ``success_reward``; a number under
``info["format_errors"]`` is summed into the ``episode/format_errors`` metric. Every episode makes its
own environment (the driver steps episodes in threads).

The contract is checked on every call: an environment that raises, returns an observation that is
not a string, a reward that is not a finite number or a tuple of another shape ends its episode as
an error (the driver scores it ``None`` and logs the transcript); one that never ends is cut by the
turn limit (``[task.env] max_turns``, default ``max_turns`` here). The path must be importable (a
module on ``sys.path``, e.g. one of the recipe's ``plugins``).
"""

from __future__ import annotations

import hashlib
import importlib
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.envs.base import Message, StepResult, register
from posttrain.errors import ConfigError
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split, split_of

PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"


def seeded_examples(prefix: str, split: Split, n: int, seed: int, prompt_of: Callable[[int], str]) -> list[Example]:
    """``n`` problems of ``split`` that are environment seeds: keys ``<prefix>:<seed>`` split by hash (the
    two splits never share a seed), the prompt ``prompt_of(seed)``, ``fields = {"seed": seed}``.
    """

    def draw(rng: random.Random) -> tuple[str, Example] | None:
        env_seed = rng.randrange(1 << 31)
        key = f"{prefix}:{env_seed}"
        if split_of(key) != split:
            return None  # skip the reset of a problem the split does not hold
        return key, Example(prompt_of(env_seed), "", "", {"seed": env_seed})

    return sample_split(split, n, seed, draw)


def load_factory(path: str, key: str = "task.env.params.make") -> Callable[..., Any]:
    """The callable at ``module:attribute``; a bad path is a :class:`ConfigError` naming ``key``."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{key}: expected 'module:function', got {path!r}")
    try:
        target: Any = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {module!r} ({e}); is it on sys.path or in plugins?") from e
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key}: module {module!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key}: {path!r} is a {type(target).__name__}, not a callable")
    return target


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} returned an observation of type {type(value).__name__}, expected str")
    return value


class GymTextEpisode:
    """One episode of a user's text environment from one seed."""

    def __init__(self, make: Callable[[], Any], name: str, seed: int, success_reward: float) -> None:
        self.make, self.name, self.seed, self.success_reward = make, name, seed, success_reward
        self.env: Any = None
        self.total = 0.0
        self.history: list[str] = []

    def reset(self) -> list[Message]:
        """A fresh environment reset with the seed; its observation is the prompt."""
        self.env, self.total, self.history = self.make(), 0.0, []
        out = self.env.reset(seed=self.seed)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{self.name}.reset(seed) returned {out!r:.200}, expected (observation, info)")
        return [{"role": "user", "content": _text(out[0], f"{self.name}.reset")}]

    def step(self, action: str) -> StepResult:
        """One ``env.step(action)``, checked against the gymnasium contract."""
        out = self.env.step(action)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise TypeError(f"{self.name}.step returned {out!r:.200}, expected "
                            "(observation, reward, terminated, truncated, info)")
        obs, reward, terminated, truncated, info = out
        obs = _text(obs, f"{self.name}.step")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise TypeError(f"{self.name}.step returned reward {reward!r:.100}, expected a finite number")
        info = info if isinstance(info, Mapping) else {}
        numbers = {k: float(v) for k, v in info.items() if k in ("success", "format_errors")
                   and isinstance(v, int | float) and math.isfinite(v)}
        self.total += float(reward)
        done = bool(terminated) or bool(truncated)
        if "success" not in numbers:
            numbers["success"] = float(bool(terminated) and self.total >= self.success_reward)
        if done:
            return StepResult(reward=float(reward), done=True, info=numbers)
        self.history += [action, obs]
        return StepResult(messages=({"role": "user", "content": obs},), reward=float(reward), info=numbers)

    def state_key(self) -> str:
        """A digest of the actions and observations so far (the seed is the group's)."""
        return hashlib.blake2b("\x1e".join(self.history).encode(), digest_size=8).hexdigest()


@register("gym_text")
class GymText:
    """A user's gymnasium-style text environment (see the module docstring)."""

    name = "gym_text"

    def __init__(self, make: str, max_turns: int = 16, success_reward: float = 1.0, **kwargs: Any) -> None:
        if max_turns < 1:
            raise ConfigError(f"task.env.params.max_turns: expected >= 1, got {max_turns}")
        factory, params = load_factory(make), dict(kwargs)
        self.path, self.max_turns, self.success_reward = make, max_turns, success_reward
        self.make = lambda: factory(**params)
        try:  # one reset from seed 0: a broken factory fails here, before any model loads
            first = self.start(Example("", "", "", {"seed": 0})).reset()[0]["content"]
        except Exception as e:  # noqa: BLE001 - any failure of the user's code is a config error naming it
            raise ConfigError(f"task.env.params.make: {make}(**{params}) does not reset: "
                              f"{type(e).__name__}: {e}") from e
        self.alphabet = make_alphabet(PRINTABLE, first)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Environment seeds of ``split``; the prompt is the observation of ``reset(seed)``."""
        return seeded_examples(f"gym_text:{self.path}", split, n, seed,
                               lambda s: self.start(Example("", "", "", {"seed": s})).reset()[0]["content"])

    def start(self, example: Example) -> GymTextEpisode:
        """An episode from ``example``'s seed."""
        return GymTextEpisode(self.make, self.path, int(example.fields["seed"]), self.success_reward)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """A user's environment brings no expert: SFT warm-up needs demonstrations from elsewhere."""
        raise NotImplementedError(f"gym_text ({self.path}): no expert transcripts; warm up with SFT on a data set")
