"""Teacher-forced log-probabilities and entropies of completions under a model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from posttrain.learn.chunked import LogitTerm, head_of, token_logprobs
from posttrain.learn.packing import packed_forward, packed_terms
from posttrain.models.cache_arg import with_cache
from posttrain.models.checkpointing import recomputes
from posttrain.models.onednn import packed_linears
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


def completion_logits(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    temperature: float = 1.0,
    share_prefix: bool = True,
    packed: bool = False,
) -> Tensor:
    """Float logits ``[N, T, V]`` (divided by ``temperature``) predicting every completion token.

    ``prompt_ids`` holds one prompt per row (N lists). With ``share_prefix`` (the default) rows
    that share a prompt (the G completions of a group) run the prompt through the model once: its
    KV cache is gathered to the rows, and gradients flow back through the gather, so values and
    gradients equal the unshared computation while prompt tokens cost 1/G of the compute. ``packed``: the rows
    run as one packed sequence instead (``learn/packing.py``; no prefix sharing).
    """
    def run(keep: int, **inputs: object) -> Tensor:  # the last `keep` positions' logits
        return model(**inputs, logits_to_keep=keep).logits

    logits_NTV = _completion_forward(run, model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id,
                                     share_prefix, packed)
    logits_NTV = logits_NTV.float()
    return logits_NTV / temperature if temperature != 1.0 else logits_NTV


def logprobs_from_logits(
    logits_NTV: Tensor, completion_ids_NT: Tensor, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log pi of the given tokens ``[N, T]`` and, optionally, the entropy ``[N, T]`` (no gradient)."""
    logp_NTV = logits_NTV.log_softmax(-1)
    logp_NT = logp_NTV.gather(-1, completion_ids_NT.to(logits_NTV.device)[..., None])[..., 0]
    entropy_NT = None
    if with_entropy:
        with torch.no_grad():
            entropy_NT = -(logp_NTV.exp() * logp_NTV).sum(-1)
    return logp_NT, entropy_NT


def mean_log_softmax(logits: Tensor) -> Tensor:
    """Mean over the vocabulary of log softmax(logits), ``[..., V] -> [...]``: mean_a z_a - logsumexp(z).

    A logit term for :func:`completion_terms` (the loss input ``mean_logsoftmax``); ROVER's
    ``sum_log_softmax`` computes the same mean over the whole output head.
    """
    logits = logits.float()
    return logits.mean(-1) - torch.logsumexp(logits, dim=-1)


def log_partition(logits: Tensor) -> Tensor:
    """Log-partition log sum_a exp(logits_a), ``[..., V] -> [...]``: the logits' level, which log softmax removes.

    A logit term for :func:`completion_terms` (the loss inputs ``logsumexp``, with gradient, and ``ref_logsumexp``):
    ShiQ reads it as the value V(s_t) of the state that predicts token t.
    """
    return torch.logsumexp(logits.float(), dim=-1)


class RootForward(torch.nn.Module):
    """Runs a function of the wrapped model as this module's forward (``wrapper(fn, *a, **kw)`` is
    ``fn(model, *a, **kw)``): the root of an FSDP-sharded policy (``learn/distributed/fsdp.py``). As the root it
    gathers every parameter used outside the decoder layers (embeddings, final norm, the chunked
    output head) for the whole computation and reduces their gradients after it.
    :func:`completion_terms` calls through it with prefix sharing off: every call is then one pass
    through the layers, on every rank alike (a second pass on one rank would desynchronize the
    ranks' collectives).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        """``fn(model, *args, **kwargs)``, its view outputs cloned."""
        return _own(fn(self.module, *args, **kwargs))


def _own(out: object) -> object:
    """``out`` with every tensor that is a view cloned (FSDP hooks the root's outputs for its
    backward; an in-place op on a view would drop that hook).
    """
    if isinstance(out, Tensor):
        return out.clone() if out._is_view() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_own(o) for o in out)
    return out


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prefix: bool = True,
    packed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log pi(y_t | x, y_<t) for every completion token, ``[N, T]``, and optionally the entropy.

    ``completion_mask_NT`` is the attention mask of the completion tokens (a rollout's
    ``attention_mask``, not its loss mask). Logits are divided by ``temperature`` so the result
    matches the sampler's log-probs. The output head runs chunk by chunk over the final hidden
    states (``learn/chunked.py``): no float ``[N, T, V]`` tensor is built. Entropy carries no
    gradient.
    """
    logp, entropy, _ = completion_terms(model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id,
                                        temperature=temperature, with_entropy=with_entropy, share_prefix=share_prefix,
                                        packed=packed)
    return logp, entropy


def completion_terms(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prefix: bool = True,
    terms: Sequence[LogitTerm] = (),
    chunk_tokens: int | None = None,
    packed: bool = False,
) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """:func:`completion_logprobs` plus ``terms``: per-token functions of the (temperature-scaled)
    logits, ``[N, T]`` each (an entropy regularizer's term), computed inside each chunk. ``packed``
    (``train.packing``): the rows run as one packed sequence (``learn/packing.py``).
    """
    if isinstance(model, RootForward):  # an FSDP-sharded policy: the whole computation is the root's forward
        return model(completion_terms, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id,
                     temperature=temperature, with_entropy=with_entropy, share_prefix=False, terms=terms,
                     chunk_tokens=chunk_tokens, packed=packed)
    head = head_of(model)
    if head is None:  # a model that transforms its logits: its own forward, [N, T, V] and all
        logits_NTV = completion_logits(model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id,
                                       temperature=temperature, share_prefix=share_prefix, packed=packed)
        logp, entropy = logprobs_from_logits(logits_NTV, completion_ids_NT, with_entropy)
        return logp, entropy, [t(logits_NTV) for t in terms]
    if packed:  # one packed sequence; the head on its real positions only (learn/packing.py)
        return packed_terms(model, head, prompt_ids, completion_ids_NT, completion_mask_NT, temperature=temperature,
                            with_entropy=with_entropy, terms=terms, chunk_tokens=chunk_tokens)
    hidden = completion_hidden(model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id=pad_id,
                               share_prefix=share_prefix)
    logp, extra, entropy = token_logprobs(head, hidden, completion_ids_NT, temperature=temperature,
                                          with_entropy=with_entropy, terms=terms, chunk_tokens=chunk_tokens)
    return logp, entropy, extra


