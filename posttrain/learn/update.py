"""Step 5 of the loop: epochs x minibatches of policy-gradient updates on one rollout batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from posttrain.algorithms import loss_weights
from posttrain.algorithms.losses_common import GRAD_INPUTS
from posttrain.algorithms.offpolicy import mismatch_stats
from posttrain.config import LearnSettings
from posttrain.diagnostics import affinity, ratio_stats
from posttrain.learn.chunked import LogitTerm
from posttrain.learn.logprobs import completion_terms, log_partition, mean_log_softmax
from posttrain.learn.packing import row_tokens
from posttrain.learn.parts import LearnParts, LossWeight
from posttrain.learn.shard import LOCAL, Shard, grad_norm_of, over_runs, plan_micro_batches, spread
from posttrain.rollout import Rollout
from posttrain.seeds import derive_seed

# Loss inputs (config.LOSS_INPUTS) that are per-token functions of the policy's temperature-scaled logits: the
# current policy's comes from each micro-batch's forward pass (a logit term of completion_terms), without gradient
# unless the losses' GRAD_INPUTS name it; pi_old's, "old_" + name, from the pass that computes the old log-probs
# (on-policy: the current one's); the frozen reference's, "ref_" + name, from the pass of its log-probs. Each is
# computed only for a loss that declares it.
LOGIT_INPUTS: dict[str, LogitTerm] = {"mean_logsoftmax": mean_log_softmax, "logsumexp": log_partition}


def policy_update(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    parts: LearnParts,
    settings: LearnSettings,
    row_prompts: list[list[int]],
    rollouts: Rollout,
    mask_NT: Tensor,
    adv_N: Tensor,
    row_inputs: dict[str, Tensor],
    pad_id: int,
    step: int,
    entropy_state: object | None = None,
    minibatches: list[Tensor] | None = None,
    shard: Shard = LOCAL,
) -> dict[str, float]:
    """Epochs x minibatches of optimizer steps on one rollout batch; returns update metrics.

    ``mask_NT`` is the loss mask (the rollout's, times the rows' reward validity); attention comes
    from ``rollouts.attention_mask``. ``row_inputs`` holds per-row tensors (``rewards``,
    ``group_ids``) for losses that declare them. ``entropy_state`` is a stateful entropy
    regularizer's state (AEnt's coefficient), passed to it as ``state=``; ``entropy/regularized``
    (the minibatches' mean token-mean of the entropy it regularizes) is what the loop advances that
    state with. ``minibatches`` are the row indices of each minibatch, in order, the same every
    epoch (a batch selector's plan, ``prepare/selectors.py``; rows may repeat or be left out); ``None``:
    every row in ``train.minibatches`` chunks, reshuffled every epoch when the update is off-policy; whole
    groups per chunk when ``parts.minibatch_unit`` is ``"group"`` (a row-coupled loss, :func:`minibatch_rows`).
    Each minibatch runs in micro-batches of at most ``train.micro_batch_tokens`` tokens with its
    gradients accumulated (:func:`minibatch_step`). ``shard``: this process's share of the micro-batches
    (``learn/shard.py``; a rank of a sharded learner, ``learn/distributed/fsdp.py``). The chosen loss weights
    (``parts.loss_weights``) that read no forward pass are computed here, once, over all the rows; the others
    in each micro-batch (:func:`micro_loss`).
    """
    n_rows = rollouts.token_ids.shape[0]
    n_minibatches = settings.train.minibatches if minibatches is None else len(minibatches)
    off_policy = settings.train.epochs > 1 or n_minibatches > 1
    lp = {"pad_id": pad_id, "temperature": settings.temperature, "budget": settings.train.micro_batch_tokens,
          "shard": shard, "packing": settings.train.packing}
    old_NT, old_rows = old_policy(model, row_prompts, rollouts, mask_NT, parts, settings, off_policy, lp)
    ref_NT, ref_rows = reference_policy(ref_model, row_prompts, rollouts, parts, lp)
    row_inputs = {**row_inputs, **old_rows, **ref_rows}
    whole = {"mask": mask_NT, "advantages": adv_N, "behaviour_logprobs": rollouts.behaviour_logprobs, **row_inputs}
    update_w = {w.name: weigh(w, parts, whole) for w in parts.loss_weights if not w.per_pass}
    gen = torch.Generator().manual_seed(derive_seed(settings.seed, "minibatch", step))
    sums: dict[str, float] = {}
    count, nonfinite = 0, 0
    model.train()
    groups_N = row_inputs["group_ids"] if parts.minibatch_unit == "group" else None
    for _ in range(settings.train.epochs):
        plan = minibatches if minibatches is not None else \
            minibatch_rows(n_rows, settings.train.minibatches, gen if off_policy else None, groups_N)
        for idx in plan:
            if mask_NT[idx].sum() == 0:
                continue
            batch = Minibatch(idx, [row_prompts[i] for i in idx.tolist()], rollouts, mask_NT[idx], adv_N[idx],
                              {k: v[idx] for k, v in row_inputs.items()},
                              old_NT[idx] if old_NT is not None else None,
                              ref_NT[idx] if ref_NT is not None else None, {k: v[idx] for k, v in update_w.items()})
            step_metrics = minibatch_step(model, optimizer, parts, settings, batch, pad_id, entropy_state, shard=shard)
            if step_metrics is None:
                nonfinite += 1
                continue
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


def minibatch_rows(n_rows: int, k: int, gen: torch.Generator | None, groups_N: Tensor | None) -> list[Tensor]:
    """The update's own plan: the rows in ``k`` chunks (``train.minibatches``), shuffled with ``gen`` (None: in
    order). With ``groups_N`` (``[N]`` group ids; ``LearnParts.minibatch_unit == "group"``) the groups are shuffled
    and chunked, not the rows, so a row-coupled loss sees each group whole: with 4 groups of 2 rows and k = 2, a
    minibatch holds 2 whole groups (4 rows), never 3 rows of 3 groups.
    """
    if groups_N is None:
        order = torch.randperm(n_rows, generator=gen) if gen is not None else torch.arange(n_rows)
        return list(order.chunk(k))
    ids, inv_N = torch.unique(groups_N, return_inverse=True)
    n_groups = ids.numel()
    order = torch.randperm(n_groups, generator=gen) if gen is not None else torch.arange(n_groups)
    return [torch.cat([(inv_N == q).nonzero().flatten() for q in chunk.tolist()]) for chunk in order.chunk(k)]


def old_policy(
    model: torch.nn.Module,
    row_prompts: list[list[int]],
    rollouts: Rollout,
    mask_NT: Tensor,
    parts: LearnParts,
    settings: LearnSettings,
    off_policy: bool,
    lp: dict,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """pi_old's log-probs ``[N, T]`` (``None``: on-policy, the micro-batches use their own, detached) and the
    ``old_*`` logit inputs the loss declares (:data:`LOGIT_INPUTS`), ``[N, T]`` each, as per-row inputs.

    Old log-probs are needed only when later minibatches see a moved policy (or they are the sampler's:
    ``algorithm.old_logprobs = "behaviour"``); the ``old_*`` inputs are the learner's before the update in
    either case, computed in the same pass as its log-probs, and left out on-policy.
    """
    names = [k for k in LOGIT_INPUTS if f"old_{k}" in parts.loss_inputs] if off_policy else []
    behaviour = settings.algorithm.old_logprobs == "behaviour"
    old_NT, rows = None, {}
    if off_policy and (names or not behaviour):
        terms = {"terms": [LOGIT_INPUTS[k] for k in names]} if names else {}
        old_NT = batched_logprobs(model, row_prompts, rollouts, **lp, **terms)
        if names:  # [N, T, 1 + k]: the log-probs, then each term
            old_NT, rows = old_NT[..., 0], {f"old_{k}": old_NT[..., 1 + i] for i, k in enumerate(names)}
    if behaviour:
        old_NT = rollouts.behaviour_logprobs.float() * mask_NT
    return old_NT, rows


def reference_policy(
    ref_model: torch.nn.Module | None,
    row_prompts: list[list[int]],
    rollouts: Rollout,
    parts: LearnParts,
    lp: dict,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The frozen reference's log-probs ``[N, T]`` (``None`` without one) and the ``ref_*`` logit inputs the loss
    declares (:data:`LOGIT_INPUTS`), ``[N, T]`` each, as per-row inputs, all from one pass.
    """
    if ref_model is None:
        return None, {}
    names = [k for k in LOGIT_INPUTS if f"ref_{k}" in parts.loss_inputs]
    if not names:
        return batched_logprobs(ref_model, row_prompts, rollouts, **lp), {}
    ref_NT = batched_logprobs(ref_model, row_prompts, rollouts, **lp, terms=[LOGIT_INPUTS[k] for k in names])
    return ref_NT[..., 0], {f"ref_{k}": ref_NT[..., 1 + i] for i, k in enumerate(names)}


@dataclass
class Minibatch:
    """The rows of one optimizer step and their per-row tensors (CPU)."""

    idx: Tensor  # rows of the rollout batch
    prompts: list[list[int]]
    rollouts: Rollout  # the whole batch; rows ``idx`` are this minibatch's
    mask: Tensor  # loss mask [n, T]
    adv: Tensor  # [n] or [n, T]
    rows: dict[str, Tensor]
    old: Tensor | None  # log-probs before the update [n, T] (None: on-policy, the current ones detached)
    ref: Tensor | None  # the reference model's [n, T]
    weights: dict[str, Tensor] = field(default_factory=dict)  # the loss weights computed once an update [n, T]


def minibatch_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    parts: LearnParts,
    settings: LearnSettings,
    b: Minibatch,
    pad_id: int,
    entropy_state: object | None,
    shard: Shard = LOCAL,
) -> dict[str, float] | None:
    """One optimizer step on minibatch ``b``; its metrics (on every rank), or ``None`` (on every rank) when a
    loss or the gradient norm was not finite (nothing is applied then).

    The rows run in micro-batches of at most ``train.micro_batch_tokens`` prompt + completion tokens (real
    ones with ``train.packing``, else the padded width), the ones that fall to this ``shard`` here
    (``learn/shard.py``). The aggregation is linear in the per-token loss, so each micro-batch's loss is the
    sum of its per-token losses times the weights d(aggregate)/d(loss) of the whole minibatch: the summed
    gradients equal those of one pass over the minibatch (global normalizers). One micro-batch over every row is
    the aggregation itself.
    """
    dev = next(model.parameters()).device
    mask = b.mask.to(dev)
    tokens = row_tokens(b.prompts, b.rollouts.attention_mask[b.idx], settings.train.packing)
    runs = spread(plan_micro_batches(tokens, settings.train.micro_batch_tokens), len(b.prompts), shard.world)
    weights_NT = aggregation_weights(parts.aggregate, mask) if len(runs) > 1 else None
    optimizer.zero_grad(set_to_none=True)
    done = []
    for j, rows, live in shard.deal(runs):
        loss_NT, out = micro_loss(model, parts, settings, b, rows, pad_id, entropy_state)
        loss = parts.aggregate(loss_NT, mask[rows]) if weights_NT is None else (loss_NT * weights_NT[rows]).sum()
        (loss * shard.scale(live)).backward()
        if live:
            done.append((j, float(loss.detach()), shard.portable(out)))
    grad_norm = grad_norm_of(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.train.grad_clip))
    gathered = sorted((item for part in shard.gather(done) for item in part), key=lambda t: t[0])
    losses = [loss for _, loss, _ in gathered]
    if not (math.isfinite(grad_norm) and all(math.isfinite(x) for x in losses)):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    kl_sum = sum(out.pop("kl_sum") for _, _, out in gathered)
    got = {k: torch.cat([out[k].to(dev) for _, _, out in gathered]) for k in gathered[0][2]}
    return step_metrics(parts, b, got, mask, sum(losses), grad_norm, kl_sum, entropy_state, settings.top_q)


