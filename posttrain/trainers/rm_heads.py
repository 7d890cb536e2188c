"""The objective of each ``rm.debias`` for ``posttrain rm``, looked up by name in :data:`DEBIAS`.

Each takes the batch's quality rewards r_Q ``[2B]`` (the score head of the reward model; rows: B chosen,
then B rejected), the last-token features ``[2B, H]``, the completion lengths ``[2B]`` and the index of the
step being taken (0 for the first), and returns the scalar loss with its logged parts. ``modules`` are the
extra trainable parameters (in the run's optimizer); ``state`` / ``load`` carry them through checkpoints (in
the loop state: the saved model stays the plain one-output classifier). The loss functions are in
:mod:`posttrain.algorithms.reward_modeling` and :mod:`posttrain.algorithms.reward_fimi`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from posttrain.algorithms.reward_fimi import LengthFitter, fimi_fit_loss, fimi_reward_loss
from posttrain.algorithms.reward_modeling import bradley_terry, odin_loss, pearson
from posttrain.config import ConfigError
from posttrain.config.trainers import RMConfig


class PlainBT:
    """``rm.debias = "none"``: Bradley-Terry on the score head alone; no extra parameters."""

    def __init__(self, model: PreTrainedModel, d: RMConfig, seed: int) -> None:
        self.d = d
        self.modules: list[nn.Module] = []

    def objective(self, quality_N: Tensor, feats_NH: Tensor, lengths_N: Tensor, step: int = 0,
                  ) -> tuple[Tensor, dict[str, Tensor]]:
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

    def objective(self, quality_N: Tensor, feats_NH: Tensor, lengths_N: Tensor, step: int = 0,
                  ) -> tuple[Tensor, dict[str, Tensor]]:
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


class FiMi(PlainBT):
    """``rm.debias = "fimi"``: FiMi-RM's stage 3, provisional (a third-party rendering; the paper's text was not
    reachable): a fitting model of the reward from the response length, and a reward model kept uncorrelated
    with it.

    Steps 0 .. W - 1 (W = ``rm.fimi_warmup_steps``) are plain Bradley-Terry (stage 1). Then blocks of
    K = ``rm.fimi_every`` steps alternate, the fitting model's first: in a fitting block only the fitting model
    r_hat = f(len) (:class:`~posttrain.algorithms.reward_fimi.LengthFitter`, 6,465 parameters) learns, on
    -|rho(sg(r), r_hat)| + c mean (r_hat - sg(r))^2 (c = ``rm.fimi_mse_coef``, default 0: one review's MSE
    term); in a debiasing block only the reward model learns, on mean_B BT(r_w, r_l; m) + |rho(r, sg(r_hat))|.
    rho is Pearson over the batch's 2B responses (one process: nothing to gather across ranks). The part that
    does not learn in a block gets no gradient, so AdamW leaves it as it is. Logged: ``rm/fimi_corr``
    (rho(r, r_hat)), ``rm/fimi_fit_loss``, ``rm/fimi_phase`` (0 warm-up, 1 fitting, 2 debiasing).
    Shapes: ``quality_N``, ``lengths_N`` ``[2B]`` (B chosen rows, then B rejected). The fitting model runs in
    float32 on the reward model's device and is kept in the checkpoint's loop state (its parameters as one
    vector), never in the saved model: the saved model's logit is the debiased r itself.
    Not confirmed: which model the alternation starts with, whether the reward model also trains on BT in the
    fitting blocks (here it does not), the blocks' inner width and activation, and the fitting model's optimizer
    (here the run's AdamW and ``rm.lr``).
    Paper: FiMi-RM (Zhao et al. 2025, arXiv:2505.12843), seed papers/004_f298e9ec572f7f27.txt:85 (catalog 3.27).
    Nearest neighbour: ODIN (``rm.debias = "odin"``) decorrelates a second linear head's share of the reward
    from the length itself (a linear relation); FiMi decorrelates the reward from a learned non-linear f(len).
    """

    PHASES = ("warmup", "fit", "debias")

    def __init__(self, model: PreTrainedModel, d: RMConfig, seed: int) -> None:
        super().__init__(model, d, seed)
        with torch.random.fork_rng(devices=[]):  # the fitting model's init is the seed's alone
            torch.manual_seed(seed)
            self.fitter = LengthFitter().to(next(model.parameters()).device)
        self.modules = [self.fitter]

    def phase(self, step: int) -> str:
        """The stage of step ``step`` (0-based): ``"warmup"``, then ``"fit"`` and ``"debias"`` blocks in turn."""
        if step < self.d.fimi_warmup_steps:
            return "warmup"
        return "fit" if (step - self.d.fimi_warmup_steps) // self.d.fimi_every % 2 == 0 else "debias"

    def objective(self, quality_N: Tensor, feats_NH: Tensor, lengths_N: Tensor, step: int = 0,
                  ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of ``step``'s stage (BT, the fitting loss, or BT + |rho(r, sg(r_hat))|) and its logged parts."""
        phase = self.phase(step)
        fitted_N = self.fitter(lengths_N)
        b = quality_N.shape[0] // 2
        if phase == "debias":
            loss, bt = fimi_reward_loss(quality_N, fitted_N, margin=self.d.margin)
        else:
            bt = bradley_terry(quality_N[:b], quality_N[b:], margin=self.d.margin).mean()
        fit = fimi_fit_loss(quality_N, fitted_N, mse_coef=self.d.fimi_mse_coef)
        if phase == "warmup":
            loss = bt
        elif phase == "fit":
            loss = fit
        return loss, {"rm/bt_loss": bt.detach(), "rm/fimi_fit_loss": fit.detach(),
                      "rm/fimi_corr": pearson(quality_N.detach(), fitted_N.detach()),
                      "rm/fimi_phase": torch.tensor(float(self.PHASES.index(phase)))}

    def state(self) -> Tensor | None:
        """The fitting model's parameters as one vector (on the CPU)."""
        return nn.utils.parameters_to_vector(self.fitter.parameters()).detach().cpu().clone()

    def load(self, saved: Tensor | None) -> None:
        """Restore the fitting model from a checkpoint's loop state."""
        n = sum(p.numel() for p in self.fitter.parameters())
        if saved is None or saved.dim() != 1 or saved.numel() != n:
            got = "nothing" if saved is None else f"a tensor of shape {tuple(saved.shape)}"
            raise ConfigError(f"--resume: the checkpoint holds {got} where FiMi's fitting model ({n} parameters) "
                              "should be; resume with the run's own rm.debias")
        with torch.no_grad():
            nn.utils.vector_to_parameters(saved.to(next(self.fitter.parameters()).device), self.fitter.parameters())


DEBIAS: dict[str, type[PlainBT]] = {"none": PlainBT, "odin": Odin, "fimi": FiMi}
