"""``textarena``: TextArena's single-player games (``pip install textarena``) as multi-turn environments.

TextArena (github.com/LeonGuertler/TextArena) ships text games behind one API: ``reset(num_players,
seed)``, ``get_observation() -> (player_id, messages)``, ``step(action) -> (done, info)`` and
``close() -> (rewards, game_info)``. This adapter plays its single-player games through posttrain's
episode protocol (``envs/base.py``). ``params = { game = "GuessTheNumber-v0", max_number = 50 }``: the game id,
and every parameter that is not the adapter's own (``bracket_actions``, ``success_reward``) goes to the game's
constructor, over its registered ones.


- a problem is a game seed: ``examples`` draws seeds (``textarena:<game>:<seed>`` keys, split by
  ``tasks.base.split_of``, so train and test never share a seed); the prompt is the game's first
  observation after ``reset(seed)``;
- the game is built *without* TextArena's observation wrappers (which re-send the whole history every
  turn): the user message of a turn is the new game messages only, the policy's own action not echoed;
  ``bracket_actions`` (default, as TextArena's ``ActionFormattingWrapper``) puts an action without ``[``
  or ``]`` in brackets, so ``5`` is the move ``[5]``;
- the game's reward at its end (``close()``) is the episode reward; ``success`` is 1 when it is at
  least ``success_reward`` (a win: 1 in TextArena's games, which score a loss by a completion fraction);
- an invalid move is an observation, as TextArena plays it (one warning, then the game ends), counted
  in ``format_errors``; a game that raises ends its episode as an error (the driver scores it ``None``
  and logs the transcript), never the run.

TextArena's games draw from the global ``random`` (and numpy) generators, which its ``reset`` seeds.
The driver steps episodes in threads, so every call into a game holds one lock and runs on the
episode's own saved generator states: the same seed and actions give the same game, whatever else
runs, and posttrain's own global generators are left as they were.

Offline games only: a game that downloads word lists (NLTK) or asks an LLM (OpenRouter) has no place
in a seeded run. :data:`OFFLINE` lists the families checked to reset and step without a network.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import math
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from posttrain.envs.base import Message, StepResult, register
from posttrain.envs.gym_text import PRINTABLE, seeded_examples
from posttrain.errors import ConfigError, unknown_name
from posttrain.tasks.base import Example, Split, make_alphabet

# Single-player families that reset and step offline in textarena 0.7.4. Left out: Hangman, Wordle,
# WordLadder, WordSearch (NLTK downloads at import), GuessWho, TwentyQuestions (OpenRouter), Klondike
# (a SyntaxError in 0.7.4), Countdown, Cryptarithm, Slitherlink (an invalid move ends the game with its
# reason text as the reward).
OFFLINE = ("2048", "Bandit", "Blackjack", "Crosswords", "FifteenPuzzle", "FrozenLake", "GuessTheNumber", "LightsOut",
           "LogicPuzzle", "Mastermind", "Minesweeper", "PegJump", "RushHour", "Secretary", "Set", "Sokoban", "Sudoku",
           "ThreeCardMonte", "TowerOfHanoi")
DEFAULT_MAX_TURNS = 20  # for a game without a turn limit of its own
_LOCK = threading.Lock()  # one game call at a time: they share the global generators
_LOCK_WAIT_S = 60.0


def offline_games() -> list[str]:
    """Every registered TextArena id of an :data:`OFFLINE` family (``-train`` / ``-raw`` variants
    included: the adapter drops their wrappers anyway).
    """
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(g for g in ENV_REGISTRY if g.split("-v")[0] in OFFLINE)


def check_game(game: object) -> None:
    """Raise :class:`ConfigError` unless ``game`` is the id of an offline single-player TextArena game (reads
    TextArena's registry of ids; builds nothing).
    """
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as e:
        raise ConfigError("task.env: the textarena environment needs the textarena package "
                          "(pip install 'textarena>=0.7.4')") from e
    if not isinstance(game, str):
        raise ConfigError(f"task.env.params.game: a TextArena game id (e.g. 'GuessTheNumber-v0'), got {game!r}")
    if game not in offline_games():
        if game in ENV_REGISTRY:
            raise ConfigError(f"task.env.params.game: {game!r} is not an offline single-player TextArena game "
                              f"(it needs a network, an LLM judge or several players); the offline families: "
                              f"{', '.join(OFFLINE)}")
        plain = [g for g in offline_games() if not g.endswith(("-train", "-raw"))]  # the variants add no game
        raise ConfigError(unknown_name("task.env.params.game", "TextArena game", game, plain))


def _factory(game: str, kwargs: Mapping[str, Any]) -> Callable[[], Any]:
    """A function building game ``game`` (with ``kwargs`` over its registered ones) without wrappers."""
    check_game(game)
    from textarena.envs.registration import ENV_REGISTRY

    spec = ENV_REGISTRY[game]
    entry = spec.entry_point
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    params = {**spec.kwargs, **kwargs}
    return lambda: entry(**params)


class _Generators:
    """An episode's own states of the global ``random`` and numpy generators, swapped in around each
    call into its game under :data:`_LOCK`.
    """

    def __init__(self, seed: int) -> None:
        # the states random.seed(seed) / np.random.seed(seed) would give, without touching the globals
        self.py, self.np = random.Random(seed).getstate(), np.random.RandomState(seed % (1 << 32)).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the block on this episode's generators (and with the game's prints swallowed)."""
        if not _LOCK.acquire(timeout=_LOCK_WAIT_S):
            raise TimeoutError(f"another TextArena game call held the lock for {_LOCK_WAIT_S:.0f} s")
        outer_py, outer_np = random.getstate(), np.random.get_state()
        try:
            random.setstate(self.py)
            np.random.set_state(self.np)
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            self.py, self.np = random.getstate(), np.random.get_state()
            random.setstate(outer_py)
            np.random.set_state(outer_np)
            _LOCK.release()


def render(observation: object) -> str:
    """The text of a raw TextArena observation (a list of ``(from_id, message, type)``): the messages
    other than the echo of the player's action (``PLAYER_ACTION``, whoever a game names as its sender),
    one a line.
    """
    if isinstance(observation, str):
        return observation
    lines = []
    for item in observation or ():
        if isinstance(item, tuple) and len(item) >= 2:
            if len(item) > 2 and getattr(item[2], "name", "") == "PLAYER_ACTION":
                continue
            lines.append(str(item[1]).strip())
        else:
            lines.append(str(item).strip())
    return "\n".join(line for line in lines if line)


class TextArenaEpisode:
    """One game of a TextArena environment from one seed."""

    def __init__(self, game: str, make: Callable[[], Any], seed: int, bracket_actions: bool,
                 success_reward: float) -> None:
        self.game, self.make, self.seed = game, make, seed
        self.bracket_actions, self.success_reward = bracket_actions, success_reward
        self.env: Any = None
        self.history: list[str] = []
        self.generators = _Generators(seed)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            with self.generators.active():
                return fn()
        except Exception as e:
            raise RuntimeError(f"textarena game {self.game!r} (seed {self.seed}) raised in {what}: "
                               f"{type(e).__name__}: {e}") from e

    def reset(self) -> list[Message]:
        """A fresh game from the seed; its first observation is the prompt."""
        self.generators, self.history = _Generators(self.seed), []

        def start() -> str:
            self.env = self.make()
            self.env.reset(num_players=1, seed=self.seed)
            return render(self.env.get_observation()[1])

        return [{"role": "user", "content": self._call("reset", start)}]

    def step(self, action: str) -> StepResult:
        """Play ``action``; an invalid move is the game's warning (or its end) and a ``format_errors``."""
        move = action.strip()
        if self.bracket_actions and "[" not in move and "]" not in move:
            move = f"[{move}]"
        state = self.env.state
        errors_before = int(getattr(state, "error_count", 0) or 0)
        done, _ = self._call("step", lambda: self.env.step(move))
        invalid = int(getattr(state, "error_count", 0) or 0) > errors_before or bool(
            done and (getattr(state, "game_info", {}) or {}).get(0, {}).get("invalid_move"))
        info = {"format_errors": float(invalid)}
        if done:
            rewards, _ = self._call("close", self.env.close)
            reward = (rewards or {}).get(0, 0.0)
            if not isinstance(reward, int | float) or not math.isfinite(reward):
                raise RuntimeError(f"textarena game {self.game!r} (seed {self.seed}) ended with reward "
                                   f"{reward!r:.100}, not a finite number")
            reward = float(reward)
            return StepResult(reward=reward, done=True, info={**info, "success": float(reward >= self.success_reward)})
        reply = self._call("get_observation", lambda: render(self.env.get_observation()[1]))
        self.history += [action, reply]
        return StepResult(messages=({"role": "user", "content": reply},), info={**info, "success": 0.0})

    def state_key(self) -> str:
        """A digest of the actions and replies so far (the seed is the group's)."""
        return hashlib.blake2b("\x1e".join(self.history).encode(), digest_size=8).hexdigest()


@register("textarena")
class TextArena:
    """A single-player TextArena game (see the module docstring)."""

    name = "textarena"

    @staticmethod
    def check_params(params: Mapping[str, Any]) -> None:
        """At config validation: the game id (``envs/base.py::check_env_params``); its kwargs need the game built."""
        check_game(params.get("game", "GuessTheNumber-v0"))

    def __init__(self, game: str = "GuessTheNumber-v0", bracket_actions: bool = True, success_reward: float = 1.0,
                 **kwargs: Any) -> None:
        self.game, self.bracket_actions, self.success_reward = game, bracket_actions, success_reward
        self.make = _factory(game, kwargs)
        try:  # one game from seed 0: wrong kwargs fail here, before any model loads
            probe = self.start(Example("", "", "", {"seed": 0}))
            first = probe.reset()[0]["content"]
        except RuntimeError as e:
            raise ConfigError(f"task.env.params: TextArena game {game!r} with {kwargs} does not start: "
                              f"{e.__cause__ or e}") from e
        limit = getattr(probe.env.state, "max_turns", None)
        # TextArena checks its limit before it counts the turn: a game with limit L takes L + 1 moves
        self.max_turns = int(limit) + 1 if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_TURNS
        self.alphabet = make_alphabet(PRINTABLE, first)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Game seeds of ``split``; the prompt is the game's first observation."""
        return seeded_examples(f"textarena:{self.game}", split, n, seed,
                               lambda s: self.start(Example("", "", "", {"seed": s})).reset()[0]["content"])

    def start(self, example: Example) -> TextArenaEpisode:
        """A game from ``example``'s seed."""
        return TextArenaEpisode(self.game, self.make, int(example.fields["seed"]), self.bracket_actions,
                                self.success_reward)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """TextArena has no expert player: SFT warm-up needs demonstrations from elsewhere."""
        raise NotImplementedError(f"textarena ({self.game}): no expert transcripts; warm up with SFT on a data set")
