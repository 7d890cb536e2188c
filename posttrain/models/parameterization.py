"""Policy parameterizations: what the RL loop trains and samples, built from the loaded policy.

Each entry is ``fn(policy, reference, *, params...) -> module``: ``policy`` is the model the run
loaded (what checkpoints save), ``reference`` a function that loads a frozen copy of the starting
model (called only by entries that need one). The module returned is what the engine samples from
and the learner recomputes log-probs with; the optimizer trains its parameters that require a
gradient. Chosen by ``algorithm.parameterization`` with ``algorithm.parameterization_params``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("parameterization")
register = REGISTRY.register


def needs_reference(name: str) -> bool:
    """Whether entry ``name`` loads a frozen copy of the starting model."""
    return bool(getattr(REGISTRY.get(name), "needs_reference", False))


@register("plain")
def plain(policy: nn.Module, reference: Callable[[], nn.Module]) -> nn.Module:
    """The policy itself: pi_theta = softmax(z_theta) (the default)."""
    return policy


@register("ref_logit_mix", one_process=True,
          note="it wraps the policy and the frozen starting model together in the trainer's process")
def ref_logit_mix(policy: nn.Module, reference: Callable[[], nn.Module], *, weight: float = 0.5) -> nn.Module:
    """Logit averaging with the frozen reference: pi_mix = softmax((1 - w) z_theta + w z_ref).

    Logit averaging with a frozen reference in place of a KL term (catalog 3.7; seed paper
    ``papers/000_99b2b1db2eead048.txt:19``, arXiv:2605.20555 by third-party summaries; no code found).
    z_theta are the trained policy's logits, z_ref those of the frozen starting (SFT) policy; pi_mix
    replaces pi_theta everywhere in the loop: rollouts are sampled from it, and the ratio, the
    log-probs and any KL are taken under it. No KL term and no critic are needed: the deployed policy
    can only move (1 - w) of the way its logits move, so it stays anchored to the reference. At the
    start theta = ref and pi_mix = pi_ref.

    Parameters: ``weight`` w = 0.5 gives the reported equal average (z_theta + z_ref) / 2; whether
    the authors sample from pi_mix and the exact weight are not confirmed (the catalog's note), so
    sampling from pi_mix and w = 0.5 are ours.

    Worked example: z_theta = [2, 0], z_ref = [0, 0], w = 0.5 -> z_mix = [1, 0] -> pi_mix =
    [e / (e + 1), 1 / (e + 1)] = [0.731059, 0.268941].

    Checkpoints save theta alone (``RUN/checkpoints``): the policy that was trained, sampled and
    evaluated is pi_mix, which needs the starting model beside theta; ``posttrain eval --model RUN``
    (or one of its checkpoints) reads the run's config and mixes them again.
    """
    from posttrain.models.ref_mix import RefLogitMix

    return RefLogitMix(policy, reference(), weight)


ref_logit_mix.needs_reference = True  # type: ignore[attr-defined]
