"""Negative-sample variants: GRPO-N, NSR and W-REINFORCE."""

from __future__ import annotations

from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _correct, register
from posttrain.algorithms.advantages.group import grpo


@register("grpo_n")
def grpo_n(rewards: Tensor, *, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """GRPO-N: keep only the relative-negative samples, A^N_i = min(A_i, 0).

    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: arXiv:2510.04028 ("GRPO-N / GSPO-N"), seed
    ``papers/004_f298e9ec572f7f27.txt:169`` (catalog L169). Std convention: **unbiased** (GRPO).
    Nearest neighbour: ``nsr`` gives every wrong answer -1 regardless of the group.
    """
    return grpo(rewards, std=std, eps=eps).clamp(max=0.0)


@register("nsr")
def nsr(rewards: Tensor) -> Tensor:
    """NSR (negative sample reinforcement): A = 0 for correct, -1 for wrong responses.

    Not group-relative, so a group of one is handled like any other. Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning",
    Zhu et al. 2025, arXiv:2506.01347; the seed is ``papers/004_f298e9ec572f7f27.txt:169``
    (catalog L169; A-GRAE's ``compute_psr_nsr_outcome_advantage``). No std. Correct means reward
    > 0.5. Nearest neighbour: ``w_reinforce`` adds a small positive weight on correct answers.
    """
    return _correct(rewards) - 1.0


@register("w_reinforce")
def w_reinforce(rewards: Tensor, *, lam: float = 0.1) -> Tensor:
    """W-REINFORCE: A = lam for correct, -1 for wrong responses (lam = 0.1 up-weights negatives).

    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: Zhu et al. 2025, arXiv:2506.01347; seed
    ``papers/004_f298e9ec572f7f27.txt:169`` (catalog L169). No std; not group-relative. Correct
    means reward > 0.5. Nearest neighbour: ``nsr`` (lam = 0).
    """
    c_PG = _correct(rewards)
    return lam * c_PG - (1.0 - c_PG)