def micro_loss(
    model: torch.nn.Module,
    parts: LearnParts,
    settings: LearnSettings,
    b: Minibatch,
    rows: Tensor,
    pad_id: int,
    entropy_state: object | None,
) -> tuple[Tensor, dict]:
    """Per-token loss ``[m, T]`` of micro-batch ``rows`` (positions in ``b``) and its detached
    log-probs, entropies, regularized entropies and loss weights for the metrics.
    """
    idx = b.idx[rows]
    ent_kw = {"state": entropy_state} if entropy_state is not None else {}
    terms: dict[str, LogitTerm] = {}  # per-token functions of the logits, computed chunk by chunk
    if parts.entropy is not None:
        terms["entropy_term"] = partial(parts.entropy, **ent_kw)
    if parts.entropy_measure is not None:
        terms["measured"] = lambda logits: parts.entropy_measure(logits.detach())
    for k in logit_inputs(parts.loss_inputs):  # a GRAD_INPUTS term keeps its gradient, as the log-probs do
        terms[k] = LOGIT_INPUTS[k] if k in GRAD_INPUTS else partial(_detached, LOGIT_INPUTS[k])
    logp, entropy, extra = completion_terms(
        model, [b.prompts[i] for i in rows.tolist()], b.rollouts.token_ids[idx], b.rollouts.attention_mask[idx],
        pad_id=pad_id, temperature=settings.temperature, with_entropy=True, terms=list(terms.values()),
        packed=settings.train.packing,
    )
    got = dict(zip(terms, extra, strict=True))
    dev = logp.device
    mask, adv = b.mask[rows].to(dev), b.adv[rows].to(dev)
    old = b.old[rows].to(dev) if b.old is not None else logp.detach()
    row_in = {k: v[rows].to(dev) for k, v in b.rows.items()}
    available = {**row_in, "ref_logprobs": b.ref[rows].to(dev) if b.ref is not None else None}
    for k in logit_inputs(parts.loss_inputs):  # on-policy pi_old is the current policy, as for `old`
        available[k] = got[k]
        available.setdefault(f"old_{k}", got[k])
    extra_in = {k: available[k] for k in parts.loss_inputs if available[k] is not None}
    behaviour = b.rollouts.behaviour_logprobs[idx].to(dev)
    w = parts.correction(old, behaviour, mask) if parts.correction is not None else None
    loss_NT = parts.loss(logp, old, adv, mask, weights=w, **extra_in)
    out: dict = {"logp": logp.detach(), "old": old, "entropy": entropy, "kl_sum": 0.0}
    if w is not None:
        out["offpolicy_w"] = w
    here = {**row_in, "mask": mask, "advantages": adv, "behaviour_logprobs": behaviour, "logprobs": logp.detach(),
            "old_logprobs": old}
    for lw in parts.loss_weights:  # the chosen per-token factors of the policy loss, in order
        w_NT = weigh(lw, parts, here) if lw.per_pass else b.weights[lw.name][rows].to(dev)
        loss_NT = loss_NT * w_NT.to(loss_NT.dtype)
        out[f"loss_weight/{lw.name}"] = w_NT
    if b.ref is not None and parts.kl is not None:
        kl_NT = parts.kl(logp, available["ref_logprobs"]) * mask
        loss_NT = loss_NT + parts.kl_coef * kl_NT
        out["kl_sum"] = float(kl_NT.sum().detach())
    if parts.entropy is not None:  # a bonus is negative: -coef * H per token
        loss_NT = loss_NT + got["entropy_term"] * mask
    if parts.entropy_measure is not None:
        out["measured"] = got["measured"].detach()
    return loss_NT, out


