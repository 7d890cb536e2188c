"""Pure tensor functions of RL post-training, each a registry entry chosen by name.

``from posttrain.algorithms import advantages, losses, aggregation, kl``
"""

from posttrain.algorithms import advantages, aggregation, entropy, kl, losses, preference, selection, shaping

__all__ = ["advantages", "aggregation", "entropy", "kl", "losses", "preference", "selection", "shaping"]
