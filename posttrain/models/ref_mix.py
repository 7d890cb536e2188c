"""A policy whose logits are averaged with a frozen reference's: pi_mix = softmax((1 - w) z_theta + w z_ref).

The module stands where the trained policy stands in the RL loop: the ``hf`` engine samples from it,
the learner recomputes log-probs through it (its own forward: no fused output head, see
``learn/chunked.py::head_of``), and evaluation measures it. Only ``policy`` trains; ``ref`` is a frozen
copy of the starting model and stays in eval mode.

One KV cache serves both trunks: the reference's attention layers are renumbered after the policy's
(layer ``i`` becomes ``L + i``), so the caller's cache holds 2L layers and its batch operations (the
engine's repeat of a prompt for the group, the learner's prefix-sharing gather) move both models' keys
and values at once. The reference runs first in every forward: the cache's masks and default positions
read layer 0 (the policy's), which must still hold the past length while the reference runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.models.cache_arg import with_cache


def mix_logits(z_policy: Tensor, z_ref: Tensor, weight: float) -> Tensor:
    """``(1 - weight) z_policy + weight z_ref`` in ``z_policy``'s dtype (``z_ref`` carries no gradient)."""
    return (1.0 - weight) * z_policy + weight * z_ref.detach().to(z_policy.dtype)


class RefLogitMix(nn.Module):
    """``forward`` returns the policy's output with ``logits = (1 - weight) z_policy + weight z_ref``."""

    def __init__(self, policy: nn.Module, reference: nn.Module, weight: float) -> None:
        super().__init__()
        if not 0.0 <= weight < 1.0:
            raise ValueError(f"the reference's logit weight must be in [0, 1) (got {weight})")
        self.policy = policy
        self.ref = reference.eval().requires_grad_(False)
        self.weight = float(weight)
        self.config = policy.config
        layers = int(policy.config.num_hidden_layers)
        renumbered = 0
        for module in self.ref.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx += layers
                renumbered += 1
        if renumbered == 0:
            raise ValueError(f"{type(reference).__name__}: no attention layer with a `layer_idx` to renumber; "
                             "the reference cannot share the policy's KV cache")

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live."""
        return next(self.policy.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The policy's parameter dtype."""
        return next(self.policy.parameters()).dtype

    def train(self, mode: bool = True) -> RefLogitMix:
        """Set the policy's mode; the reference stays in eval mode."""
        super().train(mode)
        self.ref.eval()
        return self

    def forward(self, input_ids: Tensor | None = None, cache: object | None = None, **kwargs: object) -> object:
        """The policy's forward (same keywords; ``cache`` is the one KV cache of both trunks) with its
        logits replaced by the mixture's. Without a ``cache`` neither trunk keeps one (a cache a model makes
        for itself has only its own L layers).
        """
        if cache is None:
            kwargs["use_cache"] = False
        with torch.no_grad():
            ref_kw = with_cache(self.ref, cache) if cache is not None else {}
            z_ref = self.ref(input_ids=input_ids, **kwargs, **ref_kw).logits
        pol_kw = with_cache(self.policy, cache) if cache is not None else {}
        out = self.policy(input_ids=input_ids, **kwargs, **pol_kw)
        out.logits = mix_logits(out.logits, z_ref, self.weight)
        return out
