"""Teacher-forced log-probabilities and entropies of completions under a model."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from posttrain.rollout.hf import left_pad


def build_batch(
    prompt_ids: list[list[int]], completion_ids_NT: Tensor, completion_mask_NT: Tensor, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate left-padded prompts (one per row) with right-padded completions.

    Returns (input ids ``[N, L+T]``, attention mask ``[N, L+T]``, position ids ``[N, L+T]``).
    """
    ids_NL, attn_NL = left_pad(prompt_ids, pad_id)
    ids = torch.cat([ids_NL, completion_ids_NT], 1)
    attn = torch.cat([attn_NL, completion_mask_NT.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, pos


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(y_t | x, y_<t) for every completion token, ``[N, T]``, and optionally the entropy.

    ``prompt_ids`` holds one prompt per row (N lists).

    Logits are divided by ``temperature`` so the result matches the sampler's log-probs. Only the
    ``T`` positions that predict completion tokens are projected to the vocabulary. Entropy is
    computed without gradient (a diagnostic).
    """
    ids, attn, pos = build_batch(prompt_ids, completion_ids_NT, completion_mask_NT, pad_id)
    device = next(model.parameters()).device
    t = completion_ids_NT.shape[1]
    out = model(
        input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
        use_cache=False, logits_to_keep=t + 1,
    )
    logits_NTV = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits_NTV = logits_NTV / temperature
    logp_NTV = logits_NTV.log_softmax(-1)
    logp_NT = logp_NTV.gather(-1, completion_ids_NT.to(device)[..., None])[..., 0]
    entropy_NT = None
    if with_entropy:
        with torch.no_grad():
            entropy_NT = -(logp_NTV.exp() * logp_NTV).sum(-1)
    return logp_NT, entropy_NT
