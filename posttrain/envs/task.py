"""``task.name = "env"``: a multi-turn environment (``posttrain.envs``) seen through the task contract.

The loop draws problems from a task; an :class:`EnvTask` draws them from its environment and adds
what the ``multi_turn`` rollout driver needs: a fresh episode per rollout, its first messages
(with ``task.system_prompt`` in front when the environment brings none), the turn limit and the
episode's token budget (``[task.env]``). An episode is scored by its environment, not by
``extract`` / ``verify`` on one completion: ``verify`` replays a single answer as a one-turn
episode, which is what a plain completion means for a multi-turn environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.envs.base import Environment, Episode, Message, make_env
from posttrain.tasks.base import Example, Split


@dataclass
class EnvTask:
    """A task whose examples are an environment's problems, each solved over several turns."""

    env: Environment
    max_turns: int
    max_tokens: int
    step_timeout_s: float
    system_prompt: str | None = None

    @classmethod
    def build(cls, name: str, params: dict, max_turns: int, max_tokens: int, step_timeout_s: float,
              system_prompt: str | None = None) -> EnvTask:
        """The environment ``name`` with ``params``; ``max_turns = 0`` takes the environment's own limit."""
        env = make_env(name, params)
        return cls(env, max_turns or int(env.max_turns), max_tokens, step_timeout_s, system_prompt)

    @property
    def name(self) -> str:
        """``env:<environment>``."""
        return f"env:{self.env.name}"

    @property
    def alphabet(self) -> str:
        """The environment's characters (what the tiny tokenizer must spell)."""
        return self.env.alphabet

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """The environment's problems."""
        return self.env.examples(split, n, seed)

    def start(self, example: Example) -> tuple[Episode, list[Message]]:
        """A fresh episode on ``example`` and its first messages."""
        episode = self.env.start(example)
        messages = list(episode.reset())
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return episode, messages

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """The environment's expert transcript on ``example`` (``task.system_prompt`` in front as in
        :meth:`start`), for SFT warm-up.
        """
        messages = list(self.env.demonstration(example, seed))
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def extract(self, completion: str) -> str | None:
        """The answer a completion gives is the completion (the environment parses actions)."""
        return completion.strip() or None

    def verify(self, completion: str, example: Example) -> float:
        """1.0 when ``completion`` as the first and only turn solves the episode (its ``success``)."""
        episode, _ = self.start(example)
        return float(episode.step(completion).info.get("success", 0.0))
