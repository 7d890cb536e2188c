"""Attention for short sequences on a CPU in bf16: grouped-query attention as two batched matmuls.

PyTorch's CPU flash kernel (what ``sdpa`` reaches on a CPU) is slow in bf16 at the shapes a
post-training step has on a small model: many rows of short sequences. Measured on this project's
2-core machines (``python bench/attention.py``) for SmolLM2-135M's update (64 rows, 63 completion
queries against 113 keys, 9 query heads over 3 K/V heads of size 64), forward and backward of one
layer under bf16 autocast: sdpa 81 ms, the two matmuls here 40 ms (30 layers: ~1.2 s of a ~15 s
update); 16 x 127 over 177 keys: 44 vs 20 ms. In fp32 the flash kernel is as fast (55 vs 58 ms),
and from ~256 keys on it is in bf16 too, so those go to sdpa.

This function runs the scores and the weighted sum as matmuls over the K/V heads (the ``g = H /
H_kv`` query heads of K/V head ``j`` are ``j * g .. j * g + g - 1``, HF's ``repeat_kv`` order,
stacked as rows of one matrix: no copy of K or V per query head) with the softmax in fp32, as HF's
eager attention. It falls back to ``sdpa`` (:func:`math_pays`) in fp32, on a GPU, with more than
:data:`MAX_KEYS` keys or scores over :data:`SCORES_BYTES` (its memory is quadratic in length, the
flash kernel's linear), with dropout, or with arguments it does not implement (sliding windows,
attention sinks, soft-capping).

A packed sequence (``train.packing``, ``learn/packing.py``: several rows end to end, their bounds in the
varlen keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` that transformers passes through to the attention) runs
each row's causal attention on its own (:func:`_rows`), by the rules above: attention never crosses rows, and
costs what the rows cost, not the pack's square.

``models/load.py`` sets it on every causal LM it loads whose attention is sdpa
(``attn_implementation = "posttrain"``; :func:`use_attention`). It is not written to a saved
``config.json``: a checkpoint loads anywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "posttrain"
SCORES_BYTES = 64 * 2**20  # the largest fp32 scores tensor (one layer's) the matmul path builds
MAX_KEYS = 256  # from about here on the flash kernel is as fast in bf16 (bench/attention.py)
UNSUPPORTED = ("sliding_window", "s_aux", "softcap")  # keyword arguments only sdpa handles here


def math_pays(query: Tensor, key: Tensor, dropout: float, kwargs: dict) -> bool:
    """Whether :func:`attention` takes the matmul path (module docstring) for these inputs."""
    b, h, tq, _ = query.shape
    low = torch.is_autocast_enabled("cpu") or query.dtype in (torch.bfloat16, torch.float16)
    return (
        query.device.type == "cpu"
        and low
        and dropout == 0.0
        and key.shape[2] <= MAX_KEYS
        and b * h * tq * key.shape[2] * 4 <= SCORES_BYTES
        and h % key.shape[1] == 0
        and not any(kwargs.get(k) is not None for k in UNSUPPORTED)
    )


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """``softmax(q k^T * scaling + mask) v`` for ``query [B, H, Tq, D]``, ``key``/``value``
    ``[B, H_kv, Tk, D]`` and a boolean ``attention_mask`` ``[B, 1, Tq, Tk]`` (True: attend) or
    ``None`` (causal, the queries the last ``Tq`` positions). Returns ``[B, Tq, H, D]``.
    """
    if kwargs.get("cu_seq_lens_q") is not None:  # a packed sequence (learn/packing.py): each row on its own
        return _rows(module, query, key, value, dropout, scaling, kwargs), None
    if not math_pays(query, key, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    b, h, tq, d = query.shape
    h_kv, tk = key.shape[1], key.shape[2]
    g = h // h_kv
    scale = d**-0.5 if scaling is None else scaling
    q = (query * scale).reshape(b, h_kv, g * tq, d)  # query heads of a K/V head as rows of one matrix
    scores = torch.matmul(q, key.transpose(-1, -2)).view(b, h_kv, g, tq, tk)
    allowed = _allowed(attention_mask, is_causal, module, tq, tk, query.device)
    if allowed is not None:  # a fully masked row (a padding query) gets uniform weights, not NaN
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, h_kv, g * tq, tk), value)  # [B, H_kv, g * Tq, D]
    return out.view(b, h, tq, d).transpose(1, 2).contiguous(), None


def _rows(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, dropout: float, scaling: float | None,
          kwargs: dict) -> Tensor:
    """Causal attention of each row of a packed sequence (``query [1, H, S, D]``; row i holds positions
    ``cu_seq_lens_q[i] .. cu_seq_lens_q[i + 1] - 1``) on its own, ``[1, S, H, D]``: block-diagonal attention
    at the rows' cost, not the pack's square. The 4-D mask the model passes is a placeholder and is not read;
    a sliding window becomes each long row's own mask.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed sequence, got a batch of {query.shape[0]}")
    bounds = kwargs["cu_seq_lens_q"].tolist()
    rest = {k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                           "max_length_k")}
    window = rest.get("sliding_window")
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        mask = None
        if window is not None and e - s > window:  # causal within the window: q - window < k <= q
            i = torch.arange(e - s, device=query.device)
            mask = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - window))[None, None]
        out, _ = attention(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], mask, dropout=dropout,
                           scaling=scaling, is_causal=True, **rest)
        outs.append(out)
    return torch.cat(outs, 1)


def _allowed(mask: Tensor | None, is_causal: bool | None, module: nn.Module, tq: int, tk: int,
             device: torch.device) -> Tensor | None:
    """``[B or 1, 1, 1, Tq, Tk]`` booleans (True: attend), or ``None`` when every key is allowed."""
    if mask is not None:
        if mask.dtype != torch.bool:  # an additive float mask: 0 where allowed
            mask = mask == 0
        return mask[:, :, None]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or tq == 1:
        return None
    rows = torch.arange(tk - tq, tk, device=device)[:, None]  # the queries are the last Tq positions
    return (torch.arange(tk, device=device)[None] <= rows)[None, None, None]


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_attention(model: nn.Module) -> nn.Module:
    """Run ``model``'s attention through :func:`attention` where it uses ``sdpa`` (HF's default), in
    place; a model with another implementation (flash attention, eager) or one that takes no
    attention interface keeps its own. Returns ``model``.
    """
    config = getattr(model, "config", None)
    setter = getattr(model, "set_attn_implementation", None)
    if config is None or setter is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return model
    try:
        setter(NAME)
    except (ValueError, ImportError):  # an architecture without the attention interface
        pass
    return model
