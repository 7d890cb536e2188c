"""HINT: the all-wrong re-roll decision and the hint prompt."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _check_rewards

#: HINT's hint preamble, as given in the method catalog (3.1) for ViviqwerAsd/HINT @ 2e917e5bc3.
HINT_PREAMBLE = (
    "\nHere are some key pieces of information to assist your reasoning without revealing the "
    "solution directly:\n"
)


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
