"""Sequence packing of the policy's teacher-forced forward: ``train.packing``.

Unpacked, a micro-batch of N rows is ``[N, L + T]``: each prompt left-padded to the longest prompt L, each
completion right-padded to the batch's width T, so a batch whose completions vary 4x in length spends most of
its tokens on padding. Packed, the micro-batch is one sequence ``[1, S]`` of every row's prompt and real
completion tokens, end to end, with no padding:

- position ids restart at 0 at each row (the row's positions are what they are unpacked: 0 .. its length - 1);
- attention never crosses rows (block-diagonal causal), through the attention implementation the model uses:

  * ``posttrain`` (``models/attention.py``, what ``models/load.py`` sets where a model uses sdpa): the row
    boundaries go to the attention function as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers' varlen
    keywords), and it runs each row's causal attention on its own: the cost is that of the rows, not of the
    pack's square. The model gets a placeholder 4-D mask so that transformers builds no ``[S, S]`` mask;
  * ``flash_attention_*``: the same keywords; transformers' flash-attention varlen kernel reads them;
  * any other (``sdpa``, ``eager``, ``flex_attention``): ``attention_mask = None`` and the restarting position
    ids; transformers' ``masking_utils`` (5.x: ``find_packed_sequence_indices``, called when the 2-D mask is
    ``None`` and there is no cache) then builds the block-diagonal causal mask itself. Correct, but that mask is
    ``[S, S]`` and the kernel attends over the whole pack: quadratic in S.

- the last real token of a row is left out (its output predicts nothing). The output head (``learn/chunked.py``)
  runs on the M states that predict a real completion token, ``[1, M, H]``, and its per-token outputs
  (log-probs, entropies, logit terms) are scattered back to ``[N, T]``, zeros at padded completion positions,
  so the losses see the unpacked shapes (:func:`packed_terms`); padding costs neither the trunk nor the head.
  A model whose head transforms its logits runs its own forward on the pack, its ``[1, S, V]`` logits
  scattered back to ``[N, T, V]`` (:func:`packed_forward`).

A group's prompt is not shared through a KV cache here (each row carries its own prompt, as with
``train.gradient_checkpointing``): a pack's rows are independent sequences. The micro-batch planner
(``learn/shard.py``) counts a row's real tokens, not the padded width (:func:`row_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.errors import ConfigError
from posttrain.learn.chunked import LogitTerm, token_logprobs
from posttrain.models.attention import NAME as POSTTRAIN_ATTENTION
from posttrain.models.onednn import packed_linears

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class Pack:
    """N rows laid end to end as one sequence, and where each row's outputs come from.

    ``ids_1S`` / ``positions_1S``: the packed tokens and their per-row positions; ``cu_seqlens`` ``[N + 1]``
    (int32): row i holds pack positions ``cu_seqlens[i] .. cu_seqlens[i + 1] - 1``; ``rows``, ``cols``, ``src``
    ``[M]``: the output at pack position ``src[m]`` predicts completion token ``cols[m]`` of row ``rows[m]``.
    """

    ids_1S: Tensor
    positions_1S: Tensor
    cu_seqlens: Tensor
    rows: Tensor
    cols: Tensor
    src: Tensor
    shape: tuple[int, int]  # (N, T): the unpacked completion shape

    @property
    def longest(self) -> int:
        """The longest row of the pack, in tokens."""
        return int(self.cu_seqlens.diff().max())


def real_lengths(completion_mask_NT: Tensor) -> list[int]:
    """Each row's real completion tokens; raises ``ValueError`` unless every row is right-padded (its mask
    ones, then zeros), the only layout a packed row can rebuild.
    """
    lengths = completion_mask_NT.bool().sum(1)
    prefix = torch.arange(completion_mask_NT.shape[1]) < lengths.cpu()[:, None]
    bad = (prefix != completion_mask_NT.bool().cpu()).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"train.packing: completion rows {bad[:5]} are not right-padded (attention mask ones, then "
                         "zeros); set train.packing = false for such rollouts")
    return lengths.tolist()


def row_tokens(prompt_ids: list[list[int]], completion_mask_NT: Tensor, packed: bool) -> list[int]:
    """Tokens each row costs a forward, for the micro-batch planner: prompt + real completion when ``packed``,
    else prompt + the batch's padded width.
    """
    if not packed:
        return [len(p) + completion_mask_NT.shape[1] for p in prompt_ids]
    return [len(p) + n for p, n in zip(prompt_ids, real_lengths(completion_mask_NT), strict=True)]


def pack_rows(prompt_ids: list[list[int]], completion_ids_NT: Tensor, completion_mask_NT: Tensor) -> Pack:
    """Row i as ``prompt_i + completion_i[: C_i - 1]`` (``C_i`` its real tokens; the last predicts nothing), the
    rows end to end.

    E.g. prompts ``[5, 6]``, ``[7]`` and completions ``[1, 2, 3]``, ``[4, pad, pad]``: tokens ``[5, 6, 1, 2 | 7]``,
    positions ``[0, 1, 2, 3 | 0]``, ``cu_seqlens [0, 4, 5]``; completion tokens (0, 0..2) are predicted at pack
    positions 1, 2, 3 and (1, 0) at 4.
    """
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("train.packing: a row has an empty prompt (nothing predicts its first completion token)")
    lengths = real_lengths(completion_mask_NT)
    ids_cpu = completion_ids_NT.cpu()
    ids, pos, rows, cols, src, cu = [], [], [], [], [], [0]
    for i, (p, c) in enumerate(zip(prompt_ids, lengths, strict=True)):
        seg = [*p, *ids_cpu[i, : max(c - 1, 0)].tolist()]
        ids += seg
        pos += range(len(seg))
        rows += [i] * c
        cols += range(c)
        src += range(cu[-1] + len(p) - 1, cu[-1] + len(p) - 1 + c)
        cu.append(cu[-1] + len(seg))
    long = torch.long
    return Pack(torch.tensor([ids], dtype=long), torch.tensor([pos], dtype=long), torch.tensor(cu, dtype=torch.int32),
                torch.tensor(rows, dtype=long), torch.tensor(cols, dtype=long), torch.tensor(src, dtype=long),
                tuple(completion_ids_NT.shape))


def unpack(out_1SX: Tensor, pack: Pack) -> Tensor:
    """The pack's outputs ``[1, S, X]`` at the unpacked completion positions ``[N, T, X]``, zeros at padding
    (differentiable: the gradient of a padded position is dropped, as unpacked, where the loss masks it).
    """
    n, t = pack.shape
    dev = out_1SX.device
    values = out_1SX[0, pack.src.to(dev)]
    return out_1SX.new_zeros(n, t, out_1SX.shape[-1]).index_put((pack.rows.to(dev), pack.cols.to(dev)), values)


def to_rows(x_1M: Tensor, pack: Pack) -> Tensor:
    """Per-token values ``[1, M]`` of the pack's predicted tokens (``pack.rows``, ``pack.cols`` order) as ``[N, T]``,
    zeros at padding (differentiable).
    """
    dev = x_1M.device
    return x_1M.new_zeros(pack.shape).index_put((pack.rows.to(dev), pack.cols.to(dev)), x_1M[0])


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The attention implementation of the (first) transformers model inside ``model`` (an adapter's base, a
    parameterization's wrapped module), or ``None``.
    """
    for m in model.modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


