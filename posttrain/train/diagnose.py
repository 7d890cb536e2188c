"""The loop's diagnostics: cheap ones every step, expensive ones every ``diagnostics.every`` steps.

Cheap (from tensors the step already has): group statistics (``groups/solve_none``,
``solve_all``, ``solve_partial``, ``zero_std_frac``, ``zero_adv_frac``). The update adds its own
(ratios, clip fractions, entropy of the high-entropy minority, HINT's Affinity; see
``learn/update.py``).

Expensive (an extra forward pass on ``diagnostics.samples`` completions):

- ``diag/effective_rank``: mean effective rank of each response's final-layer hidden states
  (VERL, ``papers/004_f298e9ec572f7f27.txt:3``), ``diag/erv`` / ``diag/era``, VERL's rank
  velocity / acceleration over each response's growing token prefixes (every
  ``diagnostics.rank_stride`` tokens), averaged over the responses, and ``diag/erv_steps`` /
  ``diag/era_steps``, the same first / second difference rule applied across the measured steps
  to the mean effective rank (state kept in the loop state, so a resumed run continues the series);
- ``diag/divergence_*``: token-level Jensen-Shannon divergence between the current policy and the
  starting model (``papers/004_f298e9ec572f7f27.txt:191``): mean, max and the fraction of tokens
  above 0.1 nats.

The functions themselves are pure and live in :mod:`posttrain.diagnostics`.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
from torch import Tensor
from transformers import PreTrainedModel

from posttrain.diagnostics import divergence_stats, effective_rank, effective_rank_dynamics, group_stats
from posttrain.diagnostics.rank import RankDynamicsState, rank_dynamics_update
from posttrain.learn.logprobs import build_batch, completion_logits


def step_group_stats(rewards_PG: Tensor, adv: Tensor, correct_PG: Tensor) -> dict[str, float]:
    """``groups/*`` metrics of one step (correctness from the task's verifier)."""
    stats = group_stats(rewards_PG, adv.reshape(*rewards_PG.shape, -1), correct_PG=correct_PG)
    stats.pop("reward_mean", None)
    return {f"groups/{k}": v for k, v in stats.items()}


@torch.no_grad()
def final_hidden_states(
    model: PreTrainedModel, prompt_ids: list[list[int]], ids_NT: Tensor, mask_NT: Tensor, pad_id: int
) -> Tensor:
    """Last-layer hidden states at the completion tokens, ``[N, T, D]``."""
    ids, attn, pos = build_batch(prompt_ids, ids_NT, mask_NT, pad_id)
    device = next(model.parameters()).device
    out = model(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        position_ids=pos.to(device),
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    return out.hidden_states[-1][:, -ids_NT.shape[1] :].float()


@torch.no_grad()
def expensive_diagnostics(
    model: PreTrainedModel,
    base_model: PreTrainedModel | None,
    prompt_ids: list[list[int]],
    ids_NT: Tensor,
    mask_NT: Tensor,
    *,
    pad_id: int,
    temperature: float,
    samples: int,
    rank_state: dict,
    stride: int = 0,
) -> tuple[dict[str, float], dict]:
    """Effective rank, VERL's ERV / ERA, and divergence from the starting model.

    Uses the first ``samples`` rows that have tokens. ``diag/erv`` / ``diag/era`` are VERL's: the
    mean over the responses of each one's rank velocity / acceleration over its own growing token
    prefixes (:func:`~posttrain.diagnostics.rank.effective_rank_dynamics` with ``stride``, 0: a
    response of length T takes max(1, T // 16), about 16 SVDs; NaN where no response is long
    enough). ``diag/erv_steps`` / ``diag/era_steps`` apply the same rule across training steps to
    the batch's mean effective rank. Returns the metrics and the
    new rank state (a plain dict of :class:`~posttrain.diagnostics.rank.RankDynamicsState`, for
    checkpoints).
    """
    rows = [i for i in range(ids_NT.shape[0]) if mask_NT[i].sum() > 0][:samples]
    if not rows:
        return {}, rank_state
    idx = torch.tensor(rows)
    prompts = [prompt_ids[i] for i in rows]
    ids, mask = ids_NT[idx], mask_NT[idx]
    was_training = model.training
    model.eval()
    hidden = final_hidden_states(model, prompts, ids, mask, pad_id)
    m = mask.to(hidden.device).bool()
    er = float(effective_rank(hidden, m).mean())
    state = rank_dynamics_update(RankDynamicsState(**rank_state), er)
    lengths = m.sum(1).tolist()
    per_row = [effective_rank_dynamics(hidden[i][m[i]], stride=stride or max(1, int(lengths[i]) // 16))
               for i in range(hidden.shape[0])]
    metrics = {"diag/effective_rank": er, "diag/erv": _nanmean([v for _, v, _ in per_row]),
               "diag/era": _nanmean([a for _, _, a in per_row]), "diag/erv_steps": state.erv,
               "diag/era_steps": state.era}
    if base_model is not None:
        kw = {"pad_id": pad_id, "temperature": temperature}
        logits = completion_logits(model, prompts, ids, mask, **kw)
        base = completion_logits(base_model, prompts, ids, mask, **kw).to(logits.device)
        metrics.update({f"diag/{k}": v for k, v in divergence_stats(logits, base, mask.to(logits.device)).items()})
    model.train(was_training)
    return metrics, asdict(state)


def _nanmean(xs: list[float]) -> float:
    """The mean of the values that are not NaN (NaN if none is)."""
    kept = [x for x in xs if not math.isnan(x)]
    return sum(kept) / len(kept) if kept else math.nan
