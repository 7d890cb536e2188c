r"""RLCR's calibration reward: correctness plus a Brier score on the verbalized confidence.

Damani et al., "Beyond Binary Rewards: Training LMs to Reason About Their Uncertainty",
arXiv 2507.16806 (code: damanimehul/RLCR ``reward_fns.py``). The model ends its completion with
``<answer>...</answer>`` and ``<confidence>q</confidence>``; the Brier term is a bounded proper
scoring rule, so the expected reward is maximised by the q that equals the probability of being
right.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from posttrain.rewards.format import extract_tag, has_tags
from posttrain.rewards.math import extract_answer, last_boxed, math_verdict
from posttrain.rewards.registry import register

__all__ = ["calibration_reward", "parse_confidence"]

_PROBABILITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(%?)")


def parse_confidence(text: str) -> float | None:
    """The verbalized confidence q in [0, 1] from the last ``<confidence>...</confidence>``; else ``None``.

    Accepted contents: a number in [0, 1] (``0.8``, ``.8``, ``1``) or a percentage with an explicit
    ``%`` in [0 %, 100 %] (``80%`` -> 0.8; models often write it, and the sign makes it
    unambiguous). ``None`` for no tag, an empty or non-numeric tag, ``nan``/``inf``, or a value
    out of range: a bare ``80`` is rejected, not rescaled, as RLCR's code rejects any q outside
    [0, 1] (its format check fails).
    """
    content = extract_tag(text, "confidence")
    if content is None:
        return None
    m = _PROBABILITY.fullmatch(content)
    if m is None:
        return None
    q = float(m.group(1)) / (100.0 if m.group(2) else 1.0)
    return q if 0.0 <= q <= 1.0 else None


def _correct(completion: str, gold: str, timeout_s: float) -> float | None:
    r"""1.0 / 0.0: the ``<answer>`` content (its ``\boxed{}`` if any) or, with no tag, :func:`extract_answer`."""
    tagged = extract_tag(completion, "answer")
    pred = (last_boxed(tagged) or tagged) if tagged is not None else extract_answer(completion)
    if not pred:
        return 0.0
    verdict = math_verdict(pred, gold, timeout_s=timeout_s)
    return None if verdict is None else float(verdict)


@register("calibration")
def calibration_reward(
    prompt: str,
    completion: str,
    *,
    answer: object = None,
    form: Literal["paper", "code"] = "paper",
    on_parse_failure: Literal["zero_confidence", "none", "penalty"] = "zero_confidence",
    penalty: float = -1.0,
    format_tags: Sequence[str] = ("answer", "analysis", "confidence"),
    timeout_s: float = 5.0,
    **_: object,
) -> float | None:
    r"""RLCR reward (arXiv 2507.16806; seed ``papers/004_f298e9ec572f7f27.txt:143``):
    correctness c in {0, 1} plus a Brier score on confidence q.

    - ``form="paper"`` (the paper's reward): R = c - (q - c)^2, in [-1, 1].
    - ``form="code"`` (RLCR ``reward_fns.py``, weights 0.5/0.5/0.5 in ``configs/*/RLCR.yaml``):
      R = 0.5 format + 0.5 accuracy + 0.5 brier, brier = 1 - (c - q)^2, in [0.5, 1.5] when the
      format holds. Format = the ``format_tags`` blocks each once, in order (:func:`has_tags`;
      RLCR's math layout is answer, analysis, confidence) and a valid q.

    Worked numbers, (c, q) -> paper / code: (1, 0.8) -> 0.96 / 1.48; (0, 0.8) -> -0.64 / 0.68;
    (1, 0.3) -> 0.51 / 1.255; (0, 0.1) -> -0.01 / 0.995.

    c: math-verify equivalence of the last ``<answer>`` block (its ``\boxed{}`` when it has one)
    with ``answer``; without an answer tag, :func:`~posttrain.rewards.math.extract_answer` on the
    whole completion (paper form; the code form fails the format instead). q:
    :func:`parse_confidence`.

    A parse failure (paper: no valid q; code: the format check fails) is scored by
    ``on_parse_failure``:

    - ``"zero_confidence"`` (default): as if the model had said q = 0. Paper: R = c - c^2 = 0 for
      either c, so leaving q out never beats stating it (a stated q earns >= 0 when right and
      0 at q = 0 when wrong). Code: exactly RLCR's code, which zeroes format, accuracy and brier
      when the format fails: R = 0.
    - ``"none"``: ``None`` (not scored; the trainer counts and logs it).
    - ``"penalty"``: R = ``penalty`` (default -1, the paper form's worst well-formed score,
      confidently wrong at q = 1; below every code-form score too).

    ``None`` also when the example has no ``answer`` or math-verify runs past ``timeout_s``.
    """
    if form not in ("paper", "code"):
        raise ValueError(f"calibration reward: form must be 'paper' or 'code', got {form!r}")
    if on_parse_failure not in ("zero_confidence", "none", "penalty"):
        raise ValueError(
            f"calibration reward: on_parse_failure must be 'zero_confidence', 'none' or 'penalty', "
            f"got {on_parse_failure!r}"
        )
    if answer is None:
        return None
    q = parse_confidence(completion)
    if q is None or (form == "code" and not has_tags(completion, format_tags)):
        return {"zero_confidence": 0.0, "none": None, "penalty": float(penalty)}[on_parse_failure]
    c = _correct(completion, str(answer), timeout_s)
    if c is None:
        return None
    if form == "paper":
        return c - (q - c) ** 2
    return 0.5 * 1.0 + 0.5 * c + 0.5 * (1.0 - (c - q) ** 2)
