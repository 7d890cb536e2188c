"""Selection: which prompts, groups and samples to train on.

Two kinds of functions live here.

* **Group filters** (the registry): ``select(name, rewards, **kwargs) -> keep [P] bool``.
  ``rewards`` is float ``[P, G]`` (P prompts, G completions each); ``keep[p]`` is True when group
  ``p`` goes on to training. Keyword arguments an entry does not declare are ignored, so the loop
  can pass everything it has. Entries: ``none``, ``dynamic_sampling`` (DAPO), ``rest_grpo``
  (ReST-RL), ``all_correct`` (NGRPO).
* **Samplers and bookkeeping** with other outputs, each documented where it is defined: the DAPO
  accumulator (``dynamic_sampling_step``), ReST-GRPO prefix sampling, Shuffle-R1 pairs and
  shuffle, RoRecomp priority/compensation batches, HINT's re-roll decision and hint prompt, and
  the pass-rate history with 1-shot RLVR's historical-variance ranking. The loop uses Shuffle-R1
  and RoRecomp as batch selectors (``algorithm.batch_selector``, ``posttrain/train/select.py``) and
  HINT's re-roll in collection (``rollout.hint_reroll``, ``posttrain/train/hint.py``); the ReST-GRPO
  prefixes and the pass-rate history are library-only (``docs/architecture.md``, known limits).

Everything is pure: tensors in, tensors / index lists out. Stateful methods take and return a
frozen dataclass; randomness comes only from an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

GroupFilter = Callable[..., Tensor]
REGISTRY: Registry[GroupFilter] = Registry("selector")
register = REGISTRY.register
names = REGISTRY.names

PromptId = int | str
StopReason = Literal["continue", "full", "limit"]
PairWeight = Literal["sum", "max", "mean", "pos"]

#: HINT's hint preamble, as given in the method catalog (3.1) for ViviqwerAsd/HINT @ 2e917e5bc3.
HINT_PREAMBLE = (
    "\nHere are some key pieces of information to assist your reasoning without revealing the "
    "solution directly:\n"
)


def _check_rewards(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G]; got shape {tuple(rewards.shape)}")
    return rewards.detach().float()


def select(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Apply group filter ``name`` to ``rewards [P, G]`` and return the keep mask ``[P]`` bool.

    Keyword arguments the filter does not declare are ignored; those it declares are passed on.
    """
    fn = REGISTRY.get(name)
    return fn(_check_rewards(rewards), **REGISTRY.declared(name, kwargs))


def _spread_PG(r_PG: Tensor) -> Tensor:
    """Return max - min per group ``[P]``; 0 for an empty group (G = 0)."""
    if r_PG.shape[1] == 0:
        return torch.zeros(r_PG.shape[0], dtype=r_PG.dtype)
    return r_PG.amax(dim=1) - r_PG.amin(dim=1)


# --------------------------------------------------------------------------- group filters


@register("none")
def keep_all(rewards: Tensor) -> Tensor:
    """Keep every group: keep_p = True (the default: no filtering).

    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. No paper. Nearest neighbour:
    ``dynamic_sampling`` drops the zero-variance groups that this keeps.
    """
    return torch.ones(rewards.shape[0], dtype=torch.bool)


@register("dynamic_sampling")
def dynamic_sampling(rewards: Tensor, *, tol: float = 0.0, keep_singletons: bool = True) -> Tensor:
    """DAPO dynamic sampling filter: keep_p = (max_g r_pg - min_g r_pg > tol).

    Drops zero-variance groups (all rewards equal), whose GRPO advantage is zero everywhere.
    Shapes: rewards ``[P, G]`` (any per-sample metric: verl's ``filter_groups.metric`` is ``acc``,
    ``score`` or ``seq_reward``) -> keep ``[P]`` bool.
    Paper: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025,
    arXiv:2503.14476 (catalog B7; a baseline, no seed line). Code: verl ``recipe/dapo``.
    Convention: verl keeps a group when ``np.std(metric) > 0`` or it has one member; max - min
    with ``tol=0`` is the same test without float round-off (``np.std`` of [0.1, 0.1, 0.1] is
    1.4e-17, not 0). HINT's ``skip_zero_groups`` is ``tol=1e-4``. A singleton group (G = 1) is
    kept, as verl does (``keep_singletons=False`` drops it); note that this library's ``grpo``
    gives a singleton advantage 0, where verl's gives it r.
    Nearest neighbour: ``all_correct`` (NGRPO) drops only all-max groups and keeps all-wrong ones;
    ``rest_grpo`` drops groups whose spread is small, not only zero.
    Pair with :func:`dynamic_sampling_step` to refill the batch.
    """
    keep_P = _spread_PG(rewards) > tol
    if keep_singletons and rewards.shape[1] == 1:
        keep_P = torch.ones_like(keep_P)
    return keep_P


