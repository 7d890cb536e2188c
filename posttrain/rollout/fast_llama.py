"""A lean decode path for LLaMA-family models (llama, mistral, qwen2) over the model's own weights.

The generic path runs the Hugging Face forward once per new token; for small models on a CPU its
per-call overhead (mask building, cache bookkeeping) dominates. This path runs the loaded model's
embedding, norms, projections and rotary tables (so any weights, biases and adapters are the
model's own) with preallocated K/V written in place: the prompt's once, shared by the ``n``
completions of its group (see :class:`DecodeState`), and plain matmuls for the one-query decode
attention (no mask building, no cache bookkeeping per step). With enough decode work the plain
linears run on copies of their weights made per generate call (on a CPU prepacked for oneDNN, fp32
or bf16; elsewhere transposed): q|k|v and gate|up stacked into one matmul each, each RMSNorm's
weight and the attention's ``1 / sqrt(D)`` folded in (see :class:`Block`). It is exact up to float
rounding: the engine tests check its log-probs against a teacher-forced Hugging Face forward and its
greedy tokens against the generic path. Models it does not cover use the generic path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from posttrain.models import onednn
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


def _plain(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` with no hooks (a LoRA-wrapped layer or a hooked one is called as it is)."""
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


def linear(
    module: nn.Module, transpose: bool, dtype: torch.dtype | None = None, cols: Tensor | None = None
) -> Callable[[Tensor], Tensor]:
    """``x -> module(x)``; with ``transpose``, a plain ``nn.Linear`` (no hooks) runs as
    ``x @ W^T (+ b)`` on a contiguous copy of ``W^T`` made here.

    Why: MKL multiplies ``[M, in]`` by an ``[in, out]`` matrix faster than by the transposed view of
    the ``[out, in]`` weight: 2-20 % over M = 32..256 (20 % at 64 rows) for SmolLM2-135M's shapes
    on one CPU core. The copy costs the weights' size in memory for the call and ~0.35 s for 135M
    parameters, so it is made only for enough decode work (see :func:`prefill`). Anything else (a
    LoRA-wrapped layer, a module with hooks) is called as it is. Under autocast (``dtype``, the
    compute dtype) the copy is made in that dtype, so it is cast once, not at every decode step.
    ``cols`` (``[in]``, only where the copy is made) multiplies the weight's columns: a preceding
    RMSNorm's weight folded in (see :class:`Block`).
    """
    if not transpose or not _plain(module):
        return module
    return _matmul([module], dtype, cols, [1.0])


def _matmul(
    modules: list[nn.Module], dtype: torch.dtype | None, cols: Tensor | None, scales: list[float]
) -> Callable[[Tensor], Tensor]:
    """``x -> x W^T (+ b)`` on a copy of the modules' weights stacked (``W = [W_1; W_2; ...]``), each
    ``W_i`` times ``diag(cols)`` on the right and ``scales[i]`` (its bias too), in ``dtype``: on a CPU
    prepacked for oneDNN (:func:`_packed`, bf16 and fp32), others transposed (see :func:`linear`).
    """
    w = modules[0].weight
    dtype = dtype or w.dtype
    pack = dtype in PACK_DTYPES and w.device.type == "cpu" and onednn.OPS is not None
    weight = _copy([m.weight.detach() for m in modules], dtype, not pack, cols, scales)
    bias = None
    if any(m.bias is not None for m in modules):
        parts = zip(modules, scales, strict=True)
        bias = torch.cat([w.new_zeros(m.out_features) if m.bias is None else m.bias.detach() * s for m, s in parts])
    if pack:
        return _packed(weight, bias)
    if bias is None:
        return lambda x: x @ weight
    return lambda x: torch.addmm(bias, x.flatten(0, -2), weight).view(*x.shape[:-1], -1)


