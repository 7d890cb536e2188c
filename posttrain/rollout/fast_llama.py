"""A lean decode path for LLaMA-family models (llama, mistral, qwen2) over the model's own modules.

The generic path runs the Hugging Face forward once per new token; for small models on a CPU its
per-call overhead (mask building, cache bookkeeping) dominates. This path runs the same modules
(the projections, norms and rotary embedding of the loaded model, so any weights and biases are
the model's own) with a preallocated KV cache written in place, one boolean padding mask, and
``scaled_dot_product_attention``. It is exact up to float rounding: the engine tests check its
log-probs against a teacher-forced Hugging Face forward and its greedy tokens against the generic
path. Models it does not cover use the generic path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SUPPORTED = ("llama", "mistral", "qwen2")


def supports(model: PreTrainedModel) -> bool:
    """Whether ``model`` has the plain LLaMA block this path implements."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return cfg.model_type == "llama"  # llama has no sliding window; others would need it
    layer = model.model.layers[0]
    return all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and not hasattr(
        layer.self_attn, "q_norm"
    )


class StaticKV:
    """Per-layer K/V buffers ``[B, H_kv, S, D]`` written in place."""

    def __init__(self, n_layers: int, batch: int, heads: int, length: int, dim: int, like: Tensor) -> None:
        self.k = [like.new_zeros(batch, heads, length, dim) for _ in range(n_layers)]
        self.v = [like.new_zeros(batch, heads, length, dim) for _ in range(n_layers)]

    def repeat_rows(self, n: int, width: int) -> None:
        """Repeat every row ``n`` times (the group's completions share their prompt's cache)."""
        self.k = [k.repeat_interleave(n, 0) for k in self.k]
        self.v = [v.repeat_interleave(n, 0) for v in self.v]


def _forward(
    model: PreTrainedModel, ids: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, kv: StaticKV, start: int,
    mask: Tensor,
) -> Tensor:
    """Run tokens ``ids [B, S]`` at cache slots ``start..start+S``; returns last-position logits ``[B, V]``.

    ``mask [B, 1, S, start+S]`` is True where attention is allowed.
    """
    cfg = model.config
    inner = model.model
    b, s = ids.shape
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    x = inner.embed_tokens(ids)
    c, sn = cos[pos], sin[pos]  # [B, S, D]
    end = start + s
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, s, n_heads, head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, s, n_kv, head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, s, n_kv, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, c, sn)
        kv.k[i][:, :, start:end] = k
        kv.v[i][:, :, start:end] = v
        keys, values = kv.k[i][:, :, :end], kv.v[i][:, :, :end]
        if s == 1:
            # one query per row: the query heads that share a K/V head form that head's query rows
            # ([B, H_kv, H / H_kv, D]), so K/V are read in place, never repeated per query head
            qg = q.reshape(b, n_kv, n_heads // n_kv, head_dim)
            scores = (qg @ keys.transpose(-1, -2)) * head_dim**-0.5
            o = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).reshape(b, s, n_heads * head_dim)
        else:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=n_kv != n_heads)
            o = o.transpose(1, 2).reshape(b, s, n_heads * head_dim)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x[:, -1]))


def prefill_and_decode_setup(
    model: PreTrainedModel, ids_PL: Tensor, attn_PL: Tensor, n: int, max_new: int
) -> tuple[Tensor, StaticKV, Tensor, Tensor, Tensor, Tensor]:
    """Prefill the prompts once and repeat their cache ``n`` times.

    Returns (first logits ``[N, V]``, cache, cos, sin, padding mask ``[N, L+max_new]``, next position ``[N]``).
    """
    cfg = model.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    p, width = ids_PL.shape
    total = width + max_new
    positions = torch.arange(total, device=ids_PL.device)
    dummy = model.model.embed_tokens.weight
    cos, sin = model.model.rotary_emb(dummy, positions[None])
    cos, sin = cos[0], sin[0]  # [total, D]
    kv = StaticKV(len(model.model.layers), p, n_kv, total, head_dim, dummy)
    pos_PL = (attn_PL.cumsum(-1) - 1).clamp(min=0)
    keep = attn_PL.bool()
    causal = torch.ones(width, width, dtype=torch.bool, device=ids_PL.device).tril()
    # a left-padded row must still attend somewhere: pad positions attend to themselves
    mask = (causal[None] & keep[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids_PL.device)[None]
    logits = _forward(model, ids_PL, pos_PL, cos, sin, kv, 0, mask[:, None])
    if n > 1:
        kv.repeat_rows(n, width)
        logits = logits.repeat_interleave(n, 0)
        keep = keep.repeat_interleave(n, 0)
        pos_PL = pos_PL.repeat_interleave(n, 0)
    pad = torch.cat([keep, torch.ones(keep.shape[0], max_new, dtype=torch.bool, device=keep.device)], 1)
    return logits, kv, cos, sin, pad, pos_PL[:, -1] + 1


def decode_step(
    model: PreTrainedModel, tokens_N: Tensor, pos_N: Tensor, cos: Tensor, sin: Tensor, kv: StaticKV, slot: int,
    pad: Tensor,
) -> Tensor:
    """One new token per row at cache ``slot``; returns logits ``[N, V]``."""
    mask = pad[:, None, None, : slot + 1]
    return _forward(model, tokens_N[:, None], pos_N[:, None], cos, sin, kv, slot, mask)
