"""posttrain: RL post-training of language models.

The public Python API (``docs/api.md``)::

    import posttrain
    cfg = posttrain.load_config("recipes/tiny.toml", ["train.steps=2"])
    summary = posttrain.train(cfg, rewards=[my_reward])
    summary["run_dir"]

``import posttrain`` stays fast: the names below are imported when first used (module ``__getattr__``), and
nothing here imports torch. ``posttrain.train`` is also the RL loop's package (``posttrain/train/``): a
function of that name would be replaced by the package as soon as anything imports ``posttrain.train.rl``
(the import system sets the attribute), so instead the package is made callable when it is set here, and
both readings hold: ``posttrain.train(recipe)`` runs :func:`posttrain.api.train`, ``posttrain.train.rl`` is
the loop.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "load_config": "posttrain.api",
    "sft": "posttrain.api",
    "dpo": "posttrain.api",
    "evaluate": "posttrain.api",
    "Config": "posttrain.config",
    "ConfigError": "posttrain.errors",
    "register_reward": "posttrain.plugins",
    "register_env": "posttrain.plugins",
    "register_task": "posttrain.plugins",
    "register_advantage": "posttrain.plugins",
    "register_loss": "posttrain.plugins",
    "register_shaper": "posttrain.plugins",
    "register_aggregation": "posttrain.plugins",
    "register_kl": "posttrain.plugins",
}
__all__ = sorted([*_EXPORTS, "train"])


class _CallablePackage(types.ModuleType):
    """The ``posttrain.train`` package, callable as :func:`posttrain.api.train`."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        from posttrain.api import train

        return train(*args, **kwargs)


class _Posttrain(types.ModuleType):
    """The ``posttrain`` module's class: setting its ``train`` attribute to the loop's package makes that callable."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "train" and type(value) is types.ModuleType:
            value.__class__ = _CallablePackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Posttrain


def __getattr__(name: str) -> Any:
    if name == "train":  # the package, imported now (a docstring): setting it here made it callable
        return importlib.import_module("posttrain.train")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