def weigh(w: LossWeight, parts: LearnParts, available: dict[str, Tensor]) -> Tensor:
    """Loss weight ``w`` ``[n, T]`` from the inputs it declares, out of ``available`` and the loss's clip band."""
    have = {**available, "eps_low": parts.clip_band[0], "eps_high": parts.clip_band[1]}
    missing = [k for k in w.inputs if k not in have]
    if missing:
        raise KeyError(f"loss weight {w.name!r} reads {missing}, which this update does not have "
                       f"(it has {sorted(have)})")
    return w.weigh(**{k: have[k] for k in w.inputs})


def logit_inputs(loss_inputs: Sequence[str]) -> list[str]:
    """The :data:`LOGIT_INPUTS` a loss declaring ``loss_inputs`` reads, itself or as its ``old_*`` version."""
    return [k for k in LOGIT_INPUTS if k in loss_inputs or f"old_{k}" in loss_inputs]


def _detached(term: LogitTerm, logits: Tensor) -> Tensor:
    """``term`` of the logits without gradient (a loss input, not a loss term)."""
    return term(logits.detach())


def step_metrics(
    parts: LearnParts,
    b: Minibatch,
    got: dict[str, Tensor],
    mask: Tensor,
    loss: float,
    grad_norm: float,
    kl_sum: float,
    entropy_state: object | None,
    top_q: float,
) -> dict[str, float]:
    """The metrics of one optimizer step from its micro-batches' detached outputs (``got``)."""
    logp, old, entropy = got["logp"], got["old"], got["entropy"]
    dev = logp.device
    adv_rows = b.adv.to(dev).reshape(len(b.idx), -1).expand_as(logp)
    eps = {"eps_low": parts.clip_band[0], "eps_high": parts.clip_band[1]}
    behaviour = b.rollouts.behaviour_logprobs[b.idx].to(dev)
    sampled = mask  # tokens the sampler drew: external rows (demonstrations) have no sampler log-probs
    if "external" in b.rows:
        ext = b.rows["external"].to(dev).to(mask.dtype)
        sampled = mask * (1 - (ext if ext.dim() == 2 else ext[:, None]))
    out = {
        "loss": loss,
        "optim/grad_norm": grad_norm,
        "policy/entropy": float((entropy * mask).sum() / mask.sum()),
        "policy/entropy_top": _top_mean(entropy, mask, top_q),
        "policy/kl_ref": kl_sum / float(mask.sum()) if b.ref is not None and parts.kl is not None else float("nan"),
        **{f"policy/{k}": v for k, v in ratio_stats(logp, old, adv_rows, mask, **eps).items()},
        # HINT's Affinity between the sampler's log-probs and the trainer's (before this step)
        **{f"policy/{k}": v for k, v in affinity(logp, behaviour, sampled, adv_rows).items()},
        # pi_old against the sampler's mu, and what the behaviour correction did with it
        **{f"offpolicy/{k}": v for k, v in mismatch_stats(old, behaviour, sampled, got.get("offpolicy_w")).items()},
    }
    rows_in = {"advantages": b.adv.to(dev), **{k: v.to(dev) for k, v in b.rows.items()}}
    for w in parts.loss_weights:  # loss_weight/<name>_mean and what the entry adds
        out.update(loss_weights.stats(w.name, got[f"loss_weight/{w.name}"].to(dev), mask, **rows_in))
    if parts.entropy is not None:  # the coefficient in use (AEnt: its adaptive state's)
        out["entropy/coef"] = float(getattr(entropy_state, "coef", parts.entropy_coef))
    if "measured" in got:  # what a stateful regularizer's updater is fed
        out["entropy/regularized"] = float((got["measured"] * mask).sum() / mask.sum())
    return out


