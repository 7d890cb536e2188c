"""The objective of each ``rm.debias`` for ``posttrain rm``, looked up by name in :data:`DEBIAS`.

Each takes the batch's quality rewards r_Q ``[2B]`` (the score head of the reward model; rows: B chosen,
then B rejected), the last-token features ``[2B, H]`` and the completion lengths ``[2B]``, and returns the
scalar loss with its logged parts. ``modules`` are the extra trainable parameters (in the run's optimizer);
``state`` / ``load`` carry them through checkpoints (in the loop state: the saved model stays the plain
one-output classifier). The loss functions are in :mod:`posttrain.algorithms.reward_modeling`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from posttrain.algorithms.reward_modeling import bradley_terry, odin_loss
from posttrain.config import ConfigError
from posttrain.config.trainers import RMConfig


class PlainBT:
    """``rm.debias = "none"``: Bradley-Terry on the score head alone; no extra parameters."""

    def __init__(self, model: PreTrainedModel, d: RMConfig, seed: int) -> None:
        self.d = d
        self.modules: list[nn.Module] = []

    def objective(self, quality_N: Tensor, feats_NH: Tensor, lengths_N: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Mean BT loss of the batch (rows: B chosen, then B rejected) and its logged parts."""
        b = quality_N.shape[0] // 2
        bt = bradley_terry(quality_N[:b], quality_N[b:], margin=self.d.margin).mean()
        return bt, {"rm/bt_loss": bt.detach()}

    def state(self) -> Tensor | None:
        """What the checkpoint keeps of this objective (nothing)."""
        return None

    def load(self, saved: Tensor | None) -> None:
        """Restore :meth:`state` (nothing to restore)."""


class Odin(PlainBT):
    """``rm.debias = "odin"``: a length head beside the score head (the quality head), ODIN's objective."""

    def __init__(self, model: PreTrainedModel, d: RMConfig, seed: int) -> None:
        super().__init__(model, d, seed)
        self.quality = model.score
        w = self.quality.weight
        self.length = nn.Linear(w.shape[1], 1, bias=False, dtype=w.dtype, device=w.device)
        std = float(getattr(model.config, "initializer_range", 0.02))  # the score head's own init
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.length.weight.copy_(torch.randn(w.shape, generator=gen) * std)
        self.modules = [self.length]

    def objective(self, quality_N: Tensor, feats_NH: Tensor, lengths_N: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """ODIN's loss (:func:`~posttrain.algorithms.reward_modeling.odin_loss`) and its logged parts."""
        length_N = self.length(feats_NH)[:, 0].float()
        d = self.d
        loss, parts = odin_loss(quality_N, length_N, lengths_N, self.quality.weight, self.length.weight,
                                margin=d.margin, length_coef=d.odin_length_coef, ortho_coef=d.odin_ortho_coef)
        return loss, {"rm/bt_loss": parts["bt"], "rm/odin_length_loss": parts["length"],
                      "rm/odin_ortho": parts["ortho"], "rm/odin_length_head_corr": parts["length_corr"]}

    def state(self) -> Tensor | None:
        """The length head's weight ``[1, H]`` (on the CPU)."""
        return self.length.weight.detach().cpu().clone()

    def load(self, saved: Tensor | None) -> None:
        """Restore the length head from a checkpoint's loop state."""
        if saved is None:
            raise ConfigError("--resume: the checkpoint holds no ODIN length head; resume with the run's own "
                              "rm.debias")
        with torch.no_grad():
            self.length.weight.copy_(saved)


DEBIAS: dict[str, type[PlainBT]] = {"none": PlainBT, "odin": Odin}
