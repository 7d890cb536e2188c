"""The output head and log pi(token) in one autograd function, chunk by chunk, with the backward
pass written out by hand.

For one position with logits z (temperature-scaled, ``z = W h / tau``), log-sum-exp ``lse`` and
target token y:

    log pi(y) = z_y - lse,                      d log pi(y) / d z = onehot(y) - softmax(z)
    H = lse - sum_v softmax(z)_v z_v            (the entropy: returned, never differentiated)

so with g = dL/d log pi(y) the gradient of the logits is ``G = g (onehot(y) - p)``, and
``dL/dh = G W / tau``, ``dL/dW = G^T h / tau``. The forward pass keeps only ``lse`` per position
(no logits); the backward pass recomputes one chunk's logits with one matmul, turns them into
``G`` in place (subtract ``lse``, exp, scale by ``-g``, add ``g`` at the target) and runs the two
gradient matmuls. Autograd through ``torch.utils.checkpoint`` (``learn/chunked.py``'s general
path, kept for logit terms that need their own gradient) recomputes the forward's log-sum-exp,
softmax and entropy and then runs log-sum-exp's and gather's backward: about five times the passes
over each chunk's ``[C, V]`` logits, which on a 49,152-token vocabulary cost as much as the matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.models.onednn import linear_of
from posttrain.models.precision import active_dtype

# Probabilities kept from the forward pass for the backward, at most this many bytes (fp32); more
# than that and the backward recomputes each chunk's logits with one matmul instead.
KEEP_BYTES = 1 << 30


def _forward_chunk(
    h_CH: Tensor, head: Callable[[Tensor], Tensor], ids_C: Tensor, temperature: float, with_entropy: bool,
    keep: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Log pi(ids), log-sum-exp, the entropy (or ``None``) and, with ``keep``, the probabilities
    ``[C, V]`` of one chunk.

    Under autocast the logits come out of the matmul in its dtype; they are shifted by their maximum
    as they are cast to fp32 (one pass, not a copy and then a subtraction), and without the entropy
    the exponential is taken in place (no second ``[C, V]`` tensor).
    """
    raw = head(h_CH)  # the logits, [C, V]
    top = raw.amax(-1, keepdim=True).float()
    z = raw.sub(top) if raw.dtype != torch.float32 else raw.sub_(top)  # shifted logits z' = z - max, fp32
    if temperature != 1.0:
        z.div_(temperature)
        top = top / temperature
    picked = z.gather(-1, ids_C[:, None])[:, 0]
    e = z.exp() if with_entropy else z.exp_()
    total = e.sum(-1)
    log_total = total.log()  # log-sum-exp of z'
    logp = picked - log_total
    entropy = None
    if with_entropy:  # H = log sum e - sum(e z') / sum(e)
        entropy = log_total - torch.linalg.vecdot(e, z) / total
    return logp, top[:, 0] + log_total, entropy, e.div_(total[:, None]) if keep else None


class FusedHeadLogprob(torch.autograd.Function):
    """``(h [M, H], W [V, H], b [V] | None, ids [M]) -> (log pi(ids) [M], entropy [M] | empty)``;
    see the module docstring. The entropy output is not differentiable.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        h_MH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        ids_M: Tensor,
        temperature: float,
        size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy chunk by chunk; saves the inputs, log-sum-exp and (kept) probabilities."""
        m = h_MH.shape[0]
        keep = any(ctx.needs_input_grad[:3]) and m * weight_VH.shape[0] * 4 <= KEEP_BYTES
        logp = torch.empty(m, dtype=torch.float32, device=h_MH.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        probs = []
        head = linear_of(weight_VH, bias_V)  # fp32 on a CPU: on a oneDNN-packed copy (models/onednn.py)
        for s in range(0, m, size):
            lp, lse_c, ent, p = _forward_chunk(h_MH[s : s + size], head, ids_M[s : s + size], temperature,
                                               with_entropy, keep)
            logp[s : s + size], lse[s : s + size] = lp, lse_c
            if with_entropy:
                entropy[s : s + size] = ent
            if keep:
                probs.append(p)
        ctx.save_for_backward(h_MH, weight_VH, bias_V, ids_M, lse, *probs)
        ctx.temperature, ctx.size = temperature, size
        ctx.compute = active_dtype(h_MH.device)  # under autocast the backward's matmuls run in its dtype too
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, g_logp: Tensor, _g_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        """Gradients of h, W and b from ``g_logp`` (the entropy has none), chunk by chunk."""
        h_MH, weight_VH, bias_V, ids_M, lse, *probs = ctx.saved_tensors
        tau, size = ctx.temperature, ctx.size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h_MH) if need_h else None
        grad_b = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        chunk = _ChunkGrad(h_MH, weight_VH, bias_V, ids_M, lse, probs, g_logp, tau, size, ctx.compute)
        if ctx.compute is not None:
            grad_w = _low_precision_grads(chunk, grad_h, grad_b, need_w)
        else:
            grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if need_w else None
            for s in range(0, h_MH.shape[0], size):
                grad_z = chunk(s)
                if need_h:
                    grad_h[s : s + size] = grad_z.to(weight_VH.dtype) @ weight_VH
                if need_w:
                    grad_w.addmm_(grad_z.T, h_MH[s : s + size].float())
                if need_b:
                    grad_b.add_(grad_z.sum(0))
        grad_w = grad_w.to(weight_VH.dtype) if need_w else None
        grad_b = grad_b.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


