"""``openenv``: an OpenEnv environment server (reset/step over a WebSocket session) as a multi-turn environment.

``[task.env] name = "openenv"``, ``params = { base_url = "http://HOST:PORT", action_field = "message",
observation_field = "text" }``: every episode opens its own session on the server with ``openenv-core``'s
``GenericEnvClient`` (one environment instance per session, OpenEnv's ``/ws`` protocol: the client turns an
``http://`` URL into ``ws://``), resets it with the example's seed, and then sends each turn of the policy as the
action ``{action_field: text}``. The observation's ``observation_field`` (a string) is the next user message; with
``observation_field = ""`` the whole observation dict, as sorted JSON, is. The server's ``reward`` is the turn's
reward (``None`` counts 0; the episode's reward is their sum) and its ``done`` ends the episode; ``success`` is 1
when the episode ended with a summed reward of at least ``success_reward``.

A problem is a seed, as in ``gym_text``: ``examples`` draws ``openenv:<base_url>:<seed>`` keys (split by
``tasks.base.split_of``) and the prompt is the observation of ``reset(seed=seed)`` on a session of its own, so the
server's ``reset`` must be deterministic in the seed for the G episodes of a group to share their prompt.

**Failures end the episode, never the run.** A step that gets no answer within ``step_timeout_s`` (a hung server),
a connection that fails or drops (a dead server), a server error, an observation without a string under
``observation_field`` or a reward that is not a finite number raise from ``step``: the multi-turn driver scores
that episode ``None`` (``scoring.on_error``) and logs its transcript (``[task.env] step_timeout_s`` cuts a step at
the driver's level too). A reset that fails (the server down when the batch starts) does not raise: the episode
shows the example's prompt and its first step raises with the reset's error. Only building the environment needs
the server up: one reset then checks the URL and the mapping, before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from posttrain.envs.base import Message, StepResult, register
from posttrain.envs.gym_text import PRINTABLE, seeded_examples
from posttrain.errors import ConfigError
from posttrain.tasks.base import Example, Split, make_alphabet


def observation_text(observation: object, field: str) -> str:
    """The user message of an OpenEnv observation dict: its ``field`` (which must be a string), or the whole
    dict as sorted JSON when ``field`` is empty; raises ``TypeError`` naming what was found.
    """
    if not isinstance(observation, Mapping):
        raise TypeError(f"openenv: the observation is a {type(observation).__name__}, expected a JSON object")
    if not field:
        return json.dumps(observation, sort_keys=True, default=str)
    value = observation.get(field)
    if not isinstance(value, str):
        raise TypeError(f"openenv: observation[{field!r}] is {value!r:.100}, expected a string "
                        f"(the observation's keys: {sorted(observation)})")
    return value


def step_reward(reward: object) -> float:
    """The server's reward as a finite float (``None``: 0); raises ``TypeError`` for anything else."""
    if reward is None:
        return 0.0
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise TypeError(f"openenv: the server's reward is {reward!r:.100}, expected a finite number or null")
    return float(reward)


