"""The llm_judge reward's rubrics and parsers: how a judge is asked, and how its text becomes a reward.

Pure text in, number out; shared by the local judge (a model through the rollout engine) and the
OpenAI-compatible one (:mod:`posttrain.rewards.judge`, whose docstring gives the modes and the papers).
"""

from __future__ import annotations

import math
import re
import string
from typing import Literal

from posttrain.errors import ConfigError

PLACEHOLDERS = ("prompt", "completion", "answer")
PARSES = ("yes_no", "score", "regex")
Parse = Literal["yes_no", "score", "regex"]

YES_NO_RUBRIC = (
    "Please act as an impartial judge of the response an AI assistant gave to the task below.\n\n"
    "[Task]\n{prompt}\n\n[Reference answer (may be empty)]\n{answer}\n\n"
    "[The Start of the Response]\n{completion}\n[The End of the Response]\n\n"
    "Is the response a correct and helpful answer to the task? Answer with one word: Yes or No."
)
# <MIN> and <MAX> are filled in from min_score / max_score by default_rubric
SCORE_RUBRIC = (
    "Please act as an impartial judge and evaluate the quality of the response an AI assistant gave to "
    "the task below, considering its correctness, helpfulness and clarity.\n\n"
    "[Task]\n{prompt}\n\n[Reference answer (may be empty)]\n{answer}\n\n"
    "[The Start of the Response]\n{completion}\n[The End of the Response]\n\n"
    "Rate the response on a scale of <MIN> to <MAX> (<MIN>: wrong or useless, <MAX>: correct and complete). "
    'Reply with the rating only, strictly in this format: "Rating: [[N]]".'
)

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_BRACKETED = re.compile(r"\[\[\s*(-?\d+(?:\.\d+)?)\s*\]\]")
# a number, with an optional "/ M" or "out of M" after it that is consumed (so it is never "the last number")
_NUMBER = re.compile(r"((?:(?<![\w.-])-)?\d+(?:\.\d+)?)(?:\s*(?:/|out of)\s*\d+(?:\.\d+)?)?", re.IGNORECASE)


def parse_yes_no(text: str) -> float | None:
    """1.0 when the first whole word "yes"/"no" of ``text`` (any case) is "yes", 0.0 when "no", else ``None``."""
    m = _YES_NO.search(text)
    return None if m is None else float(m.group(1).lower() == "yes")


def normalize(value: float, min_score: float, max_score: float) -> float | None:
    """(value - min) / (max - min) for a finite value in [min, max], else ``None``."""
    if not math.isfinite(value) or not min_score <= value <= max_score:
        return None
    return (value - min_score) / (max_score - min_score)


def parse_score(text: str, min_score: float = 0.0, max_score: float = 10.0) -> float | None:
    """The last ``[[s]]`` of ``text``, else its last number ("7/10", "7 out of 10": 7), normalized
    to [0, 1] by :func:`normalize`; ``None`` when there is none or it is out of range.
    """
    found = _BRACKETED.findall(text)
    if not found:
        found = [m.group(1) for m in _NUMBER.finditer(text)]
    if not found:
        return None
    return normalize(float(found[-1]), min_score, max_score)


def parse_regex(text: str, pattern: re.Pattern[str], min_score: float, max_score: float) -> float | None:
    """Group 1 (else the whole match) of the last match of ``pattern``, as a number normalized by
    :func:`normalize`; ``None`` without a match, for a non-number or out of range.
    """
    last = None
    for last in pattern.finditer(text):  # noqa: B007 - only the last match is read
        pass
    if last is None:
        return None
    try:
        value = float(last.group(1) if pattern.groups else last.group(0))
    except (TypeError, ValueError):
        return None
    return normalize(value, min_score, max_score)


def default_rubric(parse: Parse, min_score: float, max_score: float) -> str:
    """The built-in rubric of a parse mode: a Yes/No question, or a rating on [min_score, max_score]."""
    if parse == "yes_no":
        return YES_NO_RUBRIC
    return SCORE_RUBRIC.replace("<MIN>", f"{min_score:g}").replace("<MAX>", f"{max_score:g}")


def check_rubric(rubric: str) -> None:
    """Raise :class:`ConfigError` for a rubric that is not a template over :data:`PLACEHOLDERS`."""
    key = "llm_judge's params.rubric"
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None]
    except ValueError as e:
        raise ConfigError(f"{key}: not a valid template ({e}); write a literal brace as {{{{ or }}}}") from e
    bad = [n for n in names if n not in PLACEHOLDERS]
    if bad:
        raise ConfigError(f"{key}: unknown placeholder(s) {['{' + n + '}' for n in bad]}; a rubric may use "
                          f"{['{' + n + '}' for n in PLACEHOLDERS]} (a literal brace is {{{{ or }}}})")


def render(rubric: str, prompt: str, completion: str, answer: object = None) -> str:
    """The judge's user message for one pair (``answer=None`` renders as the empty string)."""
    return rubric.format(prompt=prompt, completion=completion, answer="" if answer is None else str(answer))
