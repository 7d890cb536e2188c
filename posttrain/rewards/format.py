r"""Format rewards: does the completion follow a tag layout (``<think>...</think><answer>...</answer>``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from posttrain.rewards.registry import register

__all__ = ["extract_tag", "format_reward", "has_tags"]


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last complete ``<tag>...</tag>`` in ``text``, stripped; ``None`` if there is none.

    The last one, as RLCR's code reads ``<answer>`` and ``<confidence>`` (a model that restates
    its answer is judged by its final statement). Content may span lines.
    """
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return found[-1].strip() if found else None


def has_tags(text: str, tags: Sequence[str]) -> bool:
    """Each ``<t>...</t>`` of ``tags`` appears exactly once, the blocks in the given order, not overlapping.

    Text before, between and after the blocks is allowed (RLCR's layout lets the reasoning run
    before ``</think>``); use a ``pattern`` in :func:`format_reward` to forbid it.
    """
    pos = 0
    for tag in tags:
        open_, close = f"<{tag}>", f"</{tag}>"
        if text.count(open_) != 1 or text.count(close) != 1:
            return False
        start, end = text.find(open_), text.find(close)
        if start < pos or end < start + len(open_):
            return False
        pos = end + len(close)
    return True


# R1 layout: only whitespace around and between the two blocks, and neither block holds another tag
_BLOCK = r"(?:(?!</?think>|</?answer>).)*"
R1_PATTERN = rf"\s*<think>{_BLOCK}</think>\s*<answer>{_BLOCK}</answer>\s*"


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


@register("format")
def format_reward(
    prompt: str, completion: str, *, pattern: str | None = None, tags: Sequence[str] | None = None, **_: object
) -> float:
    r"""Format reward: ``1.0`` if the completion has the required layout, else ``0.0``.

    - default: DeepSeek-R1's ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else
      but whitespace (arXiv 2501.12948, section 2.2.2 "format rewards"); each block holds no other
      ``think`` / ``answer`` tag (:data:`R1_PATTERN`);
    - ``pattern``: a regular expression that must match the whole completion (``re.fullmatch``
      with ``re.DOTALL``); e.g. ``"<think>.*?</think>\\s*<answer>.*?</answer>"``;
    - ``tags``: tag names whose blocks must each appear exactly once, in this order, other text
      allowed around them (:func:`has_tags`), e.g. ``["answer", "analysis", "confidence"]``.

    A model whose chat template already opens ``<think>`` in the prompt needs a ``pattern`` or
    ``tags`` without the opening tag. ``pattern`` and ``tags`` together are an error.
    """
    if pattern is not None and tags is not None:
        raise ValueError("format reward: give `pattern` or `tags`, not both")
    if tags is not None:
        if isinstance(tags, str):
            raise TypeError("format reward: `tags` is a list of tag names, e.g. ['think', 'answer']")
        return float(has_tags(completion, tags))
    return float(_compiled(pattern if pattern is not None else R1_PATTERN).fullmatch(completion) is not None)
