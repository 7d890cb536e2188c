"""The base of every config section, an entry with its parameters, and the names of the inputs the
loop provides to the registry entries (advantage estimators, losses, shapers).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

Scalar = int | float | str | bool
Params = dict[str, Scalar | list[Scalar]]


# Turn-level inputs of multi-turn episodes (task.name = "env", the multi_turn driver; rollout/multiturn.py).
TURN_INPUTS = ("turn_rewards", "turn_mask", "turn_ids", "state_ids", "agent_ids", "turn_values")

# Extra inputs the RL loop provides, by name (DESIGN.md). An entry that requires any other input
# (`token_rewards`, ...) is rejected at config time instead of failing mid-run. `values` come from the
# critic ([critic], posttrain/learn/critic.py), which the loop builds when the estimator needs them
# (or `turn_values`, the critic read at each turn's first token: turn_ppo);
# `entropies`, `metric` (algorithm.advantage_metric) and `prompt_confidence` are computed
# (posttrain/prepare/providers.py) only for an estimator that requires them; `token_rewards` (the KL
# penalty in the reward) only when algorithm.kl_reward_coef > 0.
ADVANTAGE_INPUTS = (
    "lengths",
    "mask",
    "logprobs",
    "baseline_rewards",
    "reference_rewards",  # [P, M]: rewards of M responses per prompt sampled from the frozen reference (a_star)
    "entropies",
    "values",
    "metric",
    "prompt_confidence",
    "token_rewards",
    "induced_rewards",  # [P, G, T]: the teacher-forcing-induced step reward of the frozen reference (tf_reward)
    *TURN_INPUTS,
    "external",  # bool [P, G]: the rows a driver declaring external_rows (config/checks.py) filled
)
# `mean_logsoftmax` [N, T]: mean over the vocabulary of the current policy's log-softmax at each completion
# position (a logit term of the micro-batch's forward, no gradient); `old_mean_logsoftmax`: the same under pi_old,
# computed with the old log-probs (learn/update.py LOGIT_INPUTS); neither is computed unless the loss declares it.
# `logsumexp` [N, T]: log sum_a exp(z_t(a)) of the current policy's temperature-scaled logits z_t (the level of the
# logits, which the log-probs drop), with gradient (algorithms/losses_common.py GRAD_INPUTS); `ref_logsumexp`: the
# same under the frozen reference, computed in the pass of its log-probs (ShiQ's value V_ref; learn/update.py).
LOSS_INPUTS = ("ref_logprobs", "rewards", "group_ids", "mean_logsoftmax", "old_mean_logsoftmax", "external",
               "logsumexp", "ref_logsumexp")
# the loss inputs with a value per token, [N, T]; the others hold one per row, [N]
TOKEN_LOSS_INPUTS = ("ref_logprobs", "mean_logsoftmax", "old_mean_logsoftmax", "logsumexp", "ref_logsumexp")
# An entry that requires `external` ([P, G] for an advantage estimator, [N] for a loss) runs only with a driver
# that declares external_rows; a row-coupled loss or the one aggregation a loss needs are traits too
# (posttrain/algorithms/registry.py Traits, read by config/checks.py).
SHAPER_INPUTS = ("lengths", "ref_rewards", "step_rewards", "step_mask")  # step_*: algorithm.step_reward


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StageSpec(Section):
    """A registry entry with its parameters (e.g. one reward shaper)."""

    name: str
    params: Params = {}