@register("rest_grpo")
def rest_grpo(rewards: Tensor, *, min_std: float = 0.05) -> Tensor:
    """ReST-GRPO reward-spread filter: keep_p = (sigma_p(r_p) >= min_std), population std.

    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. Std convention: population (ddof=0,
    ``np.std``), as in ``experiment/process_gen_data.py`` (``std_accept_threshold_grpo=0.05``).
    Paper: "ReST-RL: Achieving Accurate Code Reasoning of LLMs with Optimized Self-Training and
    Decoding", Zhoubian et al. 2025, arXiv:2508.19576; seed ``papers/000_99b2b1db2eead048.txt:11``
    (catalog 3.4). Code: THUDM/ReST-RL. In the paper this runs offline, on completions sampled
    before a GRPO round; kept prompts with a good best completion also get partial-state prompts
    (:func:`rest_partial_state_mask`, :func:`rest_sample_prefixes`).
    Nearest neighbour: ``dynamic_sampling`` drops only zero-spread groups; this drops low-spread
    ones too (for rewards in {0, 1} with G = 4, sigma_p is 0 or >= 0.433, so they agree).
    """
    if rewards.numel() == 0:
        return torch.zeros(rewards.shape[0], dtype=torch.bool)
    return rewards.std(dim=1, unbiased=False) >= min_std


@register("all_correct")
def all_correct(rewards: Tensor, *, max_reward: float = 1.0) -> Tensor:
    """NGRPO ``all_correct`` filter: keep_p = not all_g (r_pg >= max_reward).

    Drops groups whose rewards are all the maximum and keeps all-wrong groups, because NGRPO's
    virtual max-reward sample gives them a negative advantage (-0.447212 each for [0, 0, 0, 0]).
    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. A singleton correct group is dropped.
    Paper: "NGRPO: Negative-enhanced Group Relative Policy Optimization", Nan et al. 2025,
    arXiv:2509.18851; seed ``papers/004_f298e9ec572f7f27.txt:57`` (catalog 3.22). Code:
    nangongrui-ngr/NGRPO ``verl/trainer/ppo/ray_trainer.py`` (``filter_groups.strategy``), where
    "correct" is ``score == 1`` (``score > 0`` with the DAPO reward manager); ``max_reward`` is
    NGRPO's ``algorithm.max_reward``.
    Nearest neighbour: ``dynamic_sampling`` also drops all-wrong groups.
    """
    if rewards.shape[1] == 0:
        return torch.ones(rewards.shape[0], dtype=torch.bool)
    return ~(rewards >= max_reward).all(dim=1)


# --------------------------------------------------------------------------- DAPO accumulator


@dataclass(frozen=True)
class DynamicSamplingState:
    """What DAPO's "keep generating" loop has gathered so far.

    ``kept``: (generation batch index, group index in that batch) of every kept group, in arrival
    order, at most ``train_batch_size`` of them once full. ``num_gen_batches``: batches seen.
    """

    kept: tuple[tuple[int, int], ...] = ()
    num_gen_batches: int = 0

    @property
    def num_kept(self) -> int:
        """Number of kept groups."""
        return len(self.kept)


