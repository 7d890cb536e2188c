"""Advantage-input providers: each input an estimator may declare has one provider, run only when
the run's estimator needs it (``PrepareParts.inputs``, set up once from the estimator's declared inputs).

- ``values [P, G, T]``: the critic's V(s_t) (PPO's ``gae``);
- ``entropies [P, G, T]``: token entropies of the current policy (``entropy_adv``; CANON's entropy
  metric builds on them);
- ``metric [P, G]``: CANON's per-response regrouping metric (``algorithm.advantage_metric``);
- ``prompt_confidence [P]``: ProGRPO's c(q);
- ``token_rewards [P, G, T]``: the KL penalty in the reward (``algorithm.kl_reward_coef``) for the
  estimators that take them (``gae``, ``reinforce_pp``);
- ``induced_rewards [P, G, T]``: the teacher-forcing-induced step reward of the frozen reference (``tf_reward``);
- ``baseline_rewards [P]``: ReMax's greedy-response reward, shaped like the samples' rewards;
- ``reference_rewards [P, M]``: rewards of M responses per prompt sampled once from the frozen
  reference policy (``produce/ref_samples.py``; A*-PO's ``a_star`` turns them into V*);
  both are sampled by the produce phase, which the batch carries them from (``Batch.sampled_inputs``:
  ``produce/collect.py``'s ``SAMPLED_INPUTS``);
- ``turn_rewards``, ``turn_mask``, ``state_ids``, ``agent_ids`` ``[P, G, K]`` and ``turn_ids
  [P, G, T]``: a multi-turn batch's turn-level arrays (``rollout/multiturn.py``), for the turn-level
  estimators; ``turn_values [P, G, K + 1]``: the critic's V at each turn's first token (Turn-PPO).
- ``external [P, G]``: bool, the rows the ``external_mix`` driver filled with the example's
  demonstration (RL-PLUS's ``grpo_onpolicy_stats`` takes its statistics from the others).

Every estimator may also read ``lengths``, ``mask`` and the sampler's ``logprobs``, always given.

A provider calls no model: the forward passes (entropies, prompt and reference log-probs, values) are
the Learner's (``learn/learner.py``), micro-batched by ``train.micro_batch_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from posttrain.algorithms import advantages
from posttrain.algorithms.advantages import low_prob_confidence
from posttrain.algorithms.registry import Registry
from posttrain.learn.learner import Learner
from posttrain.prepare.parts import PrepareParts
from posttrain.produce.batch import Batch


@dataclass
class InputContext:
    """What a provider may read. Providers run in ``prepare``, where the learner is: every forward pass
    they need is a Learner call.
    """

    parts: PrepareParts
    learner: Learner  # the policy's, the reference's and the critic's forward passes

    @property
    def pad_id(self) -> int:
        """The tokenizer's padding id."""
        return self.learner.pad_id


@dataclass
class StepInputs:
    """The step's batch as the providers see it."""

    batch: Batch
    mask_NT: Tensor  # the loss mask times the rows' reward validity
    kl_coef: float  # the KL-in-the-reward beta in use (the adaptive controller's)

    @property
    def row_prompts(self) -> list[list[int]]:
        """The prompt of every row."""
        G = self.batch.rollouts.n  # the prompts the groups train on (HINT may have sampled with a hint)
        return [p for p in self.batch.prompt_ids for _ in range(G)]

    def grid(self, x_NT: Tensor) -> Tensor:
        """``[N, ...]`` as ``[P, G, ...]``."""
        P = len(self.batch.prompt_ids)
        return x_NT.reshape(P, -1, *x_NT.shape[1:])


Provider = Callable[[InputContext, StepInputs, dict[str, Tensor]], Tensor]
PROVIDERS: Registry[Provider] = Registry("advantage-input provider")
provider = PROVIDERS.register


def provide(ctx: InputContext, step: StepInputs) -> dict[str, Tensor]:
    """The inputs this run's estimator needs (``parts.inputs``, in dependency order), by name, plus
    what every estimator may read: ``lengths [P, G]``, ``mask [P, G, T]`` and the sampler's
    ``logprobs [P, G, T]``.
    """
    rollouts = step.batch.rollouts
    have: dict[str, Tensor] = {
        "lengths": step.grid(rollouts.lengths.float()),
        "mask": step.grid(step.mask_NT),
        "logprobs": step.grid(rollouts.behaviour_logprobs),
    }
    for name in ctx.parts.inputs:
        have[name] = PROVIDERS.get(name)(ctx, step, have)
    return have


