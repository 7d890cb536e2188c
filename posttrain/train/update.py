"""Step 5 of the loop: epochs x minibatches of policy-gradient updates on one rollout batch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.config import Config
from posttrain.diagnostics import affinity, group_affinity, ratio_stats
from posttrain.rollout import Completions
from posttrain.train.logprobs import completion_logits, completion_logprobs, logprobs_from_logits
from posttrain.train.parts import Parts
from posttrain.train.setup import derive_seed


def policy_update(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    parts: Parts,
    cfg: Config,
    row_prompts: list[list[int]],
    comps: Completions,
    mask_NT: Tensor,
    adv_N: Tensor,
    row_inputs: dict[str, Tensor],
    pad_id: int,
    step: int,
    entropy_state: object | None = None,
    minibatches: list[Tensor] | None = None,
) -> dict[str, float]:
    """Epochs x minibatches of optimizer steps on one rollout batch; returns update metrics.

    ``row_inputs`` holds per-row tensors (``rewards``, ``group_ids``) for losses that declare them.
    ``entropy_state`` is a stateful entropy regularizer's state (AEnt's coefficient), passed to it
    as ``state=``; ``entropy/regularized`` (the minibatches' mean token-mean of the entropy it
    regularizes) is what the loop advances that state with. ``minibatches`` are the row indices of
    each minibatch, in order, the same every epoch (a batch selector's plan, ``train/select.py``; rows
    may repeat or be left out); ``None``: every row in ``train.minibatches`` chunks, reshuffled every
    epoch when the update is off-policy.
    """
    n_rows = comps.token_ids.shape[0]
    lp_kwargs = {"pad_id": pad_id, "temperature": cfg.rollout.temperature}
    n_minibatches = cfg.train.minibatches if minibatches is None else len(minibatches)
    off_policy = cfg.train.epochs > 1 or n_minibatches > 1
    with torch.no_grad():  # old log-probs are needed only when later minibatches see a moved policy
        old_NT = (
            completion_logprobs(model, row_prompts, comps.token_ids, mask_NT, **lp_kwargs)[0]
            if off_policy
            else None
        )
        ref_NT = (
            completion_logprobs(ref_model, row_prompts, comps.token_ids, mask_NT, **lp_kwargs)[0]
            if ref_model is not None
            else None
        )
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "minibatch", step))
    aapo_on = parts.aapo_lambda > 0 and "hint_rerolled" in row_inputs
    params = cfg.algorithm.loss_params  # the clip band, for ratio statistics and AAPO's Affinity
    eps = {"eps_low": float(params.get("eps_low", 0.2)), "eps_high": float(params.get("eps_high", 0.2))}
    sums: dict[str, float] = {}
    count, nonfinite = 0, 0
    model.train()
    for _ in range(cfg.train.epochs):
        if minibatches is None:
            order = torch.randperm(n_rows, generator=gen) if off_policy else torch.arange(n_rows)
        for idx in order.chunk(cfg.train.minibatches) if minibatches is None else minibatches:
            mask = mask_NT[idx]
            if mask.sum() == 0:
                continue
            prompts = [row_prompts[i] for i in idx.tolist()]
            logits = completion_logits(model, prompts, comps.token_ids[idx], mask, **lp_kwargs)
            logp, entropy = logprobs_from_logits(logits, comps.token_ids[idx], with_entropy=True)
            dev = logp.device  # the model's: the batch's CPU tensors join it here
            mask, adv = mask.to(dev), adv_N[idx].to(dev)
            old = old_NT[idx] if old_NT is not None else logp.detach()
            rows = {k: v[idx].to(dev) for k, v in row_inputs.items()}
            available = {**rows, "ref_logprobs": ref_NT[idx] if ref_NT is not None else None}
            extra = {k: available[k] for k in parts.loss_inputs if available[k] is not None}
            loss_NT = parts.loss(logp, old, adv, mask, **extra)
            aapo = aapo_weights(logp, old, adv, mask, rows, parts.aapo_lambda, eps["eps_low"]) if aapo_on else None
            if aapo is not None:  # HINT's AAPO: re-rolled groups' loss x Affinity^lambda (detached)
                loss_NT = loss_NT * aapo[:, None]
            kl_value = float("nan")
            if ref_NT is not None and parts.kl is not None:
                kl_NT = parts.kl(logp, ref_NT[idx]) * mask
                loss_NT = loss_NT + parts.kl_coef * kl_NT
                kl_value = float((kl_NT.sum() / mask.sum()).detach())
            if parts.entropy is not None:  # a bonus is negative: -coef * H per token
                ent_kw = {"state": entropy_state} if entropy_state is not None else {}
                loss_NT = loss_NT + parts.entropy(logits, **ent_kw) * mask
            loss = parts.aggregate(loss_NT, mask)
            if not torch.isfinite(loss):
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            if not torch.isfinite(grad_norm):
                nonfinite += 1
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step()
            with torch.no_grad():
                adv_rows = adv.reshape(len(idx), -1).expand_as(logp)
                step_metrics = {
                    "loss": float(loss.detach()),
                    "optim/grad_norm": float(grad_norm),
                    "policy/entropy": float((entropy * mask).sum() / mask.sum()),
                    "policy/entropy_top": _top_mean(entropy, mask, cfg.diagnostics.top_q),
                    "policy/kl_ref": kl_value,
                    **{f"policy/{k}": v for k, v in ratio_stats(logp.detach(), old, adv_rows, mask, **eps).items()},
                    # HINT's Affinity between the sampler's log-probs and the trainer's (before this step)
                    **{
                        f"policy/{k}": v
                        for k, v in affinity(logp.detach(), comps.logprobs[idx].to(dev), mask, adv_rows).items()
                    },
                }
                # re-rolled rows that carry a signal (a group whose advantages are all 0 has Affinity 0,
                # but its loss is 0 whatever the weight)
                weighted = rows["hint_rerolled"].bool() & (adv_rows.abs().sum(-1) > 0) if aapo is not None else None
                if weighted is not None and weighted.any():
                    step_metrics["policy/aapo_weight"] = float(aapo[weighted].mean())
                if parts.entropy is not None:  # the coefficient in use (AEnt: its adaptive state's)
                    step_metrics["entropy/coef"] = float(getattr(entropy_state, "coef", parts.entropy_coef))
                if parts.entropy_measure is not None:  # what a stateful regularizer's updater is fed
                    h_NT = parts.entropy_measure(logits.detach())
                    step_metrics["entropy/regularized"] = float((h_NT * mask).sum() / mask.sum())
            for k, v in step_metrics.items():
                if k.endswith("_max"):
                    sums[k] = max(sums.get(k, v), v)
                elif k.endswith("_min"):
                    sums[k] = min(sums.get(k, v), v)
                else:
                    sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {k: v if k.endswith(("_max", "_min")) else v / count for k, v in sums.items()} if count else {}
    out["train/nonfinite"] = float(nonfinite)
    out["train/optimizer_steps"] = float(count)
    return out


def aapo_weights(
    logp_NT: Tensor,
    old_NT: Tensor,
    adv: Tensor,
    mask_NT: Tensor,
    rows: dict[str, Tensor],
    lam: float,
    eps: float,
) -> Tensor:
    """HINT's AAPO per row of a minibatch: Affinity^lambda of the row's group for re-rolled groups,
    1 for the others (``train/hint.py``). ``rows``: the minibatch's per-row inputs (``hint_rerolled``,
    ``group_ids``); ``eps``: the band of the Affinity (the PPO clip's ``eps_low``). ``[n]``, no gradient.
    """
    rerolled = rows["hint_rerolled"].to(torch.bool)
    aff = group_affinity(logp_NT.detach(), old_NT.detach(), mask_NT, rows["group_ids"], adv, eps=eps)
    w = aff.to(logp_NT.dtype).pow(lam)
    return torch.where(rerolled, w, torch.ones_like(w))


def _top_mean(entropy_NT: Tensor, mask_NT: Tensor, q: float) -> float:
    """Mean entropy of the ceil(q M) highest-entropy of the M response tokens ("forking tokens",
    arXiv:2506.01939); NaN when there are none.
    """
    h = entropy_NT[mask_NT.bool()]
    if h.numel() == 0:
        return float("nan")
    return float(torch.topk(h, max(1, math.ceil(q * h.numel()))).values.mean())


@torch.no_grad()
def policy_entropies(
    model: torch.nn.Module, row_prompts: list[list[int]], comps: Completions, pad_id: int, temperature: float
) -> Tensor:
    """Entropy of the current policy at every completion token, ``[N, T]`` on the CPU (0 on padding)."""
    _, entropy = completion_logprobs(
        model, row_prompts, comps.token_ids, comps.mask, pad_id=pad_id, temperature=temperature, with_entropy=True
    )
    return entropy.float().cpu() * comps.mask.float().cpu()
