"""FiMi-RM's stage 3 (provisional, a third-party rendering): a small model fits the reward's dependence on
response length, and the reward model is trained to be uncorrelated with that fit.

FiMi-RM (Zhao et al. 2025, "Bias Fitting to Mitigate Length Bias of Reward Model in RLHF", arXiv:2505.12843;
seed ``papers/004_f298e9ec572f7f27.txt:85``, catalog 3.27) trains a reward model in three stages: plain
Bradley-Terry (stage 1), a lightweight fitting model of the reward from the length (stage 2), and a debiasing
stage (stage 3) that alternates between the two. The paper's text was not reachable; the form built here is the
rendering of issue 37 item 2: the reward model r minimises L_BT + |rho(r, sg(r_hat))| and the fitting model
r_hat = f(len) minimises -|rho(sg(r), r_hat)| (+ an optional MSE term), rho the Pearson correlation over the
batch. The trainer that alternates them is ``posttrain/trainers/rm_heads.py`` (``rm.debias = "fimi"``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posttrain.algorithms.reward_modeling import bradley_terry, pearson

ENCODING_DIM = 32  # the rendering's 32-d sinusoidal length encoding
HIDDEN = 48  # the blocks' inner width: not given; 48 puts the count at the rendering's ~6.4K (6,465)


def length_encoding(lengths_N: Tensor, dim: int = ENCODING_DIM) -> Tensor:
    """Sinusoidal encoding ``[N, dim]`` of response lengths ``[N]`` (the transformer's positional encoding).

    e_{2i} = sin(n / 10000^(2i / dim)), e_{2i+1} = cos(n / 10000^(2i / dim)); the frequencies span wavelengths
    from 2 pi to ~10000 x 2 pi tokens, so short and long responses get distinct codes without a scale to tune.
    """
    n_N1 = lengths_N.to(torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32, device=n_N1.device) / dim)
    out = torch.empty(n_N1.shape[0], dim, device=n_N1.device)
    out[:, 0::2] = torch.sin(n_N1 * freq)
    out[:, 1::2] = torch.cos(n_N1 * freq)
    return out


class _PreNormBlock(nn.Module):
    """x + W2 relu(W1 LayerNorm(x)): a pre-norm residual block (the activation is ours, not confirmed)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.inner = nn.Linear(dim, hidden)
        self.outer = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.outer(torch.relu(self.inner(self.norm(x))))


class LengthFitter(nn.Module):
    """FiMi-RM's fitting model r_hat = f(len): the 32-d sinusoidal length encoding, two pre-norm ResNet blocks
    and a linear head, 6,465 parameters (the rendering says about 6.4K).

    Counted: each block LayerNorm 2 x 32 + Linear(32, 48) 1,584 + Linear(48, 32) 1,568 = 3,216; two blocks 6,432;
    head Linear(32, 1) 33. ``forward(lengths [N]) -> r_hat [N]``.
    """

    def __init__(self, dim: int = ENCODING_DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.dim = dim
        self.blocks = nn.Sequential(_PreNormBlock(dim, hidden), _PreNormBlock(dim, hidden))
        self.head = nn.Linear(dim, 1)

    def forward(self, lengths_N: Tensor) -> Tensor:
        """r_hat ``[N]`` of the lengths ``[N]``."""
        return self.head(self.blocks(length_encoding(lengths_N, self.dim)))[:, 0]


def fimi_reward_loss(reward_N: Tensor, fitted_N: Tensor, *, margin: float = 0.0) -> tuple[Tensor, Tensor]:
    """The reward model's stage-3 loss on B pairs (N = 2B rows, chosen first): L = mean_B BT(r_w, r_l; m)
    + |rho(r, sg(r_hat))|; returns (L, the BT part).

    ``fitted_N`` is the fitting model's r_hat of the same responses, detached here: the reward model is pushed
    away from whatever length function the fitting model found, without moving it. Example: r = [1, 0, 0, 0]
    against r_hat = [1, 2, 3, 4]: rho = -1.5 / sqrt(0.75 x 5) = -0.774597, BT on the pairs (1, 0) and (0, 0):
    (0.313262 + 0.693147) / 2 = 0.503204; L = 1.277801 (``tests/trainers/test_rm_fimi.py``).
    """
    b = reward_N.shape[0] // 2
    bt = bradley_terry(reward_N[:b], reward_N[b:], margin=margin).mean()
    return bt + pearson(reward_N, fitted_N.detach()).abs(), bt


def fimi_fit_loss(reward_N: Tensor, fitted_N: Tensor, *, mse_coef: float = 0.0) -> Tensor:
    """The fitting model's loss: -|rho(sg(r), r_hat)| + mse_coef mean (r_hat - sg(r))^2.

    Maximising |rho| makes r_hat the length function most correlated with the reward (of either sign); the MSE
    term (one review's addition, off by default) also pins r_hat to the reward's scale.
    """
    target = reward_N.detach()
    loss = -pearson(target, fitted_N).abs()
    if mse_coef:
        loss = loss + mse_coef * (fitted_N - target).pow(2).mean()
    return loss
