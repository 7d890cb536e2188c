"""The environment contract: what a multi-turn environment gives the ``multi_turn`` rollout driver.

An *environment* (registered by name in :data:`ENVS`, built with its ``[task.env] params``) is a
task whose episodes last several turns: it generates problems like a task does
(:meth:`Environment.examples`, splits disjoint by ``tasks.base.split_of``) and starts one
:class:`Episode` per rollout. An episode speaks text, never token ids: ``reset`` gives the first
messages, ``step`` takes the decoded text of the policy's turn and returns the messages to append
(a reply from the environment, role ``"user"``, or tool results, role ``"tool"``), this turn's
reward and whether the episode is over. Token bookkeeping (what is sampled, what is context, the
masks) is the driver's job (``posttrain/rollout/multiturn.py``), so an environment cannot cause
re-tokenization drift.

Rules every environment keeps:

- ``examples(split, n, seed)`` and every episode are deterministic: the same example gives the
  same first messages (the G episodes of a group share one prompt) and the same replies to the
  same actions.
- ``step`` never raises on bad policy output: an unparsable action or a malformed tool call is an
  observation (and ``info["format_errors"]`` / ``info["tool_errors"]``), usually with a penalty.
  An exception or a hang is a bug of the environment: the driver scores that episode ``None``,
  logs its transcript and the run goes on.
- ``info`` holds numbers only. Keys the driver reads: ``success`` (1.0 when the episode solved
  its problem: ``accuracy`` and ``episode/success``), ``final_reward`` (the episode's reward, when
  it is not the sum of the turn rewards), ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
  ``format_errors`` (summed into ``tools/*`` and ``episode/*`` metrics).
- ``state_key()`` names the observation the next action is taken from (GiGPO's anchor state);
  two episodes of a group in the same situation return the same key. ``None`` when it has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from posttrain.algorithms.registry import Registry
from posttrain.tasks.base import Example, Split

Message = dict[str, str]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": text}``."""


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one turn of the policy."""

    messages: tuple[Message, ...] = ()  # appended after the policy's turn; empty when done
    reward: float = 0.0  # this turn's reward
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)  # success, final_reward, tool_calls, ...


class Episode(Protocol):
    """One rollout's state machine."""

    def reset(self) -> list[Message]:
        """The first messages (system and/or user): the prompt the policy answers first."""
        ...

    def step(self, action: str) -> StepResult:
        """Take the policy's turn (its decoded text, special tokens skipped)."""
        ...

    def state_key(self) -> str | None:
        """The situation the next action is taken in (GiGPO's anchor state), or ``None``."""
        ...


class Environment(Protocol):
    """A registered environment, built once per run from ``[task.env] params``."""

    name: str
    alphabet: str  # every character its messages and a good policy's actions can contain (tiny tokenizer)
    max_turns: int  # its default turn limit (``[task.env] max_turns`` overrides it)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """``n`` problems of ``split``, deterministic in ``(split, n, seed)``; ``prompt`` is the first
        user message and ``demonstration`` a good first action.
        """
        ...

    def start(self, example: Example) -> Episode:
        """A fresh episode on ``example``."""
        ...

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """A whole transcript of a (possibly noisy) expert on ``example``: the first messages, then
        alternating assistant turns and the environment's replies, ending with the last assistant
        turn (for SFT warm-up).
        """
        ...


ENVS: Registry[type] = Registry("environment")
register = ENVS.register


def check_env_params(name: str, params: Mapping[str, object] | None = None) -> None:
    """Check ``params`` of environment ``name`` without building it (``[task.env]`` validation calls this, before
    any model loads): unknown names fail with the choices (an adapter whose constructor takes ``**kwargs``
    passes the rest on, to the game it wraps), then the class's own ``check_params(params)`` classmethod, when
    it has one, checks what only it knows (a wrapped game's id: ``envs/textarena_env.py``).
    """
    import inspect

    cls = ENVS.get(name)
    signature = inspect.signature(cls).parameters
    accepted = [p for p, v in signature.items() if v.kind is not v.VAR_KEYWORD]
    open_ended = len(accepted) < len(signature)
    for key in params or {}:
        if key not in accepted and not open_ended:
            raise ValueError(f"unknown parameter {key!r} for environment {name!r}; accepted: {', '.join(accepted)}")
    check = getattr(cls, "check_params", None)
    if check is not None:
        check(dict(params or {}))


def make_env(name: str, params: Mapping[str, object] | None = None) -> Environment:
    """Build environment ``name`` with ``params``, checked first (:func:`check_env_params`)."""
    check_env_params(name, params)
    return ENVS.get(name)(**dict(params or {}))