def attention_inputs(model: torch.nn.Module, pack: Pack, device: torch.device) -> dict[str, object]:
    """The keyword inputs that keep a pack's rows apart under ``model``'s attention (module docstring)."""
    impl = attention_implementation(model) or ""
    s = pack.ids_1S.shape[1]
    def varlen(cu: Tensor) -> dict[str, object]:
        return dict(zip(VARLEN_KEYS, (cu, cu, pack.longest, pack.longest), strict=True))

    if impl == POSTTRAIN_ATTENTION:  # a 4-D mask passes transformers' mask builders untouched: nothing [S, S]
        placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, s, s)
        return {"attention_mask": placeholder, **varlen(pack.cu_seqlens)}  # on the CPU: each layer reads it
    if impl.startswith("flash_attention"):
        return {"attention_mask": None, **varlen(pack.cu_seqlens.to(device))}
    return {"attention_mask": None}  # masking_utils reads the restarts of the position ids


def run_pack(run: Callable[..., Tensor], model: torch.nn.Module, pack: Pack) -> Tensor:
    """``run``'s outputs ``[1, S, X]`` at every position of ``pack`` (``run(keep, **inputs)``: the last ``keep``
    positions' logits or hidden states, ``learn/logprobs.py``), from one pass.
    """
    device = next(model.parameters()).device
    return run(pack.ids_1S.shape[1], input_ids=pack.ids_1S.to(device), position_ids=pack.positions_1S.to(device),
               use_cache=False, **attention_inputs(model, pack, device))