def dynamic_sampling_step(
    state: DynamicSamplingState,
    keep: Tensor,
    *,
    train_batch_size: int,
    max_num_gen_batches: int = 10,
) -> tuple[DynamicSamplingState, StopReason]:
    """Add one generation batch's keep mask ``[P]`` to the DAPO accumulator; say whether to stop.

    Returns ``(new_state, reason)``: ``"full"`` once ``train_batch_size`` groups are kept (the
    surplus of the last batch is dropped, like verl's ``batch[:train_batch_size * n]``),
    ``"limit"`` when ``max_num_gen_batches`` batches have been generated without filling it, else
    ``"continue"``. ``max_num_gen_batches <= 0`` means no limit. Full is checked first, as in verl.
    verl raises at the limit; here the caller decides (train on the partial batch or fail).
    Paper: DAPO, arXiv:2503.14476 (catalog B7); default 10 is the DAPO recipe's
    ``max_num_gen_batches``. Nearest neighbour: none; the filter is :func:`dynamic_sampling`.
    """
    if train_batch_size <= 0:
        raise ValueError(f"train_batch_size must be positive; got {train_batch_size}")
    if keep.dim() != 1 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a [P] bool mask; got {keep.dtype} {tuple(keep.shape)}")
    batch = state.num_gen_batches
    new = tuple((batch, int(p)) for p in keep.nonzero().flatten().tolist())
    kept = state.kept + new
    new_state = DynamicSamplingState(kept=kept[:train_batch_size], num_gen_batches=batch + 1)
    if len(kept) >= train_batch_size:
        return new_state, "full"
    if 0 < max_num_gen_batches <= new_state.num_gen_batches:
        return new_state, "limit"
    return new_state, "continue"


# --------------------------------------------------------------------------- ReST-GRPO prefixes


def rest_partial_state_mask(
    rewards: Tensor, *, min_std: float = 0.05, accept_threshold: float = 0.9
) -> Tensor:
    """ReST-GRPO: which prompts also get partial-state prompts: kept and max_g r_pg >= 0.9.

    Shapes: rewards ``[P, G]`` -> ``[P]`` bool. ``accept_threshold`` is the code's
    ``completion_accept_threshold_grpo``. Paper and nearest neighbour: see ``rest_grpo``.
    """
    r_PG = _check_rewards(rewards)
    if r_PG.shape[1] == 0:
        return torch.zeros(r_PG.shape[0], dtype=torch.bool)
    return rest_grpo(r_PG, min_std=min_std) & (r_PG.amax(dim=1) >= accept_threshold)


def line_prefixes(completion: str) -> list[str]:
    r"""Split a completion into line prefixes: prefix k = its first k lines, each ending in a newline.

    As in ReST-RL ``process_gen_data.py``: the completion is right-stripped, split on ``"\n"``,
    and prefix k is ``line_1 + "\n" + ... + line_k + "\n"``; the partial-state prompt is
    ``prompt + prefix``. The last prefix is the whole completion.
    """
    out: list[str] = []
    acc = ""
    for line in completion.rstrip().split("\n"):
        acc += line + "\n"
        out.append(acc)
    return out


