"""ReST-GRPO partial-state prompts: which prompts get them, line prefixes and prefix sampling."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _check_rewards
from posttrain.algorithms.selection.filters import rest_grpo


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


def line_prefixes(completion: str, sep: str = "\n") -> list[str]:
    r"""Split a completion into line prefixes: prefix k = its first k lines, each ending in a newline.

    As in ReST-RL ``process_gen_data.py``: the completion is right-stripped, split on ``"\n"``,
    and prefix k is ``line_1 + "\n" + ... + line_k + "\n"``; the partial-state prompt is
    ``prompt + prefix``. The last prefix is the whole completion. ``sep`` splits at another
    separator instead (e.g. ``","`` between the arithmetic task's steps), each piece followed by it.
    """
    out: list[str] = []
    acc = ""
    for line in completion.rstrip().split(sep):
        acc += line + sep
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
