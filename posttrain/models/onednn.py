"""fp32 linears on oneDNN-prepacked weights for a forward pass on a CPU (and its backward).

In fp32 torch's CPU matmul is MKL's sgemm; oneDNN's kernel on a weight reordered once into its blocked
layout runs the same products faster on this project's machines: at the update's thousands of rows and
SmolLM2-135M's shapes ([4,495 x 576] x [576 x 3072] and the others) 189-228 against 164-203 GFLOP/s for
``x W^T`` and 220-230 against 194-202 for the backward's ``dY W`` (the decode's 64 rows gain 1.3-2x:
``rollout/fast_llama.py``). The weight gradient ``dY^T X`` stays MKL's (oneDNN was slower: both operands
change at every call). In bf16 (``model.autocast``) torch's matmul is already oneDNN's, with no gain here.

:func:`packed_linears` runs every plain ``nn.Linear`` of a module on such weights for the duration of a
block: each weight is packed (for ``x W^T`` and, if it trains, ``dY W``) at its first call in the block
and the packs are dropped at its end, so the weights must not change inside it (a forward pass; the
optimizer steps after it). The backward pass may run after the block: the packs it needs are saved with
the graph. Outputs and gradients equal the plain linear's up to fp32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posttrain.models.precision import active_dtype


def _ops() -> tuple | None:
    """The ops of oneDNN's weight packing and linear on packed weights (CPU), where this torch build has them."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


OPS = _ops()  # also rollout/fast_llama.py's decode; None: the plain linears everywhere
ROWS_HINT = 4096  # the row count oneDNN is told to pack for (a hint: any count runs)


def pack(w: Tensor, rows: int = ROWS_HINT) -> Tensor:
    """``w [out, in]`` reordered for :func:`mm` (``rows``: the row count to pack for, a hint)."""
    return OPS[0](w.detach().contiguous(), rows)


def mm(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x w^T (+ bias)`` on a :func:`pack` ed ``w``, in its dtype (``x`` must have it)."""
    return OPS[1](x, packed, bias, "none", [], "")


class _PackedLinear(torch.autograd.Function):
    """``y = x W^T + b`` with ``x W^T`` and ``dY W`` on packed copies of ``W`` (``W^T`` for the latter)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, packs: dict) -> Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        ctx.packs, ctx.has_bias = packs, bias is not None
        return mm(x, packs["w"], None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_x:
            if "wt" not in ctx.packs:  # made at the first backward that needs it (none for a no-grad forward)
                ctx.packs["wt"] = pack(weight.detach().t())
            dx = mm(grad.contiguous(), ctx.packs["wt"])
        g2 = grad.reshape(-1, grad.shape[-1])
        if need_w:
            dw = g2.t() @ x.reshape(-1, x.shape[-1])
        if need_b and ctx.has_bias:
            db = g2.sum(0)
        return dx, dw, db, None


def linear_of(weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``x -> x W^T + b`` (no gradient: for a hand-written backward such as ``learn/fused_head.py``'s): on a
    packed copy of ``W`` for fp32 on a CPU with no autocast in force, else ``F.linear``.
    """
    if OPS is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or active_dtype("cpu"):
        return lambda x: F.linear(x, weight, bias)
    packed, b = pack(weight), None if bias is None else bias.detach()
    return lambda x: mm(x, packed, b) if x.dtype == torch.float32 else F.linear(x, weight, bias)


def _eligible(module: nn.Module) -> bool:
    """A plain fp32 ``nn.Linear`` on the CPU with no hooks and ordinary (not sharded) parameters."""
    if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    w = module.weight
    return type(w) is nn.Parameter and w.device.type == "cpu" and w.dtype == torch.float32


def usable(model: nn.Module) -> bool:
    """Whether :func:`packed_linears` changes anything for ``model`` here: this torch build has the ops, no
    autocast is in force (bf16 matmuls are oneDNN's already), the process is not an FSDP rank, no layer is
    gradient-checkpointed and some linear is :func:`_eligible`.
    """
    return bool(_linears(model))


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The linears :func:`packed_linears` runs on packed weights (none where :func:`usable` says no)."""
    if OPS is None or active_dtype("cpu") is not None or _distributed():
        return []
    modules = list(model.modules())
    if any(getattr(m, "gradient_checkpointing", False) is True for m in modules):
        return []  # a checkpointed layer's recomputation runs after the block, on the plain linears
    return [m for m in modules if _eligible(m)]


def _distributed() -> bool:
    """An FSDP learner rank (its parameters are shards, gathered by FSDP's own hooks): left alone."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def packed_linears(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s eligible linears run on packed weights (see the module docstring)."""
    linears = _linears(model)
    for m in linears:
        m.forward = _forward_of(m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _forward_of(module: nn.Linear):  # noqa: ANN202
    packs: dict = {}

    def forward(x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or active_dtype("cpu") is not None:
            return nn.Linear.forward(module, x)
        if "w" not in packs:
            packs["w"] = pack(module.weight)
        return _PackedLinear.apply(x, module.weight, module.bias, packs)

    return forward
