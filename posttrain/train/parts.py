"""The registry entries of a run, looked up once at set-up and bound to their parameters."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import Tensor

from posttrain.algorithms import advantages, aggregation, entropy, kl, losses, selection, shaping
from posttrain.config import LOSS_INPUTS, Config


@dataclass
class Parts:
    """The registry entries of this run, bound to their parameters once at set-up."""

    advantage: partial  # advantage(rewards_PG, rewards_PGK, **inputs): picks what the estimator takes
    loss: partial
    aggregate: partial
    kl: partial | None
    kl_coef: float
    entropy: partial | None  # per-token entropy term from logits, added to the loss
    shapers: list[partial]
    group_filter: partial
    loss_inputs: tuple[str, ...]  # the LOSS_INPUTS this loss declares
    needs_ref: bool  # a frozen reference model is needed (KL term, or a loss that reads ref_logprobs)
    needs_ref_rewards: bool = False  # a shaper reads the rewards of the reference responses (PAR)

    @classmethod
    def from_config(cls, cfg: Config) -> Parts:
        """Look every entry up by its configured name (the only place the loop consults names)."""
        a = cfg.algorithm
        declared = losses.REGISTRY.params(a.loss)
        return cls(
            entropy=partial(entropy.compute, a.entropy, **a.entropy_params) if a.entropy else None,
            shapers=[partial(shaping.compute, sp.name, **sp.params) for sp in a.shapers],
            group_filter=partial(selection.select, a.group_filter, **a.group_filter_params),
            loss_inputs=tuple(k for k in LOSS_INPUTS if k in declared),
            needs_ref=a.kl_coef > 0 or "ref_logprobs" in losses.inputs(a.loss),
            advantage=partial(
                _advantage, a.advantage, a.advantage in advantages.REWARD_COMPONENTS, a.advantage_params
            ),
            loss=partial(losses.compute, a.loss, **a.loss_params),
            aggregate=partial(aggregation.reduce, a.aggregation, **a.aggregation_params),
            kl=partial(kl.estimate, a.kl) if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
            needs_ref_rewards=any("ref_rewards" in shaping.REGISTRY.required(sp.name) for sp in a.shapers),
        )


def _advantage(
    name: str, components: bool, params: dict, rewards_PG: Tensor, rewards_PGK: Tensor, **inputs: Tensor
) -> Tensor:
    """Apply estimator ``name`` to the summed rewards, or to the weighted components ``[P, G, K]``
    for multi-reward estimators (``advantages.REWARD_COMPONENTS``: GDPO, GD2PO).
    """
    return advantages.compute(name, rewards_PGK if components else rewards_PG, **params, **inputs)