def _copy(ws: list[Tensor], dtype: torch.dtype, transposed: bool, cols: Tensor | None, scales: list[float]) -> Tensor:
    """``ws`` (each ``[out_i, in]``) stacked to ``[out, in]`` (``[in, out]`` when ``transposed``), each times
    ``cols`` and its scale, in ``dtype``: one pass per weight, written in place (no full-size temporaries:
    large ones left the trainer's process slower in the update that follows, measured with
    ``bench/real_step.py``).
    """
    n_out, n_in = sum(w.shape[0] for w in ws), ws[0].shape[1]
    out = torch.empty((n_in, n_out) if transposed else (n_out, n_in), dtype=dtype, device=ws[0].device)
    col = cols.detach().to(ws[0].dtype) if cols is not None else ws[0].new_ones(n_in)
    start = 0
    for w, scale in zip(ws, scales, strict=True):
        dst = out[:, start : start + w.shape[0]] if transposed else out[start : start + w.shape[0]]
        src = w.t() if transposed else w
        if cols is None and scale == 1.0:
            dst.copy_(src)
        else:
            f = col * scale
            torch.mul(src, f[:, None] if transposed else f, out=dst)
        start += w.shape[0]
    return out


def fused(
    modules: list[nn.Module],
    transpose: bool,
    dtype: torch.dtype | None = None,
    cols: Tensor | None = None,
    scales: list[float] | None = None,
) -> Callable[[Tensor], Tensor]:
    """``x -> cat([m(x) for m in modules], -1)`` for linears that read the same input (q/k/v, gate/up).

    With ``transpose`` and plain ``nn.Linear`` s only, one matmul on their stacked weights (copied as
    :func:`linear` copies one): a decode step then casts its input once and calls one kernel instead of
    three (two), which matters at decode's few rows where a call's fixed cost is a large share of it.
    Otherwise each module is called and the outputs concatenated. Where the copy is made, ``cols``
    (``[in]``) multiplies the stacked weight's columns and ``scales[i]`` module ``i``'s rows and bias.
    """
    if not copies(modules, transpose):
        return lambda x: torch.cat([m(x) for m in modules], -1)
    return _matmul(modules, dtype, cols, scales or [1.0] * len(modules))


def copies(modules: list[nn.Module], transpose: bool) -> bool:
    """Whether :func:`fused` / :func:`linear` run ``modules`` on weight copies of their own."""
    return transpose and all(_plain(m) for m in modules)


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * x / rms(x), in fp32


