"""Per-step training diagnostics: pure torch functions of a batch, no I/O, no model.

Each returns plain floats (one host sync) or tensors, ready for a metrics sink:

- :mod:`~posttrain.diagnostics.entropy`: token entropy, mean and high-entropy minority;
- :mod:`~posttrain.diagnostics.ratios`: importance ratios, clip fractions, KL to the rollout
  policy and to the reference;
- :mod:`~posttrain.diagnostics.groups`: solve_none / solve_all / zero-advantage fractions;
- :mod:`~posttrain.diagnostics.rank`: effective rank of hidden states, VERL's ERV / ERA;
- :mod:`~posttrain.diagnostics.affinity`: HINT's Affinity between rollout and current policy;
- :mod:`~posttrain.diagnostics.divergence`: token-level JS / KL to the starting model.
"""

from posttrain.diagnostics.affinity import affinity, group_affinity
from posttrain.diagnostics.divergence import divergence_stats, token_divergence
from posttrain.diagnostics.entropy import entropy_stats, token_entropies
from posttrain.diagnostics.groups import group_stats
from posttrain.diagnostics.rank import (
    RankDynamicsState,
    effective_rank,
    effective_rank_dynamics,
    rank_dynamics_update,
)
from posttrain.diagnostics.ratios import kl_to_reference, ratio_stats

__all__ = [
    "RankDynamicsState",
    "affinity",
    "group_affinity",
    "divergence_stats",
    "effective_rank",
    "effective_rank_dynamics",
    "entropy_stats",
    "group_stats",
    "kl_to_reference",
    "rank_dynamics_update",
    "ratio_stats",
    "token_divergence",
    "token_entropies",
]
