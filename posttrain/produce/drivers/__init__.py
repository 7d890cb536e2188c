"""Rollout drivers: one registry (``registry.py``: ``DRIVERS``, ``SPECS``, ``register``, the ``Driver`` protocol,
``ProduceContext`` and the helpers drivers share) and one module per driver beside it.

Every module of this folder is imported here, so a new driver is one new file (its ``@register``), its test and
a recipe: nothing else lists the drivers. The registry module imports none of them.
"""

import importlib
import pkgutil

from posttrain.produce.drivers.registry import (
    DRIVERS,
    SPECS,
    Driver,
    DriverSpec,
    NoOptions,
    ProduceContext,
    draw_prompts,
    prefix_ids,
    produce,
    register,
    sample_and_score,
    score,
    with_prefixes,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["DRIVERS", "SPECS", "Driver", "DriverSpec", "NoOptions", "ProduceContext", "draw_prompts", "prefix_ids",
           "produce", "register", "sample_and_score", "score", "with_prefixes"]
