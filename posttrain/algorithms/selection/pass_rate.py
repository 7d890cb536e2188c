"""Per-prompt pass-rate history and 1-shot RLVR's historical-variance ranking."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _check_rewards

PromptId = int | str


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
    counts: dict[PromptId, tuple[int, int]] = {}
    for pid, ok in zip(prompt_ids, ok_P, strict=True):
        prev_ok, prev_n = counts.get(pid, (0, 0))
        counts[pid] = (prev_ok + int(ok), prev_n + r_PG.shape[1])
    return record(history, counts, ema_decay=ema_decay, window=window)


def record(
    history: PassRateHistory,
    counts: Mapping[PromptId, tuple[int, int]],
    *,
    ema_decay: float = 0.9,
    window: int | None = None,
) -> PassRateHistory:
    """Record one observation per prompt from its ``(correct, attempts)`` counts; return a new history.

    rate = correct / attempts (prompts with 0 attempts are skipped); the EMA, window and totals as in
    :func:`update`, which counts a step's rewards and calls this. The input history is not modified.
    """
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None; got {window}")
    rates = dict(history.rates)
    ema = dict(history.ema)
    attempts = dict(history.attempts)
    successes = dict(history.successes)
    for pid, (ok, n) in counts.items():
        if n == 0:
            continue
        if not 0 <= ok <= n:
            raise ValueError(f"prompt {pid!r}: {ok} correct of {n} attempts")
        rate = ok / n
        seq = rates.get(pid, ()) + (rate,)
        rates[pid] = seq[-window:] if window else seq
        ema[pid] = ema_decay * ema[pid] + (1 - ema_decay) * rate if pid in ema else rate
        attempts[pid] = attempts.get(pid, 0) + n
        successes[pid] = successes.get(pid, 0) + ok
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