def unit_norm(norm: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """``x -> x / rms(x)`` (``norm`` without its weight) for one of Hugging Face's RMSNorms (``RMS_NORMS``,
    no hooks), so that its weight can be folded into the linears that read it; ``None`` otherwise.
    """
    if type(norm).__name__ not in RMS_NORMS or norm._forward_hooks or norm._forward_pre_hooks:
        return None
    eps = norm.variance_epsilon
    return lambda x: F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


PACK_ROWS = 64  # the batch size oneDNN is told to pack for (a hint: any row count runs)
PACK_DTYPES = (torch.bfloat16, torch.float32)


def _packed(w: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``x -> x W^T (+ b)`` in ``W``'s dtype (bf16 or fp32) on a oneDNN-prepacked copy of ``W`` (``[out, in]``).

    Why: a bf16 matmul on a CPU reorders the ``[out, in]`` weight into oneDNN's blocked layout at every
    call; at decode's few rows that reorder is a large share of the call. Packed once per generate call,
    the decode matmuls of SmolLM2-135M's shapes ran 1.36x faster here (26.6 -> 19.6 ms a step for one
    layer's seven matmuls x 30 layers at 16 rows, the weights streamed from memory). In fp32, where torch's
    matmul is MKL's sgemm, oneDNN's packed kernel is faster still: at 64 rows and SmolLM2-135M's shapes,
    weights streamed, 1.35-1.98x (gate|up [576 x 3072] 1.80 -> 1.12 ms, the head [576 x 49,152] 35.0 ->
    17.6 ms; `bench/real_step.py` prints the floor with the faster kernel), with fp32 rounding (max error
    3e-6 against float64 on a unit-scale [64 x 576] x [576 x 1536], MKL's 2e-6).
    """
    dtype = w.dtype
    packed = onednn.pack(w, PACK_ROWS)
    b = None if bias is None else bias.detach().to(dtype)
    return lambda x: onednn.mm(x.to(dtype), packed, b)


class Block:
    """One decoder layer's modules, its linears through :func:`fused` (q|k|v and gate|up) and :func:`linear`.

    Where the linears after a norm run on weight copies (:func:`copies`), two scalings are folded into the
    copies instead of being applied at every decode step: the RMSNorm's weight (``(x / rms(x) * w) W^T =
    (x / rms(x)) (W diag(w))^T``) and the attention's ``1 / sqrt(D)`` on the query rows (the rotary
    embedding is linear, so it commutes); ``q_scale`` is what the attention still has to apply.
    """

    def __init__(self, layer: nn.Module, transpose: bool, dtype: torch.dtype | None, head_dim: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.act, self.intermediate = mlp.act_fn, mlp.gate_proj.out_features
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        self.norm_1, cols_1 = _folded(layer.input_layernorm, copies(qkv, transpose))
        self.norm_2, cols_2 = _folded(layer.post_attention_layernorm, copies(gate_up, transpose))
        scales, self.q_scale = None, head_dim**-0.5
        if copies(qkv, transpose):
            scales, self.q_scale = [self.q_scale, 1.0, 1.0], 1.0
        self.qkv = fused(qkv, transpose, dtype, cols_1, scales)
        self.o = linear(attn.o_proj, transpose, dtype)
        self.gate_up = fused(gate_up, transpose, dtype, cols_2)
        self.down = linear(mlp.down_proj, transpose, dtype)


def _folded(norm: nn.Module, fold: bool) -> tuple[Callable[[Tensor], Tensor], Tensor | None]:
    """(the norm to run, the weight to fold into the linears after it or ``None``)."""
    unit = unit_norm(norm) if fold else None
    return (norm, None) if unit is None else (unit, norm.weight)


class DecodeState:
    """What a generate call decodes with: K/V of the ``P`` prompts once (``[P, H_kv, L, D]``), K/V of
    the ``N = P * n`` completions (``[P, H_kv, n, max_new, D]``, written in place), the prompts'
    padding (an additive ``-inf`` bias), rotary tables, each row's next position and the layers
    (:class:`Block`). Completion rows are grouped by prompt (row ``r`` continues prompt ``r // n``).

    The ``n`` completions of a prompt attend to one copy of its K/V: a decode step reads the
    prompt part once per group (its ``n * H / H_kv`` query rows per K/V head in one matmul) and
    never repeats it per completion or per query head.

    Under autocast (``model.autocast``) the K/V, the rotary tables and the weight copies are in its
    dtype, the softmax in fp32, as in the learner's attention (``models/attention.py``). Against fp32
    K/V (SmolLM2, 8 x 8 x 64, 6 alternating runs) a generate call took 7.36 against 7.51 s (medians;
    within this machine's run-to-run spread): the K/V read at every step is half the bytes, while
    alone, with warm caches, the attention's fp32 matmuls were faster.
    """

    def __init__(self, model: PreTrainedModel, pad_PL: Tensor, n: int, max_new: int, like: Tensor) -> None:
        cfg = model.config
        dtype = active_dtype(like.device)  # model.autocast: K/V, rotary tables and weight copies in its dtype
        if dtype is not None:
            like = torch.empty(0, dtype=dtype, device=like.device)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.n = n
        p, width = pad_PL.shape
        layers = len(model.model.layers)
        shape_p, shape_g = (p, self.n_kv, width, self.head_dim), (p, self.n_kv, n, max_new, self.head_dim)
        self.kp = [like.new_zeros(shape_p) for _ in range(layers)]
        self.vp = [like.new_zeros(shape_p) for _ in range(layers)]
        self.kg = [like.new_zeros(shape_g) for _ in range(layers)]
        self.vg = [like.new_zeros(shape_g) for _ in range(layers)]
        self.pad_bias = like.new_zeros(p, 1, 1, width).masked_fill_(pad_PL[:, None, None], float("-inf"))
        positions = torch.arange(width + max_new, device=like.device)
        cos, sin = model.model.rotary_emb(like, positions[None])
        self.cos, self.sin = cos[0], sin[0]  # [L + max_new, D]
        self.next_pos = torch.zeros(p * n, dtype=torch.long, device=like.device)
        # the weights as they are now (a generate call samples from one policy version); transposed
        # copies on the CPU when the decode work pays for them (measured: ~0.35 s for 135M parameters
        # against 2-30 ms a step)
        transpose = like.device.type == "cpu" and p * n * max_new >= TRANSPOSE_MIN_TOKENS
        self.blocks = [Block(layer, transpose, dtype, self.head_dim) for layer in model.model.layers]
        self.norm, cols = _folded(model.model.norm, copies([model.lm_head], transpose))
        self.lm_head = linear(model.lm_head, transpose, dtype, cols)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of ``x [B, S, heads, D]`` at the positions of ``cos, sin [B, S, D]``:
    ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x_2, x_1]`` (Hugging Face's
    ``apply_rotary_pos_emb``, here on q and k together in one pass).
    """
    half = x.shape[-1] // 2
    return x * cos[:, :, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, :, None]


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, kv: DecodeState, i: int, mask: Tensor) -> Tensor:
    """Prompt self-attention (``q [P, L, H, D]`` times ``kv.blocks[i].q_scale``, ``k, v [P, L, H_kv, D]``);
    stores the prompt's K/V. Returns ``[P, L, H * D]``.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kv.kp[i].copy_(k)
    kv.vp[i].copy_(v)
    scale = kv.blocks[i].q_scale
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=kv.n_kv != kv.n_heads)
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, kv: DecodeState, i: int, t: int) -> Tensor:
    """One new token per row (``q [N, 1, H, D]`` times ``kv.blocks[i].q_scale``, ``k, v [N, 1, H_kv, D]``)
    at completion slot ``t``. Returns ``[N, 1, H * D]``.

    Scores over [prompt | completion so far] share one softmax; with ``g = H / H_kv`` query heads
    per K/V head, the query heads of K/V head ``j`` are ``j * g .. j * g + g - 1`` (HF's
    ``repeat_kv`` order), and the prompt part multiplies the ``n * g`` query rows of a group at once.
    """
    kp, vp = kv.kp[i], kv.vp[i]
    p, n_kv, width, d = kp.shape
    n, g = kv.n, kv.n_heads // kv.n_kv
    kv.kg[i][:, :, :, t] = k.view(p, n, n_kv, d).transpose(1, 2)
    kv.vg[i][:, :, :, t] = v.view(p, n, n_kv, d).transpose(1, 2)
    kg, vg = kv.kg[i][:, :, :, : t + 1], kv.vg[i][:, :, :, : t + 1]  # [P, H_kv, n, t + 1, D]
    q = q.view(p, n, n_kv, g, d).transpose(1, 2).contiguous()  # [P, H_kv, n, g, D]
    if kv.blocks[i].q_scale != 1.0:
        q.mul_(kv.blocks[i].q_scale)
    s_prompt = (q.view(p, n_kv, n * g, d) @ kp.transpose(-1, -2)).add_(kv.pad_bias)  # [P, H_kv, n * g, L]
    s_new = q @ kg.transpose(-1, -2)  # [P, H_kv, n, g, t + 1]
    probs = torch.cat([s_prompt.view(p, n_kv, n, g, width), s_new], -1).softmax(-1, dtype=torch.float32)
    probs = probs.to(vp.dtype)
    o = (probs[..., :width].reshape(p, n_kv, n * g, width) @ vp).view(p, n_kv, n, g, d)
    o.add_(probs[..., width:] @ vg)
    return o.transpose(1, 2).reshape(p * n, 1, kv.n_heads * d)


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
        qkv = block.qkv(block.norm_1(x))  # [B, S, (H + 2 H_kv) * D], in attention's dtype
        qk = rotate(qkv[..., : (h_q + h_kv) * d].view(b, s, h_q + h_kv, d), c, sn)
        q, k, v = qk[:, :, :h_q], qk[:, :, h_q:], qkv[..., (h_q + h_kv) * d :].view(b, s, h_kv, d)
        # attention in the K/V's dtype with an fp32 softmax (explicit: autocast would change neither)
        o = _prefill_attention(q, k, v, kv, i, mask) if t is None else _decode_attention(q, k, v, kv, i, t)
        x = x + block.o(o)
        gate, up = block.gate_up(block.norm_2(x)).split(block.intermediate, -1)
        x = x + block.down(block.act(gate) * up)
    return kv.lm_head(kv.norm(x[:, -1]))


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
