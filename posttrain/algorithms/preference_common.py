"""The preference-loss registry and the margin its entries share.

:mod:`posttrain.algorithms.preference` re-exports these names with ``compute``; the TRL-family entries
(``preference_trl``) register through this module, so ``preference`` can import them without either
importing the other back.
"""

from __future__ import annotations

from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("preference loss")
register = REGISTRY.register
names = REGISTRY.names

inputs = REGISTRY.required  # extra inputs an entry requires (keyword-only, no default)


def _margin(chosen_B: Tensor, rejected_B: Tensor, ref_chosen_B: Tensor, ref_rejected_B: Tensor) -> Tensor:
    """The margin h = (logpi(y_w) - logpi_ref(y_w)) - (logpi(y_l) - logpi_ref(y_l)), ``[B]``."""
    return (chosen_B - ref_chosen_B) - (rejected_B - ref_rejected_B)
