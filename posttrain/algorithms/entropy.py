"""Entropy regularizers: logits ``[N, T, V]`` -> per-token loss term ``[N, T]``.

Contract: ``compute(name, logits, **params) -> [N, T]``, a term to *add* to the per-token policy
loss before aggregation (so a bonus is negative: -coef * H). Unmasked, like ``kl.estimate``;
aggregation applies the mask. ``token_entropy`` and ``clamped_entropy`` are the plain
functions, for metrics; :func:`measure` gives the entropy H_t an entry regularizes (its term is
-coef H_t).

Stateful entries follow the contract of ``posttrain.algorithms.stateful``: AEnt's adaptive
coefficient lives in an explicit :class:`AEntState` (``None``: not advanced yet), read by the
entry through ``state=`` and advanced after each step by the pure
``aent_update_state(state, entropy, ...)``, where ``entropy`` is the batch's token-mean of
:func:`measure` (the clamped entropy). The loop carries the state in its checkpointed loop state::

    term_NT = entropy.compute("aent", logits, state=st)
    st = entropy.aent_update_state(st, float((entropy.measure("aent", logits) * mask).sum() / mask.sum()))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("entropy regularizer")
register = REGISTRY.register
names = REGISTRY.names


def compute(name: str, logits: Tensor, **params: object) -> Tensor:
    """Look up regularizer ``name`` and return its per-token loss term ``[N, T]``.

    ``params`` are the entry's keyword parameters (floats), and ``state`` for a stateful entry.
    Unknown parameters raise ``TypeError`` naming the accepted ones.
    """
    fn = REGISTRY.get(name)
    REGISTRY.check_params(name, params)
    return fn(logits, **params)


def _entropy_from_logp(logp_NTV: Tensor) -> Tensor:
    # -inf log-probs (masked vocabulary) contribute 0 and must not turn 0 * -inf into NaN
    safe_NTV = torch.where(torch.isfinite(logp_NTV), logp_NTV, torch.zeros_like(logp_NTV))
    return -(logp_NTV.exp() * safe_NTV).sum(dim=-1)


def token_entropy(logits_NTV: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position: H_t = -sum_v p_v log p_v, ``[N, T, V]`` -> ``[N, T]``.

    Computed from ``log_softmax`` in float32 (shift-invariant, no overflow); -inf logits are
    allowed and contribute 0. Differentiable.
    """
    return _entropy_from_logp(F.log_softmax(logits_NTV.float(), dim=-1))


def clamped_entropy(logits_NTV: Tensor, *, clamp_p: float = 0.3) -> Tensor:
    """AEnt's clamped entropy: drop the floor(clamp_p V) lowest logits, renormalize, take H.

    ``[N, T, V]`` -> ``[N, T]``. The dropped set is chosen without gradient; the gradient flows
    through the kept logits. Catalog L219: logits [3, 2.5, 2, 1, .5, 0, -.5, -1, -2, -3],
    clamp_p = 0.3 -> 1.4377 (full entropy 1.4954). Read in AReaL ``recipe/AEnt/functional.py``.
    """
    logits_NTV = logits_NTV.float()
    k = int(logits_NTV.shape[-1] * clamp_p)
    if k <= 0:
        return token_entropy(logits_NTV)
    if k >= logits_NTV.shape[-1]:
        raise ValueError(f"clamp_p={clamp_p} would drop the whole vocabulary")
    drop_idx = torch.topk(logits_NTV.detach(), k, dim=-1, largest=False).indices
    drop_NTV = torch.zeros_like(logits_NTV, dtype=torch.bool).scatter_(-1, drop_idx, True)
    return token_entropy(logits_NTV.masked_fill(drop_NTV, float("-inf")))


@register("entropy_bonus")
def entropy_bonus(logits_NTV: Tensor, *, coef: float = 1e-3) -> Tensor:
    """Plain entropy bonus: term_t = -coef H_t (H over the full vocabulary).

    Shapes ``[N, T, V]`` -> ``[N, T]``. coef = 1e-3 as in the One-Shot-RLVR config (1-shot
    RLVR, arXiv:2504.20571, seed papers/004_f298e9ec572f7f27.txt:215: the entropy loss matters).
    Nearest neighbour: ``aent`` clamps the vocabulary and adapts the coefficient.
    """
    return -coef * token_entropy(logits_NTV)