class OpenEnvEpisode:
    """One episode: its own WebSocket session on the server, reset with the example's seed."""

    def __init__(self, env: OpenEnv, example: Example) -> None:
        self.env, self.example = env, example
        self.seed = int(example.fields["seed"])
        self.client: Any = None
        self.error: str | None = None
        self.total = 0.0
        self.history: list[str] = []

    def reset(self) -> list[Message]:
        """A fresh session reset with the seed; its observation is the prompt (the example's, if it fails)."""
        self.close()
        self.total, self.history, self.error = 0.0, [], None
        try:
            self.client = self.env.connect()
            result = self.client.reset(seed=self.seed)
            return [{"role": "user", "content": observation_text(result.observation, self.env.observation_field)}]
        except Exception as e:  # noqa: BLE001 - a failed reset scores the episode None at its first step
            self.error = f"reset failed: {type(e).__name__}: {e}"
            self.close()
            return [{"role": "user", "content": self.example.prompt}]

    def step(self, action: str) -> StepResult:
        """Send ``{action_field: action}``; the observation's text, the reward and ``done`` come back."""
        if self.error is not None:
            raise RuntimeError(f"openenv {self.env.base_url}: {self.error}")
        if self.client is None:
            raise RuntimeError(f"openenv {self.env.base_url}: step() after the episode ended")
        try:
            result = self.client.step({self.env.action_field: action})
            reward = step_reward(result.reward)
            done = bool(result.done)
            text = "" if done else observation_text(result.observation, self.env.observation_field)
        except Exception:
            self.close()
            raise
        self.total += reward
        info = {"success": float(done and self.total >= self.env.success_reward)}
        if done:
            self.close()
            return StepResult(reward=reward, done=True, info=info)
        self.history += [action, text]
        return StepResult(messages=({"role": "user", "content": text},), reward=reward, info=info)

    def state_key(self) -> str:
        """A digest of the actions and observations so far (the seed is the group's)."""
        return hashlib.blake2b("\x1e".join(self.history).encode(), digest_size=8).hexdigest()

    def close(self) -> None:
        """End the session (best effort: a dead server's connection is already gone)."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - closing a broken connection may fail; nothing is lost
                pass


@register("openenv")
class OpenEnv:
    """An OpenEnv server's environment (see the module docstring)."""

    name = "openenv"

    def __init__(self, base_url: str, action_field: str = "message", observation_field: str = "",
                 step_timeout_s: float = 30.0, connect_timeout_s: float = 10.0, max_turns: int = 8,
                 success_reward: float = 1.0) -> None:
        if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"task.env.params.base_url: expected an http(s):// or ws(s):// URL, got {base_url!r}")
        if not action_field:
            raise ConfigError("task.env.params.action_field: expected the action's field name, got ''")
        if max_turns < 1 or step_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ConfigError(f"task.env.params: expected max_turns >= 1 and positive timeouts, got max_turns = "
                              f"{max_turns}, step_timeout_s = {step_timeout_s}, connect_timeout_s = "
                              f"{connect_timeout_s}")
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as e:
            raise ConfigError("task.env.name = 'openenv' needs openenv-core: pip install 'posttrain[openenv]'") from e
        self.client_cls = GenericEnvClient
        self.base_url, self.action_field, self.observation_field = base_url.rstrip("/"), action_field, observation_field
        self.step_timeout_s, self.connect_timeout_s = step_timeout_s, connect_timeout_s
        self.max_turns, self.success_reward = max_turns, success_reward
        episode = self.start(Example("", "", "", {"seed": 0}))
        first = episode.reset()[0]["content"]  # one reset: a bad URL or mapping fails here, before any model loads
        episode.close()
        if episode.error is not None:
            raise ConfigError(f"task.env.params: the OpenEnv server at {base_url} does not reset: {episode.error}")
        self.alphabet = make_alphabet(PRINTABLE, first)

    def connect(self) -> Any:
        """A connected synchronous session on the server (its own environment instance)."""
        client = self.client_cls(base_url=self.base_url, connect_timeout_s=self.connect_timeout_s,
                                 message_timeout_s=self.step_timeout_s).sync()
        client.connect()
        return client

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Seeds of ``split``; the prompt is the observation of ``reset(seed)`` (a failed reset: a note)."""
        def prompt_of(s: int) -> str:
            episode = self.start(Example("", "", "", {"seed": s}))
            text = episode.reset()[0]["content"]
            episode.close()
            return text if episode.error is None else f"(openenv: {episode.error})"

        return seeded_examples(f"openenv:{self.base_url}", split, n, seed, prompt_of)

    def start(self, example: Example) -> OpenEnvEpisode:
        """An episode from ``example``'s seed."""
        return OpenEnvEpisode(self, example)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """A remote environment brings no expert: SFT warm-up needs demonstrations from elsewhere."""
        raise NotImplementedError(f"openenv ({self.base_url}): no expert transcripts; warm up with SFT on a data set")