def aggregation_weights(aggregate: Callable[[Tensor, Tensor], Tensor], mask_NT: Tensor) -> Tensor:
    """The gradient of aggregate(loss, mask) with respect to the loss at this mask, ``[N, T]``: every
    aggregation is linear in the per-token loss, so aggregate(loss) = sum(weights * loss) and any
    split of the rows adds up.
    """
    probe = torch.zeros(mask_NT.shape, dtype=torch.float32, device=mask_NT.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate(probe, mask_NT), probe)
    return weights


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, pad_id: int, temperature: float,
    budget: int, terms: Sequence[LogitTerm] = (), shard: Shard = LOCAL, packing: bool = False,
) -> Tensor:
    """Log-probs of every row's completion under ``model`` ``[N, T]`` (no gradient), in micro-batches
    of at most ``budget`` tokens (those of this ``shard``, the rows gathered back to every rank); on the CPU.
    With logit ``terms``: ``[N, T, 1 + len(terms)]``, the log-probs then each term. ``packing``
    (``train.packing``): each micro-batch one packed sequence, the budget counting real tokens.
    """

    def forward(rows: Tensor) -> Tensor:
        lp, _, extra = completion_terms(model, [row_prompts[i] for i in rows.tolist()], rollouts.token_ids[rows],
                                        rollouts.attention_mask[rows], pad_id=pad_id, temperature=temperature,
                                        terms=terms, packed=packing)
        return (torch.stack([lp, *extra], -1) if terms else lp).float().cpu()

    tokens = row_tokens(row_prompts, rollouts.attention_mask, packing)
    return torch.cat([lp for _, lp in over_runs(forward, tokens, budget, shard)])


def _top_mean(entropy_NT: Tensor, mask_NT: Tensor, q: float) -> float:
    """Mean entropy of the ceil(q M) highest-entropy of the M response tokens ("forking tokens",
    arXiv:2506.01939); NaN when there are none.
    """
    h = entropy_NT[mask_NT.bool()]
    if h.numel() == 0:
        return float("nan")
    return float(torch.topk(h, max(1, math.ceil(q * h.numel()))).values.mean())