@register("aent")
def aent(
    logits_NTV: Tensor, *, coef: float = 2e-4, clamp_p: float = 0.3, state: AEntState | None = None
) -> Tensor:
    """AEnt: term_t = -coef H^clamped_t, the entropy over the top (1 - clamp_p) of the vocabulary.

    ``coef`` is the starting coefficient; once ``state`` (:class:`AEntState`, advanced by
    :func:`aent_update_state`) is given, ``state.coef`` replaces it. Shapes ``[N, T, V]`` ->
    ``[N, T]``. Paper: AEnt, arXiv:2509.03493 (title not checked), seed
    papers/004_f298e9ec572f7f27.txt:219; defaults 2e-4 / 0.3 from antgroup/AEnt (catalog L219;
    AReaL's recipe uses 2e-4 / 0.4). Nearest neighbour: ``entropy_bonus`` (full vocabulary,
    fixed coefficient), which the paper finds pushes mass onto the huge tail of bad tokens.
    """
    if state is not None:
        coef = state.coef
    return -coef * clamped_entropy(logits_NTV, clamp_p=clamp_p)


MEASURES: dict[str, Callable[..., Tensor]] = {"entropy_bonus": token_entropy, "aent": clamped_entropy}
"""The entropy H_t each entry regularizes (its term is -coef H_t): one per registry name."""


def measure(name: str, logits_NTV: Tensor, **params: object) -> Tensor:
    """The per-token entropy entry ``name`` regularizes, without its coefficient, ``[N, T, V]`` -> ``[N, T]``.

    ``params`` are the entry's; those the measure does not take (``coef``, ``state``) are ignored.
    A stateful entry's updater is fed its batch token-mean (AEnt: the clamped entropy).
    """
    REGISTRY.get(name)  # unknown names list the choices
    fn = MEASURES[name]
    accepted = inspect.signature(fn).parameters
    return fn(logits_NTV, **{k: v for k, v in params.items() if k in accepted})


@dataclass(frozen=True)
class AEntState:
    """AEnt's adaptive coefficient.

    ``coef`` is the current entropy coefficient; ``step`` counts calls to :func:`aent_update_state`.
    """

    coef: float = 2e-4
    step: int = 0


def aent_update_state(
    state: AEntState | None,
    entropy: float,
    *,
    coef: float = 2e-4,
    entropy_low: float = 0.1,
    entropy_high: float = 0.5,
    coef_lr: float = 1e-3,
    coef_min: float = 1e-5,
    coef_max: float = 1e-2,
    warmup_steps: int = 0,
) -> AEntState:
    """One step of AEnt's coefficient rule; returns a new state (pure).

    coef <- clip(coef - coef_lr (min(0, H - entropy_low) + max(0, H - entropy_high)),
    coef_min, coef_max), with H = ``entropy``, the batch's token-mean clamped entropy (the loop
    averages it over the step's minibatches, as AReaL does). Below the band the coefficient
    rises, above it falls, inside it stays. ``state=None`` starts from ``coef`` (the entry's
    starting coefficient: the loop passes the recipe's ``coef`` to both). No change for the first
    ``warmup_steps + 1`` calls: AReaL updates when ``global_step > warmup_steps`` with
    ``global_step`` counting from 0 (``recipe/AEnt/actor.py``, ``gsm8k_aent_grpo.py``), so even
    ``warmup_steps = 0`` leaves the first step's coefficient alone; ``state.step`` here is that
    ``global_step`` (the calls before this one). Rule and defaults read in AReaL ``recipe/AEnt/actor.py``
    and ``aent_args.py`` at the commit before 5c33cba (the recipe was removed there; the catalog had
    not recovered it); AReaL's GSM8K recipe uses the band [0.05, 0.23], coef_max 3e-3 and 29
    warm-up steps.
    """
    if state is None:
        state = AEntState(coef=coef)
    if state.step <= warmup_steps:  # AReaL: `if global_step > warmup_steps: update`
        return replace(state, step=state.step + 1)
    change = min(0.0, entropy - entropy_low) + max(0.0, entropy - entropy_high)
    coef = min(max(state.coef - coef_lr * change, coef_min), coef_max)
    return AEntState(coef=coef, step=state.step + 1)
