"""Group statistics of a GRPO-style batch: how many groups and samples carry a learning signal."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.diagnostics._masked import to_floats


@torch.no_grad()
def group_stats(
    rewards_PG: Tensor,
    advantages: Tensor | None = None,
    *,
    correct_PG: Tensor | None = None,
    threshold: float = 0.5,
    atol: float = 1e-8,
) -> dict[str, float]:
    """Per-step group statistics, each a fraction in [0, 1] except ``reward_mean``.

    A sample is correct when ``rewards >= threshold`` (or as given by the boolean ``correct_PG``,
    e.g. from the verifier when rewards mix in format or length terms). Over the P groups:

    - ``solve_none``: groups with no correct sample (HINT re-rolls these with a hint),
      ``solve_all``: every sample correct, ``solve_partial``: the rest, as fractions of groups
      (names as prime-rl's and rllm's ``batch/solve_none`` etc., which some trainers log as counts);
    - ``zero_std_frac``: groups whose rewards are all equal (within ``atol``); with binary rewards
      that is solve_none + solve_all, and these are the groups DAPO's dynamic sampling drops;
    - ``zero_adv_frac`` (only when ``advantages`` is given): samples with |A| <= atol, which
      contribute no policy gradient. Advantages ``[P, G]``, or ``[P, G, T]`` where a sample
      counts as zero when all its T entries are (pad entries must be 0).

    Shapes: rewards ``[P, G]``; correct_PG ``[P, G]`` bool.
    Example: rewards [[1, 1], [0, 1], [0, 0]] -> solve_all 1/3, solve_partial 1/3,
    solve_none 1/3, zero_std_frac 2/3, reward_mean 0.5.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be [P, G]; got shape {tuple(rewards_PG.shape)}")
    r = rewards_PG.float()
    ok = (r >= threshold) if correct_PG is None else correct_PG.to(torch.bool)
    n_correct = ok.sum(dim=1)
    g = r.shape[1]
    stats = {
        "reward_mean": r.mean(),
        "solve_none": (n_correct == 0).float().mean(),
        "solve_all": (n_correct == g).float().mean(),
        "solve_partial": ((n_correct > 0) & (n_correct < g)).float().mean(),
        "zero_std_frac": ((r.amax(dim=1) - r.amin(dim=1)) <= atol).float().mean(),
    }
    if advantages is not None:
        a = advantages.float().abs()
        per_sample = a if a.dim() == 2 else a.flatten(2).amax(dim=2)
        stats["zero_adv_frac"] = (per_sample <= atol).float().mean()
    return to_floats(stats)
