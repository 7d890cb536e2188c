r"""Math answer extraction and equivalence (math-verify), and the ``math`` reward.

Equivalence is judged by Hugging Face's math-verify (``parse`` + ``verify``; it parses LaTeX and
plain expressions into SymPy and compares numerically, symbolically, as sets, intervals, ...).

Extraction (:func:`extract_answer`) reads the answer in this order: the last ``\boxed{}``, else the
last final-answer marker (``Answer: X``, ``#### X``, ...), else, when the text has LaTeX math
(``$...$``, ``\(...\)``, ``\[...\]``), math-verify's own extraction (``LatexExtractionConfig`` +
``ExprExtractionConfig``: the rightmost math span or plain number/expression that parses), else the
last number. So ``$\frac{6}{8}$`` is read as ``\frac{6}{8}``, not as its last number ``8``
(issue 15), while plain text keeps the last-number reading. math-verify's step runs under the same
time limit as the judgement (below).

Timeouts. math-verify's own timeouts use ``signal.alarm``, which raises ``ValueError`` off the
main thread, counts whole seconds only, starts afresh for every ``parse`` and every gold x pred
pair of ``verify`` (a "5 s" limit can take 30 s) and cancels any alarm set by the caller. So this
module turns math-verify's timeouts off (``parsing_timeout=None``, ``timeout_seconds=None``) and
sets its own: one ``SIGALRM`` interval timer (``setitimer``, fractions of a second) around the
whole judgement, re-armed every 50 ms after it first fires in case a library swallows the
interrupt, with the caller's handler and pending timer restored afterwards. When the interrupt
lands in a finalizer (a ``__del__`` or weakref callback inside SymPy), Python cannot raise it and
hands it to ``sys.unraisablehook``; while the timer is armed that hook is wrapped so our own
interrupt is dropped there (the next tick raises it again in ordinary code) and the hook itself is
never interrupted (an interrupted hook made pytest fail the run). The timer is used
only on the main thread of the process (where the reward pool calls rewards); on any other thread
the judgement runs without a timer rather than failing, and the caller (the pool, which kills a
worker that overruns) is what bounds it.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import TypeVar

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from posttrain.rewards.registry import register
from posttrain.tasks.answers import last_boxed

__all__ = ["extract_answer", "last_boxed", "math_equal", "math_reward", "math_verdict"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _NoTimeoutWarning(logging.Filter):
    """Drop math-verify's one-time "Timeout is disabled" warning: this module sets its own timer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------

# "The final answer is X", "Final answer: X", "Answer: X", "the answer is X"; X runs to end of line
_MARKER = re.compile(r"(?:final\s+answer\s*(?:is\s*:?|:)|\banswer\s*(?:is\s*:?|:))[ \t]*(.+)", re.IGNORECASE)
_GSM8K = re.compile(r"####[ \t]*(.+)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")
_LATEX_MATH = re.compile(r"(?<!\\)\$|\\\(|\\\[")  # $...$, $$...$$, \(...\), \[...\]; not \$ (currency)


def _clean_marker(tail: str) -> str:
    r"""The answer in the rest of a marker's line: a ``$...$`` / ``\(...\)`` span, else up to a sentence end."""
    tail = tail.strip().strip("*").strip()  # markdown bold: **Answer:** 5
    for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if tail.startswith(open_):
            end = tail.find(close, len(open_))
            if end > 0:
                return tail[len(open_) : end].strip()
    tail = re.split(r"\.(?:\s|$)", tail, maxsplit=1)[0]  # "... is 5. I hope it is correct."
    return tail.strip().rstrip(".").strip()


_MV_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]


def _math_verify_answer(text: str) -> str | None:
    r"""math-verify's own reading of ``text``: its rightmost LaTeX span or plain expression, if that parses.

    ``extraction_mode="first_match"`` tries that one candidate only, so the string returned is the
    one that parsed (with ``any_match`` math-verify may pair an earlier match's expression with the
    rightmost match's string); a rightmost candidate that does not parse gives ``None``. No
    math-verify timeout (it would be ``signal.alarm``): the caller bounds the call.
    """
    parsed = parse(
        text,
        extraction_config=_MV_EXTRACTION,
        extraction_mode="first_match",
        parsing_timeout=None,  # type: ignore[arg-type]  # None: no signal.alarm
    )
    if len(parsed) == 2 and isinstance(parsed[1], str) and parsed[1].strip():
        return parsed[1].strip()
    return None


