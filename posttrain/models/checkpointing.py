"""Activation (gradient) checkpointing of a policy's decoder layers: ``train.gradient_checkpointing``.

A decoder layer keeps its inputs only and recomputes its activations in the backward pass, so the
update's activation memory is one layer's intermediate tensors plus each layer's input ``[rows, tokens,
hidden]``, not every layer's (attention scores, the MLP's ``4 x hidden`` intermediate, norms). It costs
one more forward of the trunk per backward. transformers does the recomputation (its
``GradientCheckpointingLayer``, non-reentrant ``torch.utils.checkpoint``); this module switches it on for
the Hugging Face model wherever it sits in the policy (a LoRA adapter's base, a parameterization's
wrapped module) and says whether a forward will recompute.

Three things change while it is on, each for a reason:

- a pass that shares a group's prompt (``learn/logprobs.py``: the prompt once, its KV cache gathered to
  the rows) cannot keep a cache inside checkpointed layers (transformers drops it), so a forward with
  gradients runs every row's prompt itself; passes without gradients (old / reference log-probs,
  entropies, sampling) are not checkpointed and still share it;
- oneDNN's packed linears (``models/onednn.py``) are off: the recomputation runs after their block, on
  plain linears, so the two would not agree on what to pack;
- the rollout engine samples from the same module in eval mode, where nothing is recomputed.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from posttrain.errors import ConfigError


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models inside ``model`` (itself included) that can checkpoint their layers."""
    found: list[nn.Module] = []
    for m in model.modules():
        if getattr(m, "supports_gradient_checkpointing", False) and not any(
                m is sub for outer in found for sub in outer.modules()):
            found.append(m)
    return found


def checkpointed_layers(model: nn.Module) -> int:
    """How many of ``model``'s decoder layers recompute their activations in a training backward."""
    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def enable_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model``'s Hugging Face model(s); returns how many layers are.

    Raises :class:`ConfigError` when the model has none (a model class transformers cannot checkpoint).
    """
    for m in _hf_models(model):
        enable = getattr(m, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = checkpointed_layers(model)
    if not layers:
        raise ConfigError(f"train.gradient_checkpointing: the policy ({type(model).__name__}) has no decoder layer "
                          "that transformers can checkpoint; set train.gradient_checkpointing = false")
    return layers


def recomputes(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now recomputes layers in its backward: a checkpointed layer, in
    training mode, with gradients enabled (transformers' own condition).
    """
    return torch.is_grad_enabled() and any(
        isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training for m in model.modules())
