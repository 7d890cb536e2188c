"""Pure tensor functions of RL post-training, each a registry entry chosen by name.

``from posttrain.algorithms import advantages, losses, aggregation, kl``
"""

from posttrain.algorithms import advantages, aggregation, kl, losses

__all__ = ["advantages", "aggregation", "kl", "losses"]
