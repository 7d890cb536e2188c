"""The reward registry: name -> ``(prompt, completion, **fields) -> float | None``.

Reward modules register here (``@register("math")``); :mod:`posttrain.rewards` imports them all,
so every built-in name is known once the package is imported.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.algorithms.registry import Registry

RewardFn = Callable[..., float | None]
REGISTRY: Registry = Registry("reward")
register = REGISTRY.register


def reward_names() -> list[str]:
    """Registered reward names."""
    return REGISTRY.names()