def rest_prefix_weights(num_lines: int, *, alpha: float = 0.95) -> Tensor:
    """ReST-GRPO prefix sampling probabilities: P(prefix k) = alpha^(k-1) / sum_j alpha^(j-1).

    Shapes: ``num_lines`` -> float ``[num_lines]`` (index k-1 is the prefix of k lines), summing
    to 1. Earlier (shorter) prefixes are favoured. Worked numbers (4 lines, alpha = 0.95):
    [0.269551, 0.256073, 0.243270, 0.231106]. Code: ``utils/sample_utils.py``
    (``exponential_probability_distribution``, whose own default is 0.9; the run default
    ``--alpha`` is 0.95). Paper: see ``rest_grpo``.
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1); got {alpha}")
    w = alpha ** torch.arange(num_lines, dtype=torch.float64)
    return (w / w.sum()).float() if num_lines > 0 else w.float()


def rest_sample_prefixes(
    num_lines: int, *, generator: torch.Generator, alpha: float = 0.95, ratio: float = 0.5
) -> Tensor:
    """ReST-GRPO: draw ceil(ratio * num_lines) prefix lengths, with replacement, P(k) ∝ alpha^(k-1).

    Shapes: -> long ``[ceil(ratio * num_lines)]`` of line counts in ``1..num_lines`` (index into
    :func:`line_prefixes` with ``k - 1``). ``ratio`` is the code's ``n_sample=0.5``; draws are
    with replacement (``random.choices``), so a prefix can appear twice. Paper: see ``rest_grpo``.
    """
    n_draw = math.ceil(ratio * num_lines)
    if num_lines == 0 or n_draw == 0:
        return torch.zeros(0, dtype=torch.long)
    probs = rest_prefix_weights(num_lines, alpha=alpha)
    return torch.multinomial(probs, n_draw, replacement=True, generator=generator) + 1


# --------------------------------------------------------------------------- Shuffle-R1


class PairSelection(NamedTuple):
    """Pairwise Trajectory Sampling output.

    ``pairs``: long ``[P, K, 2]`` completion indices (high-advantage, low-advantage) in the group;
    ``weights``: float ``[P, K]`` pair weights for the shuffle; ``advantages``: float ``[P, G]``.
    """

    pairs: Tensor
    weights: Tensor
    advantages: Tensor


def pairwise_trajectory_sampling(
    rewards: Tensor,
    *,
    prune_ratio: float = 0.5,
    weight: PairWeight = "sum",
    eps: float = 1e-6,
) -> PairSelection:
    """Shuffle-R1 Pairwise Trajectory Sampling (PTS): keep the most contrastive pairs per group.

    A_i = (r_i - mean_g r) / (sigma_u + eps), sigma_u the unbiased std (a singleton group uses
    mean 0, std 1, as the code does). Sort the group by A descending (ties keep their order), pair
    1st with last, 2nd with 2nd-last, ..., and keep the first K = int((G // 2) * (1 - prune_ratio))
    pairs, which are the outermost, hence most contrastive. The code does not re-sort the pairs.
    Pair weight w (``sampling_weight``): sum |A_a| + |A_b| (default), max, mean, or pos
    = |max(A_a, A_b)|. Shapes: rewards ``[P, G]`` -> :class:`PairSelection` with K pairs a group.
    Paper: "Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via
    Data-centric Dynamic Shuffle", Zhu et al. 2025, arXiv:2508.05612; seed
    ``papers/004_f298e9ec572f7f27.txt:139`` (catalog L139). Code read from an unofficial copy,
    ridwanctg10/shuffle-r1 ``shuffle_r1/custom_algos.py`` (``purning_ratio=0.5``); the official
    repository held only a README, so this is provisional. The code asserts G even; here an odd G
    leaves the median completion unpaired (the same two-pointer loop, without the assert).
    Nearest neighbour: the group filters drop whole groups; PTS drops the middle of every group.
    """
    r_PG = _check_rewards(rewards)
    P, G = r_PG.shape
    if G > 1 and P > 0:
        mean = r_PG.mean(dim=1, keepdim=True)
        std = r_PG.std(dim=1, keepdim=True, unbiased=True)
    else:
        mean, std = torch.zeros(P, 1), torch.ones(P, 1)
    adv_PG = (r_PG - mean) / (std + eps)
    K = int((G // 2) * (1.0 - prune_ratio))
    order_PG = torch.sort(adv_PG, dim=1, descending=True, stable=True).indices
    hi_PK = order_PG[:, :K]
    lo_PK = order_PG.flip(dims=[1])[:, :K]
    pairs_PK2 = torch.stack([hi_PK, lo_PK], dim=2)
    a_hi, a_lo = adv_PG.gather(1, hi_PK), adv_PG.gather(1, lo_PK)
    if weight == "sum":
        w_PK = a_hi.abs() + a_lo.abs()
    elif weight == "max":
        w_PK = torch.maximum(a_hi.abs(), a_lo.abs())
    elif weight == "mean":
        w_PK = (a_hi.abs() + a_lo.abs()) / 2
    elif weight == "pos":
        w_PK = torch.maximum(a_hi, a_lo).abs()
    else:
        raise ValueError(f"weight must be 'sum', 'max', 'mean' or 'pos'; got {weight!r}")
    return PairSelection(pairs=pairs_PK2, weights=w_PK, advantages=adv_PG)


def shuffle_probabilities(weights: Tensor, *, power: float = 1.0) -> Tensor:
    """Shuffle-R1 pair sampling probabilities: p_j = w_j^power / sum_k w_k^power.

    Shapes: ``[N]`` -> ``[N]``. ``sampling_method="power"``, ``sampling_coeff`` p = 1. When every
    weight is 0 (the code would give NaN) the probabilities are uniform. Paper: see
    :func:`pairwise_trajectory_sampling`.
    """
    w = weights.detach().double().clamp_min(0.0) ** power
    total = w.sum()
    if weights.numel() == 0 or total <= 0:
        return torch.full_like(weights, 1.0 / max(weights.numel(), 1), dtype=torch.float)
    return (w / total).float()


def advantage_batch_shuffle(
    weights: Tensor,
    *,
    generator: torch.Generator,
    replay_times: int = 8,
    power: float = 1.0,
    pairs_per_round: int | None = None,
) -> Tensor:
    """Shuffle-R1 Advantage-based Batch Shuffle (ABS): resample pairs in proportion to weight.

    ``replay_times`` rounds; each draws ``pairs_per_round`` pairs **without** replacement with
    p_j ∝ w_j^power (:func:`shuffle_probabilities`), so a strong pair can appear in several rounds
    and a weak one in none; the rounds are concatenated into the update batch. Default
    ``pairs_per_round = max(1, N // replay_times)`` keeps the batch at about N pairs (the code
    asserts N divisible by ``replay_times``). With ``replay_times == 1`` the pairs are returned in
    order, unshuffled, as in the code. Zero-weight pairs are drawn only after every positive-weight
    pair of the round (``np.random.choice`` would raise instead).
    Shapes: weights ``[N]`` (flattened PTS pair weights) -> long ``[replay_times * per_round]``
    pair indices. Paper: see :func:`pairwise_trajectory_sampling` (``experience_resampling``).
    Nearest neighbour: a plain shuffle gives every pair exactly one appearance.
    """
    n = weights.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    if replay_times <= 1:
        return torch.arange(n)
    per_round = min(n, pairs_per_round if pairs_per_round is not None else max(1, n // replay_times))
    probs = shuffle_probabilities(weights.flatten(), power=power)
    positive = (probs > 0).nonzero().flatten()
    zero = (probs <= 0).nonzero().flatten()
    rounds: list[Tensor] = []
    for _ in range(replay_times):
        k_pos = min(per_round, positive.numel())
        drawn = positive[:0]
        if k_pos > 0:
            drawn = positive[
                torch.multinomial(probs[positive], k_pos, replacement=False, generator=generator)
            ]
        rest = zero[torch.randperm(zero.numel(), generator=generator)[: per_round - k_pos]]
        rounds.append(torch.cat([drawn, rest]))
    return torch.cat(rounds)


# --------------------------------------------------------------------------- RoRecomp


def rorecomp_priority_mask(
    rewards: Tensor, lengths: Tensor, *, correct_above: float = 0.0, top_k: int | None = None
) -> Tensor:
    """RoRecomp priority batch: short-correct and long-incorrect responses of every group.

    Per group: correct = r > ``correct_above``. With ``top_k=None`` (median split):
    short-correct = correct and len < median(len of the group's correct responses);
    long-wrong = wrong and len > median(len of its wrong responses); the median is numpy's
    (mean of the two middle values). With ``top_k=k``: the k shortest correct and the k longest
    wrong responses (ties by index). Priority = short-correct or long-wrong; the rest goes to the
    compensation replay buffer (:func:`compensation_push`).
    Shapes: rewards, lengths ``[P, G]`` -> priority ``[P, G]`` bool.
    Paper: "RoRecomp: Enhancing Reasoning Efficiency via Rollout Response Recomposition in
    Reinforcement Learning", Li et al. 2025, arXiv:2509.25958; seed
    ``papers/004_f298e9ec572f7f27.txt:123`` (catalog L123). **Reconstruction, no code found**: the
    threshold (median or k), whether advantages are recomputed after selection, and the
    compensation interval are not established. Advantages are meant to be computed on the full
    group first. A lone correct (or wrong) response equals its own median and is not selected.
    Nearest neighbour: Shuffle-R1 PTS also keeps the extremes of a group, but by advantage, not
    by length within the correct / wrong halves.
    """
    r_PG, len_PG = _check_rewards(rewards), lengths.detach().float()
    if len_PG.shape != r_PG.shape:
        raise ValueError(f"lengths {tuple(len_PG.shape)} must match rewards {tuple(r_PG.shape)}")
    correct_PG = r_PG > correct_above
    out = torch.zeros_like(correct_PG)
    for p in range(r_PG.shape[0]):  # groups are small; a loop keeps the median rule readable
        for subset, short in ((correct_PG[p], True), (~correct_PG[p], False)):
            idx = subset.nonzero().flatten()
            if idx.numel() == 0:
                continue
            lens = len_PG[p, idx]
            if top_k is None:
                med = torch.quantile(lens, 0.5)
                chosen = idx[lens < med] if short else idx[lens > med]
            else:
                order = torch.sort(lens, descending=not short, stable=True).indices
                chosen = idx[order[:top_k]]
            out[p, chosen] = True
    return out


@dataclass(frozen=True)
class CompensationBuffer:
    """RoRecomp replay buffer of non-priority samples, as opaque integer ids, oldest first."""

    items: tuple[int, ...] = ()


def compensation_push(
    buffer: CompensationBuffer, sample_ids: Sequence[int], *, capacity: int | None = None
) -> CompensationBuffer:
    """Append ``sample_ids`` to the buffer; keep the newest ``capacity`` (None: unbounded).

    The caller keeps the samples themselves, keyed by id. Paper: see
    :func:`rorecomp_priority_mask` (the capacity is not given there).
    """
    items = buffer.items + tuple(int(i) for i in sample_ids)
    if capacity is not None:
        items = items[max(0, len(items) - capacity) :]
    return CompensationBuffer(items=items)


def compensation_draw(
    buffer: CompensationBuffer, *, batch_size: int, generator: torch.Generator
) -> tuple[tuple[int, ...], CompensationBuffer]:
    """Draw a compensation batch: ``batch_size`` ids uniformly without replacement, and remove them.

    Returns ``(ids, new_buffer)``; fewer ids when the buffer holds fewer. Uniform sampling and
    removal are this library's reading (the paper says "sample from the replay buffer"); when
    to run a compensation batch (a fixed interval or ratio) is left to the caller.
    """
    n = len(buffer.items)
    take = torch.randperm(n, generator=generator)[: max(0, min(batch_size, n))].tolist()
    taken = set(take)
    ids = tuple(buffer.items[i] for i in take)
    left = tuple(x for i, x in enumerate(buffer.items) if i not in taken)
    return ids, CompensationBuffer(items=left)


# --------------------------------------------------------------------------- HINT


def hint_reroll_mask(rewards: Tensor, *, wrong_reward: float = 0.0) -> Tensor:
    """HINT: which groups are all wrong and must be regenerated with the hint: all_g r_pg == 0.

    Shapes: rewards ``[P, G]`` (total reward per completion) -> reroll ``[P]`` bool; a group of
    size 0 is never re-rolled. The re-rolled group **replaces** the original one, is sampled from
    :func:`hint_prompt`, and is trained on the prompt *without* the hint (``policy_prompt_fn``),
    so its log-probs are off-policy (AAPO's Affinity weight corrects for this).
    Paper: "Don't Tell the Answer, Truly Guide the Reasoning During RL Rollouts" (HINT), Wang et
    al. 2025, arXiv:2510.09388; seed ``papers/000_99b2b1db2eead048.txt:3`` (catalog 3.1). Code:
    ViviqwerAsd/HINT ``lsrl_hint.py`` (``all(r['total'] == 0 ...)``).
    Nearest neighbour: ``dynamic_sampling`` drops the all-wrong group; HINT rescues it with a hint.
    """
    r_PG = _check_rewards(rewards)
    if r_PG.shape[1] == 0:
        return torch.zeros(r_PG.shape[0], dtype=torch.bool)
    return (r_PG == wrong_reward).all(dim=1)


def hint_prompt(question: str, hint: str, *, preamble: str = HINT_PREAMBLE) -> str:
    r"""HINT's re-roll prompt: Q + preamble + H, with H the dataset's ``abstract_hint`` field.

    The default preamble is the catalog's (HINT @ 2e917e5bc3). The stored copy at b9e003c uses
    ``"\nHere are some key information provided to assist you in solving the problem:\n"``;
    pass it as ``preamble`` to match that version. The chat template is applied by the caller.
    """
    return question + preamble + hint


# --------------------------------------------------------------------------- pass-rate history


@dataclass(frozen=True)
class PassRateHistory:
    """Per-prompt pass-rate bookkeeping (read-only mappings keyed by prompt id).

    ``rates``: the group pass rate of each update in which the prompt appeared, oldest first
    (the last ``window`` when :func:`update` is given one); ``ema``: exponential moving average
    of those rates; ``attempts`` / ``successes``: completions and correct completions seen.
    """

    rates: Mapping[PromptId, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    ema: Mapping[PromptId, float] = field(default_factory=lambda: MappingProxyType({}))
    attempts: Mapping[PromptId, int] = field(default_factory=lambda: MappingProxyType({}))
    successes: Mapping[PromptId, int] = field(default_factory=lambda: MappingProxyType({}))


def update(
    history: PassRateHistory,
    prompt_ids: Sequence[PromptId],
    rewards: Tensor,
    *,
    correct_above: float = 0.0,
    ema_decay: float = 0.9,
    window: int | None = None,
) -> PassRateHistory:
    """Record one step's pass rates: rate_p = mean_g 1[r_pg > correct_above]; return a new history.

    Shapes: ``prompt_ids`` length P, rewards ``[P, G]``. A prompt id that occurs on several rows
    (1-shot RLVR repeats its one example) gives one observation pooled over all its rows.
    EMA: ema <- ema_decay * ema + (1 - ema_decay) * rate, starting at the first rate.
    ``correct_above=0`` counts r > 0 as correct, right for {0, 1} and {-1, 1} rewards.
    The input history is not modified.
    """
    r_PG = _check_rewards(rewards)
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None; got {window}")
    if len(prompt_ids) != r_PG.shape[0]:
        raise ValueError(f"{len(prompt_ids)} prompt ids for {r_PG.shape[0]} reward rows")
    ok_P = (r_PG > correct_above).sum(dim=1).tolist()
    step_ok: dict[PromptId, int] = {}
    step_n: dict[PromptId, int] = {}
    for pid, ok in zip(prompt_ids, ok_P, strict=True):
        step_ok[pid] = step_ok.get(pid, 0) + int(ok)
        step_n[pid] = step_n.get(pid, 0) + r_PG.shape[1]
    rates = dict(history.rates)
    ema = dict(history.ema)
    attempts = dict(history.attempts)
    successes = dict(history.successes)
    for pid, n in step_n.items():
        if n == 0:
            continue
        rate = step_ok[pid] / n
        seq = rates.get(pid, ()) + (rate,)
        rates[pid] = seq[-window:] if window else seq
        ema[pid] = ema_decay * ema[pid] + (1 - ema_decay) * rate if pid in ema else rate
        attempts[pid] = attempts.get(pid, 0) + n
        successes[pid] = successes.get(pid, 0) + step_ok[pid]
    return PassRateHistory(
        rates=MappingProxyType(rates),
        ema=MappingProxyType(ema),
        attempts=MappingProxyType(attempts),
        successes=MappingProxyType(successes),
    )


def pass_rate_std(history: PassRateHistory) -> dict[PromptId, float]:
    """Historical variance score of each prompt: score_i = sigma_p(pass rates of i) (population).

    Worked numbers: [0, 1, 0, 1] -> 0.5; [1, 1, 1, 1] -> 0; [0, 0, 1, 1, 1] -> 0.489898.
    Paper and nearest neighbour: see :func:`rank_by_historical_variance`.
    """
    out: dict[PromptId, float] = {}
    for pid, seq in history.rates.items():
        t = torch.tensor(seq, dtype=torch.float64)
        out[pid] = float(t.std(unbiased=False)) if t.numel() > 1 else 0.0
    return out


def rank_by_historical_variance(history: PassRateHistory, *, top_n: int | None = None) -> list[PromptId]:
    """1-shot RLVR example ranking: prompt ids sorted by historical-variance score, descending.

    score_i = population std (``np.std``) over training epochs of prompt i's training accuracy
    (:func:`pass_rate_std`); ties keep history order (Python's stable sort, as in the code).
    ``top_n`` keeps the first n (the paper trains on the top 1, repeated). Shapes: history ->
    list of prompt ids. Paper: "Reinforcement Learning for Reasoning in Large Language Models with
    One Training Example", Wang et al. 2025, arXiv:2504.20571; seed
    ``papers/004_f298e9ec572f7f27.txt:215`` (catalog L215). Code: ypwang61/One-Shot-RLVR
    ``data/data_selection.py`` (method ``std``). The paper records one accuracy per epoch; feed
    :func:`update` once per epoch per prompt to match.
    Nearest neighbour: LIMR's learning-impact score (method ``lim``) compares each prompt's
    accuracy curve with the dataset's mean curve instead of its own spread.
    """
    scores = pass_rate_std(history)
    ranked = sorted(scores, key=lambda pid: scores[pid], reverse=True)
    return ranked if top_n is None else ranked[:top_n]