@provider("values")
def _values(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """V(s_t) of the critic at every response token, ``[P, G, T]`` (PPO's GAE)."""
    return step.grid(ctx.learner.values(step.row_prompts, step.batch.rollouts, step.mask_NT))


@provider("entropies")
def _entropies(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """Token entropies of the current policy, ``[P, G, T]`` (0 on padding)."""
    return step.grid(ctx.learner.token_entropies(step.row_prompts, step.batch.rollouts))


@provider("metric")
def _metric(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """CANON's per-response metric ``[P, G]`` (``algorithm.advantage_metric``)."""
    rollouts = step.batch.rollouts
    return response_metric(ctx.parts.metric or "length", step.grid(rollouts.lengths), have.get("entropies"),
                           step.grid(rollouts.loss_mask))


@provider("prompt_confidence")
def _prompt_confidence(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """ProGRPO's c(q) of every prompt, ``[P]``."""
    logp_PL, mask_PL = ctx.learner.prompt_logprobs(step.batch.prompt_ids)
    return prompt_confidence(logp_PL, mask_PL, fraction=ctx.parts.prompt_fraction)


@provider("token_rewards")
def _token_rewards(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """The KL penalty in the reward, ``[P, G, T]`` (``algorithm.kl_reward_coef``)."""
    if ctx.parts.kl_reward is None:
        raise ValueError("token_rewards are the KL penalty in the reward: set algorithm.kl_reward_coef > 0")
    rollouts = step.batch.rollouts
    ref_NT = ctx.learner.reference_logprobs(step.row_prompts, rollouts)
    return step.grid(kl_token_rewards(ctx.parts.kl_reward, step.kl_coef, rollouts.behaviour_logprobs, ref_NT,
                                      step.mask_NT))


@provider("induced_rewards")
def _induced_rewards(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """The teacher-forcing-induced step reward of the frozen reference (the MLE model), ``[P, G, T]``:
    r_t = f(a_t | s_t) - V(s_{t+1}) from its log-probs and log-partitions (``advantages.induced_token_rewards``).
    """
    out_NT2 = ctx.learner.forward("reference_log_partition", row_prompts=step.row_prompts,
                                  rollouts=step.batch.rollouts)
    return step.grid(advantages.induced_token_rewards(out_NT2[..., 0], out_NT2[..., 1], step.mask_NT.float().cpu()))


def _sampled(step: StepInputs, name: str) -> Tensor:
    """Input ``name`` as the produce phase sampled it for this batch (``Batch.sampled_inputs``)."""
    got = step.batch.sampled_inputs.get(name)
    if got is None:
        raise ValueError(f"{name} are sampled by the produce phase for an estimator that requires them "
                         "(produce/collect.py's SAMPLED_INPUTS); this batch carries none")
    return got


@provider("baseline_rewards")
def _baseline_rewards(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """ReMax's baseline, ``[P]``: the reward of each prompt's greedy response, sampled by the policy
    that sampled the batch and rewarded like the samples (``produce/collect.py``'s ``greedy_baseline``).
    """
    return _sampled(step, "baseline_rewards")


@provider("reference_rewards")
def _reference_rewards(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """The rewards of M responses per prompt sampled from the frozen reference policy, ``[P, M]``
    (``produce/ref_samples.py``; A*-PO's V* reads them), M = ``ProduceParts.ref_samples``.
    """
    return _sampled(step, "reference_rewards")


@provider("external")
def _external(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """The external rows of the batch, bool ``[P, G]`` (``produce/drivers/external_mix.py``)."""
    if step.batch.external_PG is None:
        raise ValueError("the `external` input needs external rows: rollout.driver = 'external_mix'")
    return step.batch.external_PG


def _turns(step: StepInputs) -> object:
    turns = step.batch.turns
    if turns is None:
        raise ValueError("turn-level inputs need multi-turn episodes (task.name = 'env')")
    return turns


@provider("turn_rewards")
def _turn_rewards(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """Each turn's reward r_{i,k}, ``[P, G, K]`` (0 on turns an episode did not reach)."""
    return _turns(step).rewards


@provider("turn_mask")
def _turn_mask(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """Episode i reached turn k, bool ``[P, G, K]``; an episode whose reward is invalid reaches none."""
    return _turns(step).mask & step.batch.valid_PG[:, :, None]


@provider("state_ids")
def _state_ids(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """A stable id of the state each turn acted from (GiGPO's anchor), long ``[P, G, K]``; -1: none."""
    return _turns(step).state_ids


@provider("agent_ids")
def _agent_ids(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """Who took each turn (MARS's player), long ``[P, G, K]``; 0 with one agent."""
    return _turns(step).agent_ids


@provider("turn_ids")
def _turn_ids(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """The turn of every sampled token, long ``[P, G, T]``; -1 on context and padding."""
    _turns(step)
    return step.grid(step.batch.rollouts.turn_ids)


@provider("turn_values")
def _turn_values(ctx: InputContext, step: StepInputs, have: dict[str, Tensor]) -> Tensor:
    """V(s_k) of the critic at each reached turn's first sampled token (its last context token), and 0
    after the last turn, ``[P, G, K + 1]`` (Turn-PPO; ``advantages.turn_start_values``).
    """
    return advantages.turn_start_values(have["values"], have["turn_ids"], _turns(step).mask.shape[-1])


def response_metric(kind: str, lengths_PG: Tensor, entropies_PGT: Tensor | None, mask_PGT: Tensor) -> Tensor:
    """One number per response, ``[P, G]``: its length (``"length"``), or the mean of its token
    entropies over its response tokens (``"entropy"``; 0 for an empty response), as CANON's
    authors' code regroups by (catalog 3.19).
    """
    if kind == "length":
        return lengths_PG.float()
    if entropies_PGT is None:
        raise ValueError("the entropy metric needs the policy's token entropies")
    m_PGT = mask_PGT.float()
    return (entropies_PGT.float().cpu() * m_PGT).sum(-1) / m_PGT.sum(-1).clamp(min=1.0)


def prompt_confidence(logp_PL: Tensor, mask_PL: Tensor, *, fraction: float) -> Tensor:
    """ProGRPO's c(q), ``[P]``: ``low_prob_confidence`` of the prompt's own token log-probs
    ``logp_PL [P, L]`` (``Learner.prompt_logprobs``, mask ``mask_PL``), exp(mean of the lowest
    ``fraction`` of log pi(x_j | x_<j)), the inverse "T_low" perplexity of the prompt. Provisional
    (see ``advantages.progrpo``).
    """
    return low_prob_confidence(logp_PL[:, None], mask_PL[:, None], fraction=fraction)[:, 0]


def kl_token_rewards(
    estimator: Callable[[Tensor, Tensor], Tensor],
    coef: float,
    behaviour_NT: Tensor,
    ref_NT: Tensor,
    mask_NT: Tensor,
) -> Tensor:
    """The KL penalty in the reward, ``[N, T]``: r^KL_t = -coef * KL_t on every response token (0 on
    padding), KL_t = ``estimator(log pi_old(y_t), log pi_ref(y_t))`` with the sampler's log-probs
    ``behaviour_NT`` and the reference's ``ref_NT`` (``Learner.reference_logprobs``), both at the sampling
    temperature (InstructGPT / PPO-RLHF, REINFORCE++; verl ``apply_kl_penalty`` with ``use_kl_in_reward``;
    OpenRLHF ``compute_reward``).
    """
    m = mask_NT.float().cpu()
    return -coef * estimator(behaviour_NT.float().cpu(), ref_NT.float().cpu()) * m


def kl_reward_metrics(token_rewards_PGT: Tensor | None, mask_PGT: Tensor, coef: float) -> dict[str, float]:
    """``kl_reward/kl``: the KL estimate per response token, mean over responses of each one's token
    mean (verl's ``actor/reward_kl_penalty``); ``kl_reward/penalty``: the penalty summed over a
    response, mean over responses. ``{}`` without a KL in the reward.
    """
    if token_rewards_PGT is None:
        return {}
    m = mask_PGT.float()
    n = m.sum(-1)
    keep = n > 0
    if not keep.any():
        return {"kl_reward/kl": float("nan"), "kl_reward/penalty": float("nan")}
    per_seq_sum = (token_rewards_PGT.float() * m).sum(-1)[keep]
    return {
        "kl_reward/kl": float((-per_seq_sum / n[keep]).mean() / coef),
        "kl_reward/penalty": float(per_seq_sum.mean()),
        "kl_reward/coef": coef,
    }
