r"""CRM / CRF: a conciseness score c that pays only on correct answers (Conciseness Reward Function).

Wang et al., "Efficient Reasoning via Reward Model", arXiv:2511.09158 (a withdrawn ICLR 2026 submission),
seed ``papers/004_f298e9ec572f7f27.txt:195`` (catalog L195). The paper trains a Conciseness Reward Model (CRM,
a 3B model scoring a reasoning path's conciseness in [0.1, 1]) and rewards

    R^_i = R^o_i * [1 + alpha * c_i * (s + d_q)]

with R^o_i the outcome (verifier) reward, c_i the CRM's score, s an annealing coefficient and d_q the
question's difficulty factor (the formula as the public reviews render it; the code, on
anonymous.4open.science, is not stored). The bonus is a factor of the outcome, so a wrong answer
(R^o = 0) gets nothing for being short: the length collapse of an additive length penalty (short wrong
answers still paid) has no reward to climb.

Here:

- ``conciseness_length``: a length proxy for c, one completion at a time: c = clamp(1 - n / max_chars,
  0.1, 1), n the completion's characters (a reward sees text, not tokens), on the CRM's [0.1, 1] scale.
- ``crf``: the CRF over two named reward components, ``outcome`` (default the task's verifier) and
  ``conciseness`` (default the proxy; a trained CRM is ``reward_model`` with its ``path``). It scores the
  batch with both (:func:`posttrain.rewards.score_batch`, in this process) and combines them per completion.

The CRM itself: ``posttrain rm`` with ``rm.pairs = "file"`` and (prompt, chosen = the concise solution,
rejected = the redundant one) pairs trains a Bradley-Terry conciseness ranker that ``reward_model`` loads;
its score is a logit, so ``c_transform = "sigmoid"`` maps it onto [0.1, 1]. The paper fine-tunes its CRM on
pointwise 0.1-1 scores from a 72B judge instead (not built here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from posttrain.rewards import Outcome, score_batch
from posttrain.rewards.registry import REGISTRY, register

__all__ = ["C_MAX", "C_MIN", "component_params", "crf_reward", "crf_value", "length_conciseness"]

C_MIN, C_MAX = 0.1, 1.0
"""The CRM's score range (the paper's judge scores conciseness from 0.1 to 1)."""


@register("conciseness_length")
def length_conciseness(prompt: str, completion: str, *, max_chars: int = 2000, **_: object) -> float:
    """A length proxy for the CRM's conciseness score: c = clamp(1 - n / max_chars, 0.1, 1), n = len(completion).

    Example: ``max_chars = 1000``: 100 characters -> 0.9, 400 -> 0.6, 950 -> 0.1 (clamped from 0.05).
    Seed ``papers/004_f298e9ec572f7f27.txt:195`` (catalog L195); not the paper's CRM, which judges redundancy
    (repeated checks, irrelevant steps), not length alone.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be > 0; got {max_chars}")
    return min(C_MAX, max(C_MIN, 1.0 - len(completion) / max_chars))


def crf_value(outcome: float, c: float, *, alpha: float, s: float, d: float) -> float:
    """R^ = R^o * [1 + alpha * c * (s + d)] (one completion; see :func:`crf_reward`)."""
    return outcome * (1.0 + alpha * c * (s + d))


def _conciseness(raw: float, transform: str) -> float:
    """The conciseness score c on the CRM's [0.1, 1] scale: ``clamp`` a score already on it; ``sigmoid``: a BT logit."""
    if transform == "sigmoid":
        return C_MIN + (C_MAX - C_MIN) / (1.0 + math.exp(-raw))
    return min(C_MAX, max(C_MIN, raw))


def _difficulty(row: Mapping[str, object], field: str | None, scale: float) -> float:
    """d_q: the example's ``field`` divided by ``scale`` (e.g. DeepMath-103K's 1-10 ``difficulty`` over 10); 0
    without a field. A missing or non-numeric value counts 0.
    """
    if field is None:
        return 0.0
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) / scale