def completion_hidden(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    *,
    pad_id: int,
    share_prefix: bool = True,
) -> Tensor:
    """Final hidden states ``[N, T, H]``: position t is the state that predicts completion token t.

    The trunk of :func:`completion_logits` without the output head (same shared-prefix forward).
    """
    trunk = model.get_decoder()

    def run(keep: int, **inputs: object) -> Tensor:  # the last `keep` positions' hidden states
        return trunk(**inputs).last_hidden_state[:, -keep:]

    with packed_linears(trunk):  # fp32 on a CPU: oneDNN's kernels on packed weights (models/onednn.py)
        return _completion_forward(run, model, prompt_ids, completion_ids_NT, completion_mask_NT, pad_id,
                                   share_prefix)


def _completion_forward(
    run: Callable[..., Tensor],
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    completion_ids_NT: Tensor,
    completion_mask_NT: Tensor,
    pad_id: int,
    share_prefix: bool,
    packed: bool = False,
) -> Tensor:
    """``[N, T, X]`` outputs of ``run`` (logits, or hidden states) at the positions that predict each
    completion token. With ``share_prefix`` rows that share a prompt run it once: its KV cache is
    gathered to the rows, and gradients flow back through the gather. ``packed``: one packed sequence of
    every row's real tokens (``learn/packing.py``), no prompt shared.
    """
    if packed:
        return packed_forward(run, model, prompt_ids, completion_ids_NT, completion_mask_NT)
    index: dict[tuple[int, ...], int] = {}
    row_to_unique = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    device = next(model.parameters()).device
    ids_NT, mask_NT = completion_ids_NT.to(device), completion_mask_NT.to(device)
    t = ids_NT.shape[1]
    # a checkpointed layer keeps no cache (models/checkpointing.py): each row runs its own prompt then
    if not (share_prefix and len(index) < len(prompt_ids)) or recomputes(model):
        ids, attn, pos = build_batch(prompt_ids, completion_ids_NT, completion_mask_NT, pad_id)
        out = run(t + 1, input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                  use_cache=False)
        return out[:, -t - 1 : -1]
    ids_UL, attn_UL = left_pad([list(u) for u in index], pad_id)
    ids_UL, attn_UL = ids_UL.to(device), attn_UL.to(device)
    pos_UL = (attn_UL.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    kw = with_cache(model, cache)  # the decoder alone takes the same keyword
    first = run(1, input_ids=ids_UL, attention_mask=attn_UL, position_ids=pos_UL, use_cache=True, **kw)
    rows = torch.tensor(row_to_unique, device=device)
    first_N1X = first[rows]  # the prompt's last position predicts completion token 0
    if t == 1:
        return first_N1X
    cache.batch_select_indices(rows)  # differentiable gather: gradients sum over the group
    attn = torch.cat([attn_UL[rows], mask_NT[:, :-1].long()], 1)
    pos = pos_UL[rows, -1:] + 1 + torch.arange(t - 1, device=device)
    rest = run(t - 1, input_ids=ids_NT[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True, **kw)
    return torch.cat([first_N1X, rest], 1)


@torch.no_grad()
def prompt_logprobs(
    model: PreTrainedModel, prompt_ids: list[list[int]], *, pad_id: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log pi(x_j | x_<j) of every prompt token after the first, ``[P, L-1]``, and its mask (no gradient).

    Prompts are left-padded to L; position j holds the log-prob of token j+1 given tokens <= j,
    and the mask is 1 where both are real tokens (0 on padding, so 0 for a prompt's first token,
    which nothing predicts). Logits are divided by ``temperature``, as the sampler's are. The output
    head runs chunk by chunk over the trunk's hidden states, as in :func:`completion_logprobs` (a model
    that transforms its logits runs its own forward). Both come back on the CPU, beside the rewards.
    """
    device = next(model.parameters()).device
    ids_PL, attn_PL = left_pad(prompt_ids, pad_id)
    pos_PL = (attn_PL.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": ids_PL.to(device), "attention_mask": attn_PL.to(device), "position_ids": pos_PL.to(device),
              "use_cache": False}
    targets = ids_PL[:, 1:].to(device)
    head = head_of(model)
    if targets.shape[1] == 0:  # one-token prompts: nothing to predict
        logp_PL = torch.zeros(targets.shape)
    elif head is None:  # its own forward, [P, L, V] logits and all
        logits = model(**inputs).logits[:, :-1].float()
        logits = logits / temperature if temperature != 1.0 else logits
        logp_PL = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    else:
        trunk = model.get_decoder()
        with packed_linears(trunk):  # as completion_hidden's
            hidden = trunk(**inputs).last_hidden_state[:, :-1]
        logp_PL = token_logprobs(head, hidden, targets, temperature=temperature)[0]
    mask_PL = attn_PL[:, 1:] * attn_PL[:, :-1]
    return logp_PL.float().cpu() * mask_PL, mask_PL
