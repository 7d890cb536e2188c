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
gradient matmuls. Autograd through ``torch.utils.checkpoint`` (``train/chunked.py``'s general
path, kept for logit terms that need their own gradient) recomputes the forward's log-sum-exp,
softmax and entropy and then runs log-sum-exp's and gather's backward: about five times the passes
over each chunk's ``[C, V]`` logits, which on a 49,152-token vocabulary cost as much as the matmuls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.models.precision import active_dtype


def _logits(h_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, temperature: float) -> Tensor:
    """fp32 logits of one chunk, divided by the temperature (a new tensor the caller may overwrite)."""
    z = torch.nn.functional.linear(h_CH, weight_VH, bias_V).float()
    return z.div_(temperature) if temperature != 1.0 else z


# Probabilities kept from the forward pass for the backward, at most this many bytes (fp32); more
# than that and the backward recomputes each chunk's logits with one matmul instead.
KEEP_BYTES = 1 << 30


def _forward_chunk(
    h_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, ids_C: Tensor, temperature: float, with_entropy: bool,
    keep: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Log pi(ids), log-sum-exp, the entropy (or ``None``) and, with ``keep``, the probabilities
    ``[C, V]`` of one chunk.
    """
    z = _logits(h_CH, weight_VH, bias_V, temperature)
    top = z.amax(-1, keepdim=True)
    z.sub_(top)  # shifted logits z' = z - max
    e = z.exp()
    total = e.sum(-1)
    log_total = total.log()  # log-sum-exp of z'
    logp = z.gather(-1, ids_C[:, None])[:, 0] - log_total
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
        for s in range(0, m, size):
            lp, lse_c, ent, p = _forward_chunk(h_MH[s : s + size], weight_VH, bias_V, ids_M[s : s + size],
                                               temperature, with_entropy, keep)
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
        grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        low = ctx.compute  # autocast's dtype in the forward (models/precision.py), else None
        w_low = weight_VH.detach().to(low) if low is not None else None
        for i, s in enumerate(range(0, h_MH.shape[0], size)):
            h_c, g_c = h_MH[s : s + size], g_logp[s : s + size].float()
            if probs:  # the forward's probabilities (freed as the backward goes)
                grad_z, probs[i] = probs[i], None
            elif low is not None:  # recomputed as the forward computed them
                z = torch.nn.functional.linear(h_c.to(low), w_low, None if bias_V is None else bias_V.to(low)).float()
                grad_z = (z.div_(tau) if tau != 1.0 else z).sub_(lse[s : s + size, None]).exp_()
            else:
                grad_z = _logits(h_c, weight_VH, bias_V, tau).sub_(lse[s : s + size, None]).exp_()  # p
            grad_z.mul_(-g_c[:, None])  # -g p
            grad_z.scatter_add_(-1, ids_M[s : s + size, None], g_c[:, None])  # + g at the target
            if tau != 1.0:
                grad_z.div_(tau)
            if low is not None:  # the two gradient matmuls in the compute dtype, summed in fp32
                g_low = grad_z.to(low)
                if need_h:
                    grad_h[s : s + size] = g_low @ w_low
                if need_w:
                    grad_w += (g_low.T @ h_c.to(low)).float()
            if need_h and low is None:
                grad_h[s : s + size] = grad_z.to(weight_VH.dtype) @ weight_VH
            if need_w and low is None:
                grad_w.addmm_(grad_z.T, h_c.float())
            if need_b:
                grad_b.add_(grad_z.sum(0))
        grad_w = grad_w.to(weight_VH.dtype) if need_w else None
        grad_b = grad_b.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None