@register("crf")
def crf_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    outcome: str = "task",
    conciseness: str = "conciseness_length",
    alpha: float = 1.0,
    s: float = 1.0,
    difficulty_field: str | None = None,
    difficulty_scale: float = 1.0,
    c_transform: Literal["clamp", "sigmoid"] = "clamp",
    **params_and_fields: object,
) -> list[float | Outcome]:
    """CRF (Conciseness Reward Function): R^_i = R^o_i * [1 + alpha * c_i * (s + d_q)], a batched reward.

    R^o_i is reward ``outcome``, c_i reward ``conciseness`` put on [0.1, 1] by ``c_transform``; a parameter
    ``outcome_KEY`` / ``conciseness_KEY`` is the component's parameter ``KEY`` (``conciseness_path = "..."``,
    ``conciseness_max_chars = 800``: recipe params are flat), the rest are the example's fields; s = ``s`` and
    d_q = the example's field ``difficulty_field`` / ``difficulty_scale`` (0 without one; e.g. DeepMath-103K's
    ``difficulty``, 1-10, over 10). The example's fields arrive as keyword columns too, so none may be named like a
    parameter or start with ``outcome_`` / ``conciseness_``. Both components score the whole batch here, in this
    process (a batched one, such as a CRM loaded by ``reward_model``, in one call); a completion that either
    cannot score is an error (``None``), with that component's reason. Paper: Wang et al.,
    arXiv:2511.09158, seed ``papers/004_f298e9ec572f7f27.txt:195`` (catalog L195). **Provisional**: the form is
    the reviews' rendering; the paper's alpha, its schedule for s (an annealing coefficient; here a constant,
    since a reward does not see the step) and its d_q are not pinned (defaults alpha = s = 1, d_q = 0). A
    per-completion component runs here without the reward pool's per-call timeout (``math`` bounds itself with
    its ``timeout_s``).

    Example: outcomes [1, 1, 0, 0], c [0.9, 0.6, 0.9, 0.1], alpha = s = 1, d_q = 0 -> [1.9, 1.6, 0, 0]; with
    d_q = 0.5, the first is 1 * (1 + 0.9 * 1.5) = 2.35. The gate: R^o = 0 gives 0 whatever c is, where an
    additive r + alpha c pays a short wrong answer alpha c. With R^o in {0, 1} and alpha (s + d_q) >= 0, every
    correct answer (>= 1) still outranks every wrong one. Nearest neighbour: ``traac_length`` (a shaper) adds a
    length bonus to correct answers only, from the group's pass rate and a length history, not a scorer's c.
    """
    for name in (outcome, conciseness):
        if name == "crf":
            raise ValueError("crf cannot score its own components with crf")
    if any(isinstance(v, list) for v in (outcome, conciseness, alpha, s, difficulty_field, difficulty_scale)):
        raise ValueError("an example field is named like a crf parameter (outcome, conciseness, alpha, s, "
                         "difficulty_field, difficulty_scale): rename the field")
    own, fields = component_params(params_and_fields)
    rows = [{k: col[i] for k, col in fields.items()} for i in range(len(completions))]
    report = score_batch([(outcome, own["outcome"]), (conciseness, own["conciseness"])], prompts, completions, rows)
    out: list[float | Outcome] = []
    for i, (r, c) in enumerate(zip(*report.values, strict=True)):
        if r is None or c is None:
            which = outcome if r is None else conciseness
            out.append(Outcome(None, "error", f"component {which!r} could not score: {_why(report, which, i)}"))
            continue
        d = _difficulty(rows[i], difficulty_field, difficulty_scale)
        out.append(crf_value(r, _conciseness(c, c_transform), alpha=alpha, s=s, d=d))
    return out


COMPONENTS = ("outcome", "conciseness")


def component_params(kwargs: Mapping[str, object]) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    """({"outcome": its params, "conciseness": its params}, the rest): ``outcome_KEY`` / ``conciseness_KEY`` -> KEY."""
    own: dict[str, dict[str, object]] = {c: {} for c in COMPONENTS}
    rest: dict[str, object] = {}
    for key, value in kwargs.items():
        comp = next((c for c in COMPONENTS if key.startswith(f"{c}_")), None)
        if comp is None:
            rest[key] = value
        else:
            own[comp][key[len(comp) + 1:]] = value
    return own, rest


def _why(report: object, name: str, index: int) -> str:
    """The failure message of component ``name`` on completion ``index`` ("returned None" when it has none)."""
    for f in report.failures:
        if f["reward"] == name and f["index"] == index:
            return f"{f['status']}: {f['message']}"
    return "returned None"


def check(params: Mapping[str, object]) -> None:
    """Config time, loading nothing: the components are registered rewards other than ``crf`` whose own
    checks pass, ``c_transform`` is known and ``difficulty_scale`` is positive.
    """
    own, rest = component_params(params)
    for key, default in (("outcome", "task"), ("conciseness", "conciseness_length")):
        name = rest.get(key, default)
        if name == "crf" or name not in REGISTRY:
            raise ValueError(f"{key} = {name!r}: need a registered reward other than 'crf'; "
                             f"choices: {[n for n in REGISTRY.names() if n != 'crf']}")
        sub = getattr(REGISTRY.get(name), "check", None)
        if sub is not None:
            sub(own[key])
    unknown = sorted(set(rest) - {"outcome", "conciseness", "alpha", "s", "difficulty_field", "difficulty_scale",
                                  "c_transform"})
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; a component's own go as outcome_KEY / conciseness_KEY")
    if params.get("c_transform", "clamp") not in ("clamp", "sigmoid"):
        raise ValueError(f"c_transform = {params['c_transform']!r}: choose 'clamp' or 'sigmoid'")
    if float(params.get("difficulty_scale", 1.0)) <= 0:
        raise ValueError(f"difficulty_scale must be > 0; got {params['difficulty_scale']}")


crf_reward.batched = True  # type: ignore[attr-defined]  # scores the batch in the trainer's process
crf_reward.check = check  # type: ignore[attr-defined]  # config time: loads nothing
