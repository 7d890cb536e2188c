"""A lean decode path for LLaMA-family models (llama, mistral, qwen2) over the model's own modules.

The generic path runs the Hugging Face forward once per new token; for small models on a CPU its
per-call overhead (mask building, cache bookkeeping) dominates. This path runs the same modules
(the projections, norms and rotary embedding of the loaded model, so any weights, biases and
adapters are the model's own) with preallocated K/V written in place: the prompt's once, shared
by the ``n`` completions of its group (see :class:`DecodeState`), and plain matmuls for the
one-query decode attention (no mask building, no cache bookkeeping per step). It is exact up to
float rounding: the engine tests check its log-probs against a teacher-forced Hugging Face forward
and its greedy tokens against the generic path. Models it does not cover use the generic path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from posttrain.models.precision import active_dtype

SUPPORTED = ("llama", "mistral", "qwen2")


def supports(model: PreTrainedModel) -> bool:
    """Whether ``model`` has the plain LLaMA block this path implements (a module built around one, such
    as ``models/ref_mix.py``'s, runs its own forward: the generic path).
    """
    if not isinstance(model, PreTrainedModel):
        return False
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return cfg.model_type == "llama"  # llama has no sliding window; others would need it
    layer = model.model.layers[0]
    return (
        all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and not hasattr(layer.self_attn, "q_norm")
    )


TRANSPOSE_MIN_TOKENS = 4096  # rows x new tokens from which a transposed weight copy pays for itself


def linear(module: nn.Module, transpose: bool, dtype: torch.dtype | None = None) -> Callable[[Tensor], Tensor]:
    """``x -> module(x)``; with ``transpose``, a plain ``nn.Linear`` (no hooks) runs as
    ``x @ W^T (+ b)`` on a contiguous copy of ``W^T`` made here.

    Why: MKL multiplies ``[M, in]`` by an ``[in, out]`` matrix faster than by the transposed view of
    the ``[out, in]`` weight: 2-20 % over M = 32..256 (20 % at 64 rows) for SmolLM2-135M's shapes
    on one CPU core. The copy costs the weights' size in memory for the call and ~0.35 s for 135M
    parameters, so it is made only for enough decode work (see :func:`prefill`). Anything else (a
    LoRA-wrapped layer, a module with hooks) is called as it is. Under autocast (``dtype``, the
    compute dtype) the copy is made in that dtype, so it is cast once, not at every decode step.
    """
    if not transpose or type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return module
    w = module.weight.detach()
    if (dtype or w.dtype) == torch.bfloat16 and w.device.type == "cpu" and _PACK is not None:
        return _packed(w, module.bias, dtype)
    # one pass: transposed and cast as it is copied
    w_t = torch.empty(w.shape[::-1], dtype=dtype or w.dtype, device=w.device).copy_(w.t())
    bias = module.bias
    if bias is None:
        return lambda x: x @ w_t
    return lambda x: torch.addmm(bias, x.flatten(0, -2), w_t).view(*x.shape[:-1], -1)


def _pack_ops() -> tuple | None:
    """The ops of oneDNN's weight prepacking for bf16 linears on a CPU, where this torch build has them."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_PACK = _pack_ops()
PACK_ROWS = 64  # the batch size oneDNN is told to pack for (a hint: any row count runs)


def _packed(w: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> Callable[[Tensor], Tensor]:
    """``x -> x W^T (+ b)`` in bf16 on a oneDNN-prepacked copy of ``W``.

    Why: a bf16 matmul on a CPU reorders the ``[out, in]`` weight into oneDNN's blocked layout at every
    call; at decode's few rows that reorder is a large share of the call. Packed once per generate call,
    the decode matmuls of SmolLM2-135M's shapes ran 1.36x faster here (26.6 -> 19.6 ms a step for one
    layer's seven matmuls x 30 layers at 16 rows, the weights streamed from memory). fp32 matmuls do not
    gain (MKL's packed sgemm was slower), so this is for bf16 only.
    """
    reorder, pointwise = _PACK
    w16 = w.to(torch.bfloat16)
    packed = reorder(w16, PACK_ROWS)
    b16 = None if bias is None else bias.detach().to(torch.bfloat16)
    return lambda x: pointwise(x.to(torch.bfloat16), packed, b16, "none", [], "")


class Block:
    """One decoder layer's modules, its linears through :func:`linear`."""

    def __init__(self, layer: nn.Module, transpose: bool, dtype: torch.dtype | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_1, self.norm_2, self.act = layer.input_layernorm, layer.post_attention_layernorm, mlp.act_fn
        self.q, self.k, self.v, self.o = (
            linear(m, transpose, dtype) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.gate, self.up, self.down = (
            linear(m, transpose, dtype) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        )


class DecodeState:
    """What a generate call decodes with: K/V of the ``P`` prompts once (``[P, H_kv, L, D]``), K/V of
    the ``N = P * n`` completions (``[N, H_kv, max_new, D]``, written in place), the prompts'
    padding, rotary tables, each row's next position and the layers (:class:`Block`). Completion
    rows are grouped by prompt (row ``r`` continues prompt ``r // n``).

    The ``n`` completions of a prompt attend to one copy of its K/V: a decode step reads the
    prompt part once per group (its ``n * H / H_kv`` query rows per K/V head in one matmul) and
    never repeats it per completion or per query head.
    """

    def __init__(self, model: PreTrainedModel, pad_PL: Tensor, n: int, max_new: int, like: Tensor) -> None:
        cfg = model.config
        dtype = active_dtype(like.device)  # model.autocast: K/V, rotary tables and weight copies in its dtype
        if dtype is not None:  # (fp32 ones would be cast to it again at every decode step)
            like = torch.empty(0, dtype=dtype, device=like.device)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.n = n
        p, width = pad_PL.shape
        layers = len(model.model.layers)
        shape_p, shape_g = (p, self.n_kv, width, self.head_dim), (p * n, self.n_kv, max_new, self.head_dim)
        self.kp = [like.new_zeros(shape_p) for _ in range(layers)]
        self.vp = [like.new_zeros(shape_p) for _ in range(layers)]
        self.kg = [like.new_zeros(shape_g) for _ in range(layers)]
        self.vg = [like.new_zeros(shape_g) for _ in range(layers)]
        self.pad_P = pad_PL[:, None, None, None, :]  # True where a prompt is padding
        positions = torch.arange(width + max_new, device=like.device)
        cos, sin = model.model.rotary_emb(like, positions[None])
        self.cos, self.sin = cos[0], sin[0]  # [L + max_new, D]
        self.next_pos = torch.zeros(p * n, dtype=torch.long, device=like.device)
        # the weights as they are now (a generate call samples from one policy version); transposed
        # copies on the CPU when the decode work pays for them (measured: ~0.35 s for 135M parameters
        # against 2-30 ms a step)
        transpose = like.device.type == "cpu" and p * n * max_new >= TRANSPOSE_MIN_TOKENS
        self.blocks = [Block(layer, transpose, dtype) for layer in model.model.layers]
        self.lm_head = linear(model.lm_head, transpose, dtype)


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, kv: DecodeState, i: int, mask: Tensor) -> Tensor:
    """Prompt self-attention (``q [P, H, L, D]``); stores the prompt's K/V. Returns ``[P, L, H * D]``."""
    kv.kp[i].copy_(k)
    kv.vp[i].copy_(v)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv.n_kv != kv.n_heads)
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, kv: DecodeState, i: int, t: int) -> Tensor:
    """One new token per row (``q [N, H, 1, D]``) at completion slot ``t``. Returns ``[N, 1, H * D]``.

    Scores over [prompt | completion so far] share one softmax; with ``g = H / H_kv`` query heads
    per K/V head, the query heads of K/V head ``j`` are ``j * g .. j * g + g - 1`` (HF's
    ``repeat_kv`` order), and the prompt part multiplies the ``n * g`` query rows of a group at once.
    """
    kv.kg[i][:, :, t : t + 1] = k
    kv.vg[i][:, :, t : t + 1] = v
    kp, vp, kg, vg = kv.kp[i], kv.vp[i], kv.kg[i][:, :, : t + 1], kv.vg[i][:, :, : t + 1]
    p, n_kv, width, d = kp.shape
    n, g, rows = kv.n, kv.n_heads // kv.n_kv, q.shape[0]
    q_grouped = q.reshape(p, n, n_kv, g, d).transpose(1, 2).reshape(p, n_kv, n * g, d)
    s_prompt = (q_grouped @ kp.transpose(-1, -2)).view(p, n_kv, n, g, width)  # [P, H_kv, n, g, L]
    s_new = (q.reshape(rows, n_kv, g, d) @ kg.transpose(-1, -2)).view(p, n, n_kv, g, t + 1).transpose(1, 2)
    s_prompt.masked_fill_(kv.pad_P, float("-inf"))
    # [P, H_kv, n, g, L + t + 1]; in fp32 also when the scores are bf16 (model.autocast), as HF's eager attention
    probs = torch.cat([s_prompt, s_new], -1).mul_(d**-0.5).softmax(-1, dtype=torch.float32)
    o_prompt = probs[..., :width].reshape(p, n_kv, n * g, width) @ vp  # [P, H_kv, n * g, D]
    o_new = probs[..., width:].transpose(1, 2).reshape(rows, n_kv, g, t + 1) @ vg  # [N, H_kv, g, D]
    o = o_prompt.view(p, n_kv, n, g, d).transpose(1, 2).reshape(rows, n_kv, g, d) + o_new
    return o.reshape(rows, 1, kv.n_heads * d)


def _forward(
    model: PreTrainedModel, ids: Tensor, pos: Tensor, kv: DecodeState, t: int | None, mask: Tensor | None
) -> Tensor:
    """Run the prompts (``t is None``: ``ids [P, L]``, ``mask [P, 1, L, L]`` True where attention is
    allowed) or one new token per row at completion slot ``t`` (``ids [N, 1]``); returns the
    last position's logits ``[rows, V]``.
    """
    inner = model.model
    b, s = ids.shape
    h_q, h_kv, d = kv.n_heads, kv.n_kv, kv.head_dim
    x = inner.embed_tokens(ids)
    c, sn = kv.cos[pos], kv.sin[pos]  # [B, S, D]
    for i, block in enumerate(kv.blocks):
        h = block.norm_1(x)
        q = block.q(h).view(b, s, h_q, d).transpose(1, 2)
        k = block.k(h).view(b, s, h_kv, d).transpose(1, 2)
        v = block.v(h).view(b, s, h_kv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, c, sn)
        o = _prefill_attention(q, k, v, kv, i, mask) if t is None else _decode_attention(q, k, v, kv, i, t)
        x = x + block.o(o)
        h = block.norm_2(x)
        x = x + block.down(block.act(block.gate(h)) * block.up(h))
    return kv.lm_head(inner.norm(x[:, -1]))


def prefill(
    model: PreTrainedModel, ids_PL: Tensor, attn_PL: Tensor, n: int, max_new: int
) -> tuple[Tensor, DecodeState]:
    """Run the left-padded prompts once. Returns (first logits ``[N, V]``, each prompt's repeated
    ``n`` times, and the decode state).
    """
    width = ids_PL.shape[1]
    keep = attn_PL.bool()
    kv = DecodeState(model, ~keep, n, max_new, model.model.embed_tokens.weight)
    pos_PL = (attn_PL.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(width, width, dtype=torch.bool, device=ids_PL.device).tril()
    # a left-padded row must still attend somewhere: pad positions attend to themselves
    mask = (causal[None] & keep[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids_PL.device)[None]
    logits = _forward(model, ids_PL, pos_PL, kv, None, mask[:, None])
    kv.next_pos = (pos_PL[:, -1] + 1).repeat_interleave(n)
    return logits.repeat_interleave(n, 0), kv


def decode_step(model: PreTrainedModel, kv: DecodeState, tokens_N: Tensor, t: int) -> Tensor:
    """Completion token ``t`` of every row (``tokens_N``) in; the next logits ``[N, V]`` out."""
    return _forward(model, tokens_N[:, None], (kv.next_pos + t)[:, None], kv, t, None)