def _extract(text: str, read_latex: Callable[[str], str | None]) -> str | None:
    """:func:`extract_answer`'s order, with ``read_latex`` (math-verify, bounded or not) as step 3."""
    if not text or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed:
        return boxed
    markers = [m for pat in (_MARKER, _GSM8K) for m in pat.finditer(text)]
    if markers:
        found = _clean_marker(max(markers, key=lambda m: m.start()).group(1))
        if found:
            return found
    if _LATEX_MATH.search(text):
        found = read_latex(text)
        if found:
            return found
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _math_verify_answer_within(text: str, timeout_s: float | None) -> str | None:
    """:func:`_math_verify_answer` stopped after ``timeout_s`` seconds (then ``None``)."""
    done, found = _call_with_time_limit(lambda: _math_verify_answer(text), timeout_s)
    if not done:
        log.debug("math-verify extraction ran past %.1f s on %.80r", timeout_s, text)
    return found if done else None


def extract_answer(text: str, *, timeout_s: float | None = 5.0) -> str | None:
    r"""The final answer in a completion, as a string; ``None`` when there is none.

    In order of preference:

    1. the last ``\boxed{...}`` or ``\fbox{...}`` (balanced braces, see :func:`last_boxed`);
    2. the last final-answer marker: ``The final answer is X``, ``Final answer: X``, ``Answer: X``,
       ``the answer is X`` (X: a ``$...$`` span, else the line up to the first sentence end), or
       GSM8K's ``#### X``; the one that comes last in the text wins;
    3. only when the text has LaTeX math (``$...$``, ``$$...$$``, ``\(...\)``, ``\[...\]``; not an
       escaped ``\$``): math-verify's extraction with ``LatexExtractionConfig`` and
       ``ExprExtractionConfig``, its rightmost candidate if that parses; past steps 1-2 that is
       whichever of the last math span and the last plain number/expression comes later
       (``$\frac{6}{8}$`` gives ``\frac{6}{8}``, not ``8``; ``$x=2$ ..., so the sum is 5.`` gives ``5``);
    4. the last number in the text (``-12``, ``1,000``, ``3.5``, ``3/4``): plain text, or step 3
       found nothing.

    Steps 1, 2 and 4 are hand-written regexes; step 3 parses with SymPy and so runs under a
    ``timeout_s`` limit (main thread only, see the module docstring); past it, step 3 is skipped.
    """
    return _extract(text, lambda t: _math_verify_answer_within(t, timeout_s))


# ----------------------------------------------------------------------------------------------
# Time limit (SIGALRM interval timer, main thread only)
# ----------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised by the timer; a ``BaseException`` so math-verify's ``except Exception`` lets it through."""


def _signals_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _call_with_time_limit(fn: Callable[[], T], seconds: float | None) -> tuple[bool, T | None]:
    """Run ``fn()``; return ``(True, result)``, or ``(False, None)`` when it ran past ``seconds``.

    Off the main thread (or with ``seconds`` None / <= 0) ``fn`` runs without a limit.
    """
    if seconds is None or seconds <= 0 or not _signals_usable():
        return True, fn()
    armed = [True]
    in_hook = [False]
    caller_hook = sys.unraisablehook

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        # not inside the hook, even on its very first bytecode (before `in_hook` is set)
        if armed[0] and not in_hook[0] and (frame is None or frame.f_code is not on_unraisable.__code__):
            raise _Timeout

    def on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
        in_hook[0] = True  # the first bytecode: from here on no tick can interrupt the hook
        try:
            if not isinstance(unraisable.exc_value, _Timeout):
                caller_hook(unraisable)
            # our own interrupt, lost in a finalizer: drop it; the next tick (50 ms) raises again
        finally:
            in_hook[0] = False

    try:
        old_handler = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # not the main interpreter
        return True, fn()
    sys.unraisablehook = on_unraisable
    # fire after `seconds`, then every 50 ms until disarmed (in case a library swallows one)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    t0 = time.monotonic()
    try:
        try:
            return True, fn()
        finally:
            armed[0] = False  # from here on the handler is a no-op, so cleanup cannot be interrupted
    except _Timeout:
        return False, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler if old_handler is not None else signal.SIG_DFL)
        sys.unraisablehook = caller_hook
        if old_delay > 0:  # the caller's own timer: give it back what is left (fire now if expired)
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-6), old_interval)