class _ChunkGrad:
    """``dL/dz`` (fp32, ``[C, V]``) of the chunk that starts at row ``s``: ``g (onehot(y) - p) / tau``."""

    def __init__(self, h_MH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, ids_M: Tensor, lse: Tensor,
                 probs: list[Tensor | None], g_logp: Tensor, tau: float, size: int, low: torch.dtype | None) -> None:
        self.h, self.weight, self.bias, self.ids, self.lse = h_MH, weight_VH, bias_V, ids_M, lse
        self.probs_kept = probs
        self.g, self.tau, self.size, self.low = g_logp, tau, size, low
        # autocast's dtype in the forward (models/precision.py): the weight once in it, for every chunk
        self.w_low = weight_VH.detach().to(low) if low is not None else None

    def probs(self, s: int) -> Tensor:
        """softmax(z) of the chunk at ``s``, fp32: the forward's (then freed) or recomputed."""
        size, tau = self.size, self.tau
        if self.probs_kept:
            p, self.probs_kept[s // size] = self.probs_kept[s // size], None
            return p
        if self.low is not None:  # recomputed as the forward computed them
            b = None if self.bias is None else self.bias.to(self.low)
            z = torch.nn.functional.linear(self.h[s : s + size].to(self.low), self.w_low, b).float()
        else:
            z = torch.nn.functional.linear(self.h[s : s + size], self.weight, self.bias).float()
        return (z.div_(tau) if tau != 1.0 else z).sub_(self.lse[s : s + size, None]).exp_()

    def __call__(self, s: int) -> Tensor:
        """dL/dz, fp32."""
        g_c = self.g[s : s + self.size].float()
        grad_z = self.probs(s).mul_(-g_c[:, None])  # -g p
        grad_z.scatter_add_(-1, self.ids[s : s + self.size, None], g_c[:, None])  # + g at the target
        return grad_z.div_(self.tau) if self.tau != 1.0 else grad_z

    def into(self, s: int, out: Tensor) -> None:
        """dL/dz written into ``out`` (the compute dtype), cast as it is computed: one pass over ``[C, V]``."""
        g_c = self.g[s : s + self.size].float() / self.tau
        torch.mul(self.probs(s), -g_c[:, None], out=out)  # -g p / tau
        out.scatter_add_(-1, self.ids[s : s + self.size, None], g_c[:, None].to(out.dtype))  # + g / tau at the target


# Bytes of compute-dtype logit gradients gathered for one pair of gradient matmuls under autocast.
GROUP_BYTES = 512 * 2**20


def _low_precision_grads(
    chunk: _ChunkGrad, grad_h: Tensor | None, grad_b: Tensor | None, need_w: bool
) -> Tensor | None:
    """The backward under autocast: the chunks' logit gradients gathered in the compute dtype, up to
    :data:`GROUP_BYTES` at a time, and the two gradient matmuls run once per group (dL/dW one
    ``[V, rows] @ [rows, H]`` product with fp32 accumulation inside, as autocast's own linear
    backward computes it, added to an fp32 sum across groups). Per chunk, a ``[V, H]`` product would
    be cast to fp32 and added once per chunk: 12 passes over the head's 28M entries for 4,096
    positions of SmolLM2 (~1.5 s on 2 cores). Fills ``grad_h`` and ``grad_b``; returns dL/dW (fp32).
    """
    m, (v, _) = chunk.h.shape[0], chunk.weight.shape
    size, low = chunk.size, chunk.low
    per_group = max(size, GROUP_BYTES // (v * torch.finfo(low).bits // 8) // size * size)
    h_low = chunk.h.detach().to(low) if need_w else None
    grad_w = None
    for g0 in range(0, m, per_group):
        g1 = min(m, g0 + per_group)
        buf = torch.empty(g1 - g0, v, dtype=low, device=chunk.h.device)
        for s in range(g0, g1, size):
            out = buf[s - g0 : min(s + size, g1) - g0]
            chunk.into(s, out)
            if grad_b is not None:
                grad_b.add_(out.sum(0, dtype=torch.float32))
        if grad_h is not None:
            grad_h[g0:g1] = buf @ chunk.w_low
        if need_w:
            part = buf.T @ h_low[g0:g1]
            grad_w = part.float() if grad_w is None else grad_w.add_(part)
    return grad_w
