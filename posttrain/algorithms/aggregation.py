"""Loss aggregation: per-token loss ``[N, T]`` and mask -> scalar.

Contract (``DESIGN.md``): ``reduce(mode, loss, mask, **params)``. Kept separate from the policy
surrogate (verl's ``agg_loss``), so that e.g. Dr.GRPO is ``ppo_clip`` x ``seq_mean_token_sum_norm``.
"""

from __future__ import annotations

from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("loss aggregation")
register = REGISTRY.register
names = REGISTRY.names


def reduce(mode: str, loss: Tensor, mask: Tensor, **params: object) -> Tensor:
    """Look up aggregation ``mode`` and reduce ``loss [N, T]`` over ``mask [N, T]`` to a scalar."""
    fn = REGISTRY.get(mode)
    REGISTRY.check_params(mode, params)
    return fn(loss, mask.to(loss.dtype), **params)


@register("token_mean")
def token_mean(loss_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Token-level mean over the whole batch: sum_{i,t} m l / sum_{i,t} m.

    DAPO's "token-level policy gradient loss" (arXiv:2503.14476; catalog B6): every token weighs
    the same, so long responses are not down-weighted. Nearest neighbour: ``seq_mean_token_mean``
    (original GRPO) averages within each sequence first.
    """
    return (loss_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1.0)


def _seq_count(mask_NT: Tensor) -> Tensor:
    # sequences with no valid token are left out of the mean, as in verl's agg_loss
    return (mask_NT.sum(dim=-1) > 0).to(mask_NT.dtype).sum().clamp(min=1.0)


@register("seq_mean_token_mean")
def seq_mean_token_mean(loss_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Mean over sequences of each sequence's token mean: 1/N' sum_i (sum_t m l / sum_t m).

    The original GRPO normalization (arXiv:2402.03300; catalog B6), and the one GSPO, GMPO,
    SAPO, A*-PO and DRPO expect. N' counts sequences with at least one valid token.
    Shapes: loss, mask ``[N, T]`` -> scalar. Nearest neighbour: ``token_mean`` weighs tokens
    equally, so long responses count more; here each response counts once (the length bias
    Dr.GRPO criticizes: a long wrong answer is penalized less per token).
    """
    per_seq = (loss_NT * mask_NT).sum(dim=-1) / mask_NT.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / _seq_count(mask_NT)


@register("seq_mean_token_sum")
def seq_mean_token_sum(loss_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Mean over sequences of each sequence's token sum: 1/N' sum_i sum_t m l.

    verl's ``seq-mean-token-sum`` (catalog B6). N' counts sequences with a valid token.
    Shapes: loss, mask ``[N, T]`` -> scalar. Nearest neighbour: ``seq_mean_token_sum_norm``
    divides the total by a constant length instead of by the number of sequences.
    """
    return (loss_NT * mask_NT).sum() / _seq_count(mask_NT)


@register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss_NT: Tensor, mask_NT: Tensor, *, norm_length: float | None = None) -> Tensor:
    """Total token loss over a constant length: sum_{i,t} m l / L, L = ``norm_length`` (default T).

    Dr.GRPO's normalization ("Understanding R1-Zero-Like Training", arXiv:2503.20783; catalog
    B2/B6), as verl's ``seq-mean-token-sum-norm``: the default L is the padded length T of this
    batch; set it to the generation budget to keep it fixed across steps. Like verl, the sum is
    not divided by the number of sequences, so the scale grows with the batch size (divide the
    learning rate, or pass L = N * max_len for a per-sequence mean). Shapes ``[N, T]`` -> scalar.
    Nearest neighbour: ``seq_mean_token_sum`` divides by the number of sequences.
    """
    length = float(loss_NT.shape[-1]) if norm_length is None else float(norm_length)
    if length <= 0:
        raise ValueError(f"norm_length must be > 0; got {norm_length}")
    return (loss_NT * mask_NT).sum() / length