# ----------------------------------------------------------------------------------------------
# Equivalence
# ----------------------------------------------------------------------------------------------


def _as_math(s: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify's LaTeX extractor sees it; delimited text is kept."""
    s = s.strip()
    return s if _DELIMITED.search(s) else f"${s}$"


def _parse(s: str) -> list:
    return parse(_as_math(s), parsing_timeout=None)  # type: ignore[arg-type]  # None: no signal.alarm


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    # cached: a group of G completions shares one gold; an interrupted parse raises and is not cached
    return _parse(gold)


def _judge(pred: str, gold: str) -> bool | None:
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return None  # the gold itself does not parse: cannot judge
    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False
    # verify(gold, target) is asymmetric (assignments x=3 and equation intervals); gold goes first
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_verdict(pred: str, gold: str, *, timeout_s: float = 5.0) -> bool | None:
    r"""Whether answer ``pred`` equals ``gold`` by math-verify; ``None`` when it cannot be judged.

    ``None``: the judgement ran past ``timeout_s`` (main thread only, see the module docstring)
    or ``gold`` does not parse. Both are bare answers or delimited text (``"3"``,
    ``"\\frac{1}{2}"``, ``"$x=3$"``, ``"\\boxed{2}"``): a bare one is wrapped as ``$...$``. Give
    ``pred`` the extracted answer (:func:`extract_answer`), not a whole completion. An empty
    ``pred`` is ``False``.
    """
    if not pred or not pred.strip():
        return False
    done, result = _call_with_time_limit(lambda: _judge(pred, gold), timeout_s)
    if not done:
        log.debug("math-verify ran past %.1f s on pred %.80r gold %.80r", timeout_s, pred, gold)
        return None
    return result


def math_equal(pred: str, gold: str, *, timeout_s: float = 5.0) -> bool:
    r"""``True`` iff answer ``pred`` is mathematically equal to ``gold`` (math-verify).

    ``1/2`` = ``\\frac{1}{2}`` = ``0.5`` = ``50\\%``; ``x=3`` = ``3``; ``(1,2]`` = ``(1, 2]``;
    ``\\{1,2\\}`` = ``\\{2,1\\}``; ``1,000`` = ``1000``; ``5 \\text{ cm}`` = ``5``. A judgement that
    times out or a gold that does not parse is ``False`` (:func:`math_verdict` tells them apart).
    """
    return math_verdict(pred, gold, timeout_s=timeout_s) is True


@register("math")
def math_reward(
    prompt: str, completion: str, *, answer: object = None, timeout_s: float = 5.0, **_: object
) -> float | None:
    r"""Math correctness: ``1.0`` if the completion's final answer equals ``answer``, else ``0.0``.

    r = 1[math_verify(gold=answer, pred=extract_answer(completion))], the binary verifiable
    reward of RLVR (Tulu 3, arXiv 2411.15124; DeepSeek-R1, arXiv 2501.12948). The answer is the
    last ``\boxed{}``, else a final-answer marker, else (text with LaTeX math) math-verify's own
    extraction, else the last number (:func:`extract_answer`); no answer scores 0.0. ``None`` when
    the example has no ``answer``, when extraction and judgement together run past ``timeout_s``
    seconds (a hang, scored like one) or when the gold does not parse.
    """
    if answer is None:
        return None
    gold = str(answer)
    done, result = _call_with_time_limit(lambda: _score(completion, gold), timeout_s)
    if not done:
        log.debug("math reward ran past %.1f s on completion %.80r gold %.80r", timeout_s, completion, gold)
        return None
    return result


def _score(completion: str, gold: str) -> float | None:
    """:func:`math_reward` without its time limit: extraction (math-verify's step unbounded) then judgement."""
    pred = _extract(completion, _math_verify_answer)
    if pred is None or not pred.strip():
        return 0.0
    verdict = _judge(pred, gold)
    return None if verdict is None else float(verdict)