def packed_forward(run: Callable[..., Tensor], model: torch.nn.Module, prompt_ids: list[list[int]],
                   completion_ids_NT: Tensor, completion_mask_NT: Tensor) -> Tensor:
    """``[N, T, X]`` outputs of ``run`` at the positions that predict each completion token, zeros at padding,
    from one packed pass.
    """
    pack = pack_rows(prompt_ids, completion_ids_NT, completion_mask_NT)
    return unpack(run_pack(run, model, pack), pack)


def packed_terms(
    model: torch.nn.Module, head: torch.nn.Module, prompt_ids: list[list[int]], completion_ids_NT: Tensor,
    completion_mask_NT: Tensor, *, temperature: float, with_entropy: bool, terms: Sequence[LogitTerm],
    chunk_tokens: int | None,
) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """``completion_terms``' outputs (log-probs, entropy, logit terms, ``[N, T]`` each, zeros at padding) from one
    packed pass of the trunk and the output head on the real positions only.
    """
    trunk = model.get_decoder()
    pack = pack_rows(prompt_ids, completion_ids_NT, completion_mask_NT)

    def run(keep: int, **inputs: object) -> Tensor:
        return trunk(**inputs).last_hidden_state[:, -keep:]

    with packed_linears(trunk):  # fp32 on a CPU: oneDNN's kernels on packed weights (models/onednn.py)
        hidden_1SH = run_pack(run, model, pack)
    dev = hidden_1SH.device
    hidden_1MH = hidden_1SH[:, pack.src.to(dev)]
    ids_1M = completion_ids_NT.to(dev)[pack.rows.to(dev), pack.cols.to(dev)][None]
    logp, extra, entropy = token_logprobs(head, hidden_1MH, ids_1M, temperature=temperature,
                                          with_entropy=with_entropy, terms=terms, chunk_tokens=chunk_tokens)
    back = [to_rows(x, pack) for x in (logp, *extra)]
    return back[0], to_rows(entropy, pack) if entropy is not None else None, back[1:]


@torch.no_grad()
def check_packing(model: torch.nn.Module) -> str:
    """Raise :class:`ConfigError` (naming ``train.packing``) unless a packed pass of ``model`` keeps its rows apart;
    else a line for the console saying how the rows are kept apart.

    The probe: rows ``a`` (5 tokens) and ``b`` (3) packed, against ``b`` alone. An architecture whose masking
    reads neither the varlen keywords nor the restarting position ids would let ``b`` attend to ``a``: its
    logits then move as far as those of a plain causal pass over ``a + b`` (the leak), not a rounding error.
    """
    vocab = next((m.config.vocab_size for m in model.modules() if hasattr(getattr(m, "config", None), "vocab_size")),
                 9)  # a wrapper (a parameterization) holds the transformers model whose config says it
    a, b = [i % vocab for i in (1, 2, 3, 4, 5)], [i % vocab for i in (6, 7, 8)]
    device = next(model.parameters()).device
    pack = pack_rows([a, b], torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))
    ids, pos = pack.ids_1S.to(device), pack.positions_1S.to(device)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=ids, position_ids=pos, use_cache=False, **attention_inputs(model, pack, device))
        alone = model(input_ids=torch.tensor([b], device=device), use_cache=False)
        leaky = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        model.train(was_training)
    ref = alone.logits[0].float()
    err = float((packed.logits[0, len(a):].float() - ref).abs().max())
    leak = float((leaky.logits[0, len(a):].float() - ref).abs().max())
    impl = attention_implementation(model)
    if err > 0.1 * leak:
        raise ConfigError(f"train.packing: with attention {impl!r} the rows of a packed sequence see each other "
                          f"(a packed row's logits are {err:.3g} off its own pass, a leaking pass {leak:.3g}); set "
                          "train.packing = false or load the model with sdpa / eager / flash attention")
    how = "each row on its own (varlen)" if impl == POSTTRAIN_ATTENTION or (impl or "").startswith("flash") else \
        "a block-diagonal mask from the restarting position ids"
    return f"sequence packing: each micro-batch is one sequence of its rows' real tokens; attention {impl!r}: {how}"
