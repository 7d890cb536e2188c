"""Reward shapers: rewards ``[P, G]`` (+ named extra inputs) -> shaped rewards ``[P, G]``.

Contract (``DESIGN.md``, point "reward shaping"): ``compute(name, rewards, **kwargs)``, the same
pattern as ``advantages.compute``: ``rewards`` is float ``[P, G]`` (P prompts, G completions per
prompt); extra inputs arrive by name (``lengths [P, G]``, ``ref_rewards [P, M]``,
``step_rewards [P, G, K]``, ``state``, ...); keyword arguments an entry does not declare are
ignored, so the loop can pass what it has. Shapers run before the advantage estimator and never
carry gradient.

Conventions: *correct* means ``reward > CORRECT_THRESHOLD`` (0.5), as in ``advantages``. The one
stateful shaper (``traac_length``) reads ``state`` (a frozen dataclass, ``None`` = empty history)
and the caller advances it with ``traac_length_update_state(state, rewards, lengths)``.

The noisy-verifier corrections are affine in the observed reward (on a binary verifier every map of
the reward is: r -> a r + b, here with a > 0). A baseline that is a mean of the group's rewards
removes b and keeps a; a std division removes a too; a 0.5 threshold reads only the verifier's bit.
So they keep their effect (every advantage times a) only under ``MEAN_BASELINES`` and ``remax``, whose
greedy baseline goes through the shapers too, cancel exactly under ``grpo`` and ``reinforce_pp``, and
the config rejects the other estimators (``correction_lost``; catalog 3.3).

An estimator with an outside baseline (``remax``: the greedy response's reward) gets that response
shaped like the samples, with its own inputs; only ``PER_RESPONSE`` shapers have a value for it, and
the config rejects the others with it (``baseline_unshapable``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algorithms import advantages
from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("reward shaper")
register = REGISTRY.register
names = REGISTRY.names

CORRECT_THRESHOLD = 0.5
"""A response counts as correct when its reward is above this (binary {0,1} or {-1,1} rewards)."""


def compute(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Look up shaper ``name`` and apply it to ``rewards [P, G]``; returns ``[P, G]``.

    Keyword arguments the shaper does not declare are ignored, so callers may pass every extra
    input they have. Parameters it does declare are checked by the call.
    """
    fn = REGISTRY.get(name)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G]; got shape {tuple(rewards.shape)}")
    with torch.no_grad():
        return fn(rewards.float(), **REGISTRY.declared(name, kwargs))


def _correct(r_PG: Tensor) -> Tensor:
    """1.0 where a response is correct (reward > ``CORRECT_THRESHOLD``), else 0.0."""
    return (r_PG > CORRECT_THRESHOLD).to(r_PG.dtype)


def _check_noise_rates(fp_rate: float, fn_rate: float) -> None:
    """Raise ValueError unless 0 <= fp_rate, fn_rate and fp_rate + fn_rate < 1 (the channel is informative)."""
    if not (0.0 <= fp_rate < 1.0 and 0.0 <= fn_rate < 1.0 and fp_rate + fn_rate < 1.0):
        raise ValueError(f"need 0 <= fp_rate, fn_rate and fp_rate + fn_rate < 1; got {fp_rate}, {fn_rate}")


