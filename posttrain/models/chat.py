"""Chat prompts: the one function every driver, evaluation and SFT renders an example's prompt with.

:func:`encode_example` gives the token ids the model sees for an :class:`~posttrain.tasks.base.Example`:

- a one-turn example (``messages``, ``tools`` and ``chat_template_kwargs`` all unset) goes through
  :func:`~posttrain.models.load.encode_chat` exactly as before: ``[system?, user]`` through the chat
  template, byte-identical token ids;
- a chat example renders ``apply_chat_template(messages, tools=tools, add_generation_prompt=True,
  **chat_template_kwargs)``, its messages being the row's turns (or ``[user]`` with ``prompt`` when the
  row has tools or template kwargs but no messages).

``task.system_prompt`` and a row's own system message: the row wins. The system prompt goes in front
only of the rows whose messages hold no ``system`` turn, so a data set can mix rows that bring their own
system message with rows that take the run's default (as the multi-turn environments do,
``posttrain/envs/task.py``).

A template that cannot render a chat row is a :class:`ChatRenderError` (a ``ConfigError``), raised at
set-up by :func:`check_chat_examples`: one that raises, one without a chat template at all, and one that
silently drops what the row gave it (the tools, or any of the turns: rendering without them gives the
same text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from posttrain.errors import ConfigError
from posttrain.models.load import encode_chat
from posttrain.tasks.base import Example

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
     "return_dict", "return_tensors", "padding", "truncation", "max_length"}
)
"""Arguments of ``apply_chat_template`` that posttrain sets itself: not allowed in ``chat_template_kwargs``."""


class ChatRenderError(ConfigError):
    """The tokenizer's chat template cannot render a chat example as given; the message names the
    example and what failed.
    """


def is_chat(example: Example) -> bool:
    """Whether ``example`` needs the chat path (messages, tools or template kwargs), not ``encode_chat``."""
    return example.messages is not None or bool(example.tools) or bool(example.chat_template_kwargs)


def example_messages(example: Example, system: str | None = None) -> list[dict]:
    """The turns the chat template gets: the row's messages (or ``[user: prompt]``), with ``system`` in
    front when they hold no system message (the row's own wins; module docstring).
    """
    turns = [dict(m) for m in example.messages] if example.messages is not None else [
        {"role": "user", "content": example.prompt}]
    if system and not any(m.get("role") == "system" for m in turns):
        turns.insert(0, {"role": "system", "content": system})
    return turns


def _describe(example: Example) -> str:
    return f"the example whose last user turn is {example.prompt[:60]!r}"


def _template(tokenizer: object, turns: list[dict], tools: Sequence[Mapping] | None, kwargs: Mapping) -> str:
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        turns, tools=[dict(t) for t in tools] if tools else None, add_generation_prompt=True, tokenize=False,
        **kwargs)


def render_example(tokenizer: object, example: Example, system: str | None = None) -> str:
    """The chat prompt's text of a chat example (:func:`is_chat`) through the tokenizer's template.

    Raises:
        ChatRenderError: the tokenizer has no chat template, or the template raised.

    """
    if not getattr(tokenizer, "chat_template", None) and "chat_template" not in (example.chat_template_kwargs or {}):
        raise ChatRenderError(
            f"{_describe(example)} is a chat row (messages, tools or chat_template_kwargs), and the tokenizer has "
            "no chat template to render it; use a tokenizer with one (an instruct model's)")
    try:
        return _template(tokenizer, example_messages(example, system), example.tools,
                         example.chat_template_kwargs or {})
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja errors, TypeError, ...)
        raise ChatRenderError(f"the chat template cannot render {_describe(example)}: {type(e).__name__}: {e}") from e


def encode_example(tokenizer: object, example: Example, system: str | None = None) -> list[int]:
    """Token ids of ``example``'s prompt (module docstring): ``encode_chat`` for a one-turn example, the
    rendered chat (tokenized without special tokens, like ``encode_chat``) for a chat example.
    """
    if not is_chat(example):
        return encode_chat(tokenizer, example.prompt, system)  # type: ignore[arg-type]
    text = render_example(tokenizer, example, system)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def with_user_text(example: Example, text: str) -> Example:
    """``example`` asking ``text`` instead: its ``prompt`` and, for a messages row, its final user turn
    (HINT's hinted question keeps the row's system message and few-shot turns).
    """
    if example.messages is None:
        return replace(example, prompt=text)
    turns = [dict(m) for m in example.messages]
    last = max(i for i, m in enumerate(turns) if m.get("role") == "user")
    turns[last]["content"] = text
    return replace(example, prompt=text, messages=turns)


def dropped_parts(tokenizer: object, example: Example, system: str | None = None) -> list[str]:
    """What the template leaves out of ``example``'s prompt: ``"tools"`` when rendering without them
    gives the same text, ``"<role> turn <i>"`` for each turn whose removal changes nothing. A removal
    the template refuses (e.g. roles that must alternate) counts as rendered.
    """
    turns = example_messages(example, system)
    kwargs = example.chat_template_kwargs or {}
    full = _template(tokenizer, turns, example.tools, kwargs)
    variants: list[tuple[str, list[dict], Sequence[Mapping] | None]] = []
    if example.tools:
        variants.append(("tools", turns, None))
    variants += [(f"{m.get('role')} turn {i}", turns[:i] + turns[i + 1:], example.tools) for i, m in enumerate(turns)]
    out = []
    for what, less, tools in variants:
        try:
            same = _template(tokenizer, less, tools, kwargs) == full
        except Exception:  # noqa: BLE001 - the template looked at what was removed
            same = False
        if same:
            out.append(what)
    return out


def check_chat_examples(
    tokenizer: object, pools: Mapping[str, Sequence[Example]], system: str | None = None, first: int = 8
) -> int:
    """Render the first ``first`` chat examples of each pool once, before any training: a template that
    raises or drops the rows' tools or turns is a :class:`ChatRenderError` naming the pool, the row and
    what failed. Returns how many examples were checked (0: no chat rows, nothing to check).
    """
    checked = 0
    for split, pool in pools.items():
        chats = [(i, ex) for i, ex in enumerate(pool) if is_chat(ex)][:first]
        for i, ex in chats:
            where = f"task.dataset: {split} example {i} ({_describe(ex)})"
            try:
                render_example(tokenizer, ex, system)
            except ChatRenderError as e:
                raise ChatRenderError(f"{where}: {e}") from e
            lost = dropped_parts(tokenizer, ex, system)
            if lost:
                raise ChatRenderError(
                    f"{where}: the tokenizer's chat template silently drops {', '.join(lost)} (rendering without "
                    "them gives the same text); use a template that renders them (chat_template_kwargs.chat_template "
                    "= '...' names one), or remove them from the data")
            checked += 1
    return checked


__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "ChatRenderError",
    "check_chat_examples",
    "dropped_parts",
    "encode_example",
    "example_messages",
    "is_chat",
    "render_example",
    "with_user_text",
]
