"""Chat rows: a prompt column that holds ``messages``, and the ``tools`` / ``chat_template_kwargs`` columns.

A row's prompt value is either a string (one user turn, as always) or a list of ``{"role", "content"}``
messages: a system message, few-shot user and assistant turns, and the final user turn. A messages row
becomes an :class:`~posttrain.tasks.base.Example` whose ``messages`` are the turns and whose ``prompt``
is the last user turn's text (what rewards, logs, the hash split and the test-overlap check read); the
preset's transform runs on that text, and the last user turn takes its result (``mbpp``'s appended test
reaches the model inside the chat).

Two optional targets, read from the columns of the same name when a row has them (remap them with
``fields.tools = COLUMN``, unmap with ``fields.tools = null``), never reach the rewards as fields (a
reward reads them on ``example``): ``tools``, a list of OpenAI-style tool schemas (or its JSON text), and
``chat_template_kwargs``, an object of keyword arguments for the chat template (or its JSON text). The
data set's ``task.dataset.tools`` / ``task.dataset.chat_template_kwargs`` are defaults: a row's tools
replace them, a row's template kwargs are merged over them. Any of the three makes the row a chat row,
rendered by ``posttrain.models.chat.encode_example``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from posttrain.data.readers import DataError
from posttrain.models.chat import RESERVED_TEMPLATE_KWARGS
from posttrain.tasks.base import Example

CHAT_TARGETS = ("tools", "chat_template_kwargs")
"""Targets that configure the chat template, not the rewards."""

DEFAULT_CHAT_COLUMNS = {"tools": "tools", "chat_template_kwargs": "chat_template_kwargs"}
"""Read when present, in every preset."""


def _json(value: object, target: str, where: str) -> object:
    """A JSON text cell (CSV, some hub data sets) as its value; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: field {target!r} is text that is not JSON ({e.msg}): {value[:80]!r}") from None


def parse_messages(value: object, where: str) -> list[dict]:
    """``value`` as chat messages: a non-empty list of objects with a string ``role``, at least one user
    turn with string ``content``, and not ending in an assistant turn (the model writes that one).

    Raises:
        DataError: anything else, naming the row and the offending message.

    """
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: the prompt must be text or a non-empty list of messages, got {value!r:.80}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: message {i} must be an object with a string 'role', got {m!r:.80}")
    users = [m for m in value if m["role"] == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise DataError(f"{where}: the messages need a final user turn with text content; roles: "
                        f"{[m['role'] for m in value]}")
    if value[-1]["role"] == "assistant":
        raise DataError(f"{where}: the messages end with an assistant turn; the prompt ends where the model "
                        "answers (put the reference reply in the demonstration column)")
    return [dict(m) for m in value]


def parse_tools(value: object, where: str) -> list[dict]:
    """``value`` as a list of tool schemas (objects), from a list or its JSON text."""
    tools = _json(value, "tools", where)
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of tool schemas (objects), got {value!r:.80}")
    return [dict(t) for t in tools]


def parse_template_kwargs(value: object, where: str) -> dict:
    """``value`` as chat-template keyword arguments, from an object or its JSON text; posttrain's own
    arguments (``tools``, ``add_generation_prompt``, ``tokenize``, ...) are refused.
    """
    kwargs = _json(value, "chat_template_kwargs", where)
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise DataError(f"{where}: chat_template_kwargs must be an object, got {value!r:.80}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise DataError(f"{where}: chat_template_kwargs may not set {reserved}: posttrain sets them itself "
                        "(tools come from the tools field)")
    return dict(kwargs)


def split_chat(mapped: Mapping[str, object], where: str) -> tuple[dict[str, object], dict[str, object]]:
    """Take the chat parts out of a mapped row: ``(row for the preset, {messages, tools, kwargs})``.

    The row for the preset has the last user turn's text as its ``prompt`` and no chat targets.
    """
    row = {k: v for k, v in mapped.items() if k not in CHAT_TARGETS}
    chat: dict[str, object] = {}
    if isinstance(row.get("prompt"), list):
        chat["messages"] = parse_messages(row["prompt"], where)
        row["prompt"] = [m for m in chat["messages"] if m["role"] == "user"][-1]["content"]
    if mapped.get("tools") is not None:
        chat["tools"] = parse_tools(mapped["tools"], where)
    if mapped.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = parse_template_kwargs(mapped["chat_template_kwargs"], where)
    return row, chat


def attach_chat(example: Example, chat: Mapping[str, object]) -> Example:
    """``example`` (built by the preset from the last user turn) with the row's chat parts; the last user
    turn becomes the preset's prompt.
    """
    if not chat:
        return example
    messages = chat.get("messages")
    if isinstance(messages, list):
        turns = [dict(m) for m in messages]
        last = max(i for i, m in enumerate(turns) if m["role"] == "user")
        turns[last]["content"] = example.prompt
        messages = turns
    return replace(example, messages=messages, tools=chat.get("tools"),  # type: ignore[arg-type]
                   chat_template_kwargs=chat.get("chat_template_kwargs"))  # type: ignore[arg-type]


def with_defaults(
    examples: Sequence[Example], tools: Sequence[Mapping] | None, kwargs: Mapping[str, object] | None
) -> list[Example]:
    """The data set's default tools and template kwargs applied to ``examples`` (module docstring)."""
    if not tools and not kwargs:
        return list(examples)
    out = []
    for ex in examples:
        merged = {**(kwargs or {}), **(ex.chat_template_kwargs or {})}
        out.append(replace(ex, tools=ex.tools if ex.tools is not None else (list(tools) if tools else None),
                           chat_template_kwargs=merged or None))
    return out


def chat_texts(example: Example) -> list[str]:
    """The texts a chat example adds to what the model reads (message contents, tool schemas as JSON),
    for the task's alphabet (a character-level tokenizer must spell them).
    """
    texts = [m["content"] for m in example.messages or [] if isinstance(m.get("content"), str)]
    if example.tools:
        texts.append(json.dumps(list(example.tools)))
    return texts