@register("overlong")
def overlong(
    rewards: Tensor,
    *,
    lengths: Tensor,
    max_length: int,
    buffer: int,
    penalty: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment: r += min(-(L - (L_max - L_buf)) / L_buf * penalty, 0).

    No penalty up to L_max - L_buf tokens, then a linear ramp to -penalty at L_max (truncated
    responses have L = L_max). Shapes: rewards, lengths ``[P, G]`` -> ``[P, G]``. Paper: "DAPO:
    An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025, arXiv:2503.14476
    (catalog B7; verl ``DAPORewardManager``); the reference config uses L_max = 20480, L_buf =
    4096, penalty 1.0; ``max_length`` and ``buffer`` have no default because they must match the
    run's generation limit. No std. Nearest neighbour: ``traac_length`` rewards short correct
    answers relative to history instead of penalising only the overlong tail.
    """
    if buffer <= 0:
        raise ValueError(f"buffer must be > 0; got {buffer}")
    expected = max_length - buffer
    exceed_PG = lengths.to(rewards.dtype) - expected
    return rewards + torch.clamp(-exceed_PG / buffer * penalty, max=0.0)


NOISY_VERIFIER = ("noisy_verifier_backward", "noisy_verifier_forward")
"""The corrections for a noisy binary verifier; both are affine in the reward (r -> a r + b, a > 0)."""

MEAN_BASELINES = ("dr_grpo", "opo", "rloo")
"""Estimators whose baseline is a (weighted) mean of the group's rewards, with no std division and no
0.5 threshold: A(a r + b) = a A(r) for a > 0, so a noisy-verifier correction survives as the factor a.
RLOO and Dr.GRPO are the REINFORCE estimator the corrections are derived for, with a group baseline."""

_LOST_UNDER: dict[str, str] = {
    **dict.fromkeys(
        ("grpo", "grpo_n", "qae", "capo", "reinforce_pp", "reinforce_pp_baseline"),
        "divides the centred rewards by their std, so the correction cancels exactly (the corrected run "
        "makes the uncorrected updates)",
    ),
    **dict.fromkeys(
        ("nsr", "w_reinforce", "passk", "ddca"),
        "reads only whether reward > 0.5, which the correction keeps: it has no effect",
    ),
    "mapo": "thresholds at 0.5 and divides by the group mean, which a correction can make negative "
    "(backward: pass rate below fp_rate), flipping the signs",
}


def correction_lost(shaper: str, advantage: str, advantage_params: Mapping[str, object]) -> str | None:
    """Why the noisy-verifier correction ``shaper`` is lost under ``advantage``; None if it survives.

    A correction r -> a r + b (a > 0) survives an estimator A only as A(a r + b) = a A(r): a
    baseline that is a mean of the group's rewards (``MEAN_BASELINES``, or ``grpo`` with
    ``std="none"``, which is Dr.GRPO), or an outside baseline the shapers reach too (``remax``:
    (a r_i + b) - (a r_g + b) = a (r_i - r_g)). Example: rewards [1, 0, 0, 1], ``noisy_verifier_backward``
    (fp 0.1, fn 0.2) -> [1.285714, -0.142857, ...]; ``rloo`` gives 4/3 (r - mean) = +-0.952381
    instead of +-0.666667 (a = 1/0.7), ``grpo`` gives +-0.866025 either way (lost). Returns the
    config error's text, None for a shaper that is not a noisy-verifier correction.
    """
    if shaper not in NOISY_VERIFIER or advantage in MEAN_BASELINES or _outside_baseline(advantage):
        return None
    if advantage == "grpo" and advantage_params.get("std") == "none":
        return None
    reason = _LOST_UNDER.get(advantage, "is not a mean baseline without a std division")
    return (
        f"{shaper!r} is an affine map of the verifier's reward (r -> a r + b, a > 0) and {advantage!r} "
        f"{reason}; the correction keeps its effect (every advantage times a, the clean gradient's scale) "
        f"only under a mean baseline without std: {list(MEAN_BASELINES)} (or grpo with "
        'advantage_params.std = "none"), or an outside baseline shaped like the samples (remax)'
    )


PER_RESPONSE = ("overlong", "noisy_verifier_backward", "noisy_verifier_forward", "par", "prm_clip", "prm_delta")
"""Shapers whose shaped reward of a response reads only that response (its reward, its length, its step
rewards) and its prompt (PAR's reference responses), and no state: a response outside the group, such as
ReMax's greedy one, is shaped on its own exactly as it would be inside it."""

_NOT_PER_RESPONSE: dict[str, str] = {
    "rank": "ranks each response against the rest of its group: the greedy response is no member of the "
    "group, and alone it always ranks 0.5, whatever its reward",
    "traac_length": "reads the group's pass rate (the difficulty bucket) and a length history the loop "
    "advances with the samples: the greedy response alone has a pass rate of 0 or 1 and no history of its own",
}


def _outside_baseline(advantage: str) -> bool:
    """The estimator subtracts the reward of a response outside the group (reads ``baseline_rewards``)."""
    return advantage in advantages.REGISTRY.names() and "baseline_rewards" in advantages.REGISTRY.required(advantage)


def baseline_unshapable(shaper: str, advantage: str) -> str | None:
    """Why ``shaper`` cannot shape the outside baseline of ``advantage``; None if it can, or if there is none.

    ``remax`` subtracts b = the reward of the prompt's greedy response, and the loop puts that response
    through the run's shapers with its own inputs (``prepare/providers.py``), so A = r'_i - b' compares one
    reward definition. That holds for ``PER_RESPONSE`` shapers. Example: ``overlong`` (L_max 6, buffer 2),
    raw rewards 1 for the samples of lengths [4, 6] and for a greedy response of length 5: shaped [1, 0]
    and b' = 0.5, so A = [0.5, -0.5]; the unshaped b = 1 gave [0, -1]. A shaper that reads the group or
    a history has no value for one greedy response: the config error's text, naming both entries.
    """
    if shaper in PER_RESPONSE or not _outside_baseline(advantage):
        return None
    why = _NOT_PER_RESPONSE.get(shaper, "is not known to shape a response on its own (shaping.PER_RESPONSE)")
    return (
        f"{shaper!r} {why}; {advantage!r} subtracts the shaped reward of one greedy response per prompt, "
        f"so the samples and the baseline would be rewarded differently. With {advantage!r} use shapers "
        f"that shape a response on its own: {list(PER_RESPONSE)}"
    )


@register("noisy_verifier_backward")
def noisy_verifier_backward(rewards: Tensor, *, fp_rate: float, fn_rate: float) -> Tensor:
    """Backward correction for a noisy binary verifier: R^ = (R~ - rho0) / (1 - rho0 - rho1).

    rho0 = ``fp_rate`` (P(verifier says 1 | wrong)), rho1 = ``fn_rate`` (P(says 0 | correct)).
    E[R^ | clean R] = R, so R^ is unbiased for the clean reward and sum_i R^_i grad log pi(y_i) for
    the clean policy gradient. Example: rho0 = 0.1, rho1 = 0.2: R^(1) = 0.9 / 0.7 = 1.285714,
    R^(0) = -0.1 / 0.7 = -0.142857. Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "Reinforcement
    Learning with Verifiable yet Noisy Rewards under Imperfect Verifiers", Cai et al. 2025,
    arXiv:2510.00915, seed ``papers/000_99b2b1db2eead048.txt:9`` (catalog 3.3; from summaries, no
    code found: provisional). No std. Where it matters: R^ = a R~ + b with a = 1 / (1 - rho0 -
    rho1) > 1, so under a group-mean baseline (``MEAN_BASELINES``: rloo, dr_grpo, opo) every
    advantage is a times the uncorrected one and E[A(R^)] is the clean advantage (the paper's
    unbiasedness; it changes the step relative to KL/entropy terms and gradient clipping, while
    Adam absorbs much of a constant factor). A std division (``grpo``, ``reinforce_pp``) cancels
    it exactly, though the paper names GRPO as its pipeline: the config rejects that
    (``correction_lost``). R^(1) >= 1 and R^(0) <= 0, so 0.5-threshold estimators read the bit
    right. Nearest neighbour: ``noisy_verifier_forward`` needs only rho1 (it equals this with
    rho0 = 0).
    """
    _check_noise_rates(fp_rate, fn_rate)
    return (rewards - fp_rate) / (1.0 - fp_rate - fn_rate)


@register("noisy_verifier_forward")
def noisy_verifier_forward(rewards: Tensor, *, fp_rate: float, fn_rate: float) -> Tensor:
    """Forward correction, rescaled: R' = (w + 1 - rho1) / (1 - rho1) = R~ / (1 - rho1), binary R~.

    The paper's weights: w = rho1 if R~ = 1, rho1 - 1 if R~ = 0 (rho1 = ``fn_rate``), multiplying
    each score-function term with no baseline: E[w | R] = (1 - rho0 - rho1)(R - 1), the clean
    direction, from rho1 alone. Used as a reward, w = R~ - (1 - rho1) is a pure shift (slope 1):
    any group baseline removes it, and a correct answer's 0.2 (rho1 = 0.2) falls below the 0.5
    that ``nsr``/``w_reinforce``/``passk``/``mapo`` call correct (mapo flipped [1, 0, 0, 1] to
    [-1.67, 1.67, 1.67, -1.67] under w). So this returns R', a positive affine image of w: the same
    expected-update direction (a constant c adds c E[grad log pi] = 0), E[R' | R] = R when rho0 = 0
    (E[R' | R] = (rho0 + (1 - rho0 - rho1) R) / (1 - rho1) in general), correct -> 1 / (1 - rho1)
    > 0.5, wrong -> 0. Example: rho1 = 0.2: [1, 0, 0, 1] -> [1.25, 0, 0, 1.25]; rloo gives
    +-0.833333 instead of +-0.666667. ``fp_rate`` is only validated. Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: arXiv:2510.00915 (Cai et al. 2025), seed
    ``papers/000_99b2b1db2eead048.txt:9`` (catalog 3.3; the weights are from a summary:
    **provisional**). No std. Like the backward one it survives only under ``MEAN_BASELINES``
    (``correction_lost``). The paper's own weights as advantages are (1 - rho1) x ``w_reinforce``
    with lam = rho1 / (1 - rho1) on the uncorrected reward. Nearest neighbour:
    ``noisy_verifier_backward`` (needs rho0 too; equals this when rho0 = 0).
    """
    _check_noise_rates(fp_rate, fn_rate)
    return _correct(rewards) / (1.0 - fn_rate)


@register("par")
def par(rewards: Tensor, *, ref_rewards: Tensor, k: float = 1.0, samples: int = 10) -> Tensor:
    """PAR (Preference As Reward): r' = (1/M) sum_m sigmoid(k (r - r_ref,m)).

    ``ref_rewards`` are reward-model scores of M reference (SFT) responses to the same prompt:
    ``[P, M]`` (shared by the group) or ``[P, G, M]``. The result is bounded in (0, 1), centred on
    the references and saturating, the paper's three principles. Shapes: rewards ``[P, G]`` ->
    ``[P, G]``. Paper: "Reward Shaping to Mitigate Reward Hacking in RLHF", Fu et al. 2025,
    arXiv:2502.18770, seed ``papers/004_f298e9ec572f7f27.txt:93`` (catalog 3.29, authors'
    ``calculate_relative_sigmoid``; M <= 10 references, ``reward_maxref``). ``samples`` is read by
    the loop: M > 0 (default 10, the authors' ``reward_maxref``) samples M responses per prompt from
    the frozen starting policy (the paper's SFT references), scored with the run's rewards
    (``produce/ref_samples.py``), as the preset ``recipes/par.toml`` does; 0 takes the example's
    demonstration as the one reference (a cheap stand-in, not the method). Hand example: r = 2, references [1, 3] ->
    (sigmoid(1) + sigmoid(-1)) / 2 = 0.5. No std. Nearest neighbour: ``rank`` also maps to [0, 1]
    but relative to the group, not to reference responses.
    """
    ref = ref_rewards.to(rewards.dtype)
    ref_PGM = ref.unsqueeze(1) if ref.dim() == 2 else ref
    return torch.sigmoid(k * (rewards.unsqueeze(-1) - ref_PGM)).mean(dim=-1)


@register("rank")
def rank(rewards: Tensor) -> Tensor:
    """RLRR rank reward: r~_i = (G - rank_i) / (G - 1), rank 1 = best, ties share the mean rank.

    rank_i = 1 + #{j: r_j > r_i} + (#{j: r_j = r_i} - 1) / 2. The best response gets 1, the worst
    0; a group of one gets 0.5. Shapes: ``[P, G]`` -> ``[P, G]``. Paper: RLRR, arXiv:2601.23058,
    seed ``papers/004_f298e9ec572f7f27.txt:133`` (catalog L133; **reconstruction** from the
    abstract: the rank map is not verified). No std (group-normalise afterwards, e.g. ``grpo``).
    Nearest neighbour: ``par`` (bounded, but relative to reference responses).
    """
    g = rewards.shape[1]
    if g < 2:
        return torch.full_like(rewards, 0.5)
    r_PG1, r_P1G = rewards.unsqueeze(2), rewards.unsqueeze(1)
    better_PG = (r_P1G > r_PG1).sum(dim=2).to(rewards.dtype)
    ties_PG = (r_P1G == r_PG1).sum(dim=2).to(rewards.dtype) - 1.0
    rank_PG = 1.0 + better_PG + ties_PG / 2.0
    return (g - rank_PG) / (g - 1)


# --------------------------------------------------------------------------------------------
# TRAAC difficulty-aware length reward (stateful: length history per difficulty bucket)
# --------------------------------------------------------------------------------------------

_TRAAC_BUCKETS: tuple[tuple[str, float, float], ...] = (
    # (bucket, lowest pass rate, length-reward scale)
    ("easy", 0.8, 1.0),
    ("medium", 0.3, 0.75),
    ("hard", 0.0, 0.5),
)


@dataclass(frozen=True)
class TRAACState:
    """Lengths of correct responses from recent batches, one tuple per batch, per difficulty."""

    easy: tuple[tuple[float, ...], ...] = ()
    medium: tuple[tuple[float, ...], ...] = ()
    hard: tuple[tuple[float, ...], ...] = ()


def _traac_buckets(rewards: Tensor) -> list[tuple[str, float, Tensor]]:
    """(bucket, scale, member mask ``[P, 1]``) from the group pass rate p: easy >= 0.8 > medium >= 0.3."""
    p_P1 = _correct(rewards).mean(dim=1, keepdim=True)
    out: list[tuple[str, float, Tensor]] = []
    upper = float("inf")
    for name, lowest, scale in _TRAAC_BUCKETS:
        out.append((name, scale, (p_P1 >= lowest) & (p_P1 < upper)))
        upper = lowest
    return out


def traac_length_update_state(
    state: TRAACState | None, rewards: Tensor, lengths: Tensor, *, window: int = 10
) -> TRAACState:
    """Append this batch's correct-response lengths to each bucket, keeping the last ``window`` batches.

    A bucket with no correct response in this batch keeps its history unchanged.
    """
    prior = state if state is not None else TRAACState()
    rewards = rewards.float()
    c_PG = _correct(rewards) > 0
    updated: dict[str, tuple[tuple[float, ...], ...]] = {}
    for name, _, member_P1 in _traac_buckets(rewards):
        batch = tuple(float(x) for x in lengths.float()[c_PG & member_P1].tolist())
        history: tuple[tuple[float, ...], ...] = getattr(prior, name)
        updated[name] = (history + (batch,))[-window:] if batch else history
    return TRAACState(**updated)


@register("traac_length", async_safe=False,
          note="it keeps a history that the learner's steps advance, which a producer running ahead cannot read")
def traac_length(
    rewards: Tensor,
    *,
    lengths: Tensor,
    state: TRAACState | None = None,
) -> Tensor:
    """TRAAC difficulty-aware length reward, added to correct responses only.

    Difficulty from the group pass rate p: easy p >= 0.8 (scale 1.0), medium p >= 0.3 (0.75),
    hard (0.5). From the bucket's history H of correct lengths (``state``, last 10 batches; the
    current batch's correct lengths when the history is empty):
    L_norm = clamp((max H - L) / max(max H - min H, 1e-6), 0, 1);
    soft = 1 / (1 + exp((L - median H) / (0.1 median H))); r_len = scale * max(L_norm, soft);
    r' = r + r_len for correct responses, r otherwise. Shapes: rewards, lengths ``[P, G]`` ->
    ``[P, G]``. Paper: "Think Right: Learning to Mitigate Under-Over Thinking via Adaptive,
    Attentive Compression", Singh et al. 2025, arXiv:2510.01581, seed
    ``papers/000_99b2b1db2eead048.txt:7`` (catalog 3.2, authors' ``sumLinear.py``). The history is
    kept per difficulty bucket only (the code also keys it by data source: keep one state per
    source). The attention-based compression of the paper is a rollout-engine feature, not here.
    No std. Nearest neighbour: ``overlong`` penalises only the tail beyond a fixed budget.
    """
    prior = state if state is not None else TRAACState()
    l_PG = lengths.to(rewards.dtype)
    c_PG = _correct(rewards)
    bonus_PG = torch.zeros_like(rewards)
    for name, scale, member_P1 in _traac_buckets(rewards):
        history = [x for batch in getattr(prior, name) for x in batch]
        if not history:
            history = l_PG[(c_PG > 0) & member_P1].tolist()
        if not history:
            continue
        h = torch.tensor(history, dtype=rewards.dtype, device=rewards.device)
        h_max, h_min, med = h.max(), h.min(), torch.quantile(h, 0.5).clamp(min=1e-6)
        l_norm = ((h_max - l_PG) / (h_max - h_min).clamp(min=1e-6)).clamp(0.0, 1.0)
        soft = torch.sigmoid(-(l_PG - med) / (0.1 * med))
        bonus_PG = torch.where(member_P1, scale * torch.maximum(l_norm, soft), bonus_PG)
    return rewards + bonus_PG * c_PG


# --------------------------------------------------------------------------------------------
# Process-reward refinements (Clip / Delta): step rewards [P, G, K] from a PRM
# --------------------------------------------------------------------------------------------


def prm_clip_steps(step_rewards: Tensor, step_mask: Tensor | None = None, *, eta: float = 0.5) -> Tensor:
    """Clip refinement per step: r~_k = min(r_k - eta, 0), 0 on masked steps; ``[P, G, K]``."""
    m = torch.ones_like(step_rewards) if step_mask is None else step_mask.to(step_rewards.dtype)
    return torch.clamp(step_rewards - eta, max=0.0) * m


def prm_delta_steps(step_rewards: Tensor, step_mask: Tensor | None = None) -> Tensor:
    """Delta refinement per step: r~_k = r_k - r_{k+1}, 0 at the last valid step; ``[P, G, K]``.

    Steps must be left-aligned (``step_mask`` a prefix of ones). The return-to-go from step k
    telescopes to r_k - r_last, so repeating steps cannot inflate it.
    """
    m = torch.ones_like(step_rewards) if step_mask is None else step_mask.to(step_rewards.dtype)
    next_r = torch.roll(step_rewards, shifts=-1, dims=-1)
    next_m = torch.roll(m, shifts=-1, dims=-1)
    next_m[..., -1] = 0.0  # nothing follows the last slot
    return (step_rewards - next_r) * m * next_m


@register("prm_clip")
def prm_clip(
    rewards: Tensor,
    *,
    step_rewards: Tensor,
    step_mask: Tensor | None = None,
    eta: float = 0.5,
) -> Tensor:
    """Clip-refined process reward: r' = r + sum_k min(r_k - eta, 0).

    Every process reward is <= 0, so adding steps never pays (no "repeat correct steps" hacking).
    ``step_rewards [P, G, K]`` are PRM scores per reasoning step, ``step_mask [P, G, K]`` marks
    real steps. For per-step credit put ``prm_clip_steps`` on the step-end tokens as
    ``token_rewards`` of ``gae`` / ``reinforce_pp`` instead. Shapes: -> ``[P, G]``. Paper: "On
    Designing Effective RL Reward at Training Time for LLM Reasoning", Gao et al. 2024,
    arXiv:2410.15115, seed ``papers/004_f298e9ec572f7f27.txt:149`` (catalog L149; paper, no
    code). eta = 0.5 is the catalog's worked value, not a pinned paper default. No std.
    Nearest neighbour: ``prm_delta`` bounds the return by telescoping instead of capping at 0.
    """
    return rewards + prm_clip_steps(step_rewards, step_mask, eta=eta).to(rewards.dtype).sum(dim=-1)


@register("prm_delta")
def prm_delta(rewards: Tensor, *, step_rewards: Tensor, step_mask: Tensor | None = None) -> Tensor:
    """Delta-refined process reward: r' = r + sum_k (r_k - r_{k+1}) = r + r_first - r_last.

    Shapes: step_rewards, step_mask ``[P, G, K]`` -> ``[P, G]``; per-step values from
    ``prm_delta_steps``. Paper: Gao et al. 2024, arXiv:2410.15115, seed
    ``papers/004_f298e9ec572f7f27.txt:149`` (catalog L149). The last step's 0 follows the paper's
    figure; the catalog asks to check it against the text. No std. Nearest neighbour:
    ``prm_clip``.
    """
    return rewards + prm_delta_steps(step_rewards, step_mask).to(rewards.dtype).sum(dim=-1)
