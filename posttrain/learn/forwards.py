"""The Learner's forward passes without gradient, each written once for a :class:`~posttrain.learn.shard.Shard`.

The policy's token entropies, the frozen reference's log-probs (and log-partitions), the critic's values and the
policy's prompt log-probs (what ``prepare``'s input providers read). Each runs in micro-batches of at most
``budget`` tokens (``train.micro_batch_tokens``), this shard's share of them, and comes back whole, on the CPU, on
every rank.
The one-process Learner calls them with the local shard; the sharded learner's ranks with theirs, over their
sharded models (``learn/distributed/fsdp.py``, command ``forward``). Each takes ``packing`` (``train.packing``):
the policy's and the reference's log-prob passes (entropies, reference log-probs) then run each micro-batch as
one packed sequence (``learn/packing.py``); the critic's values and the prompt log-probs run as they are (the
critic has its own forward; prompts hold no completion padding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithms.value import ValueHead
from posttrain.learn.critic import completion_values
from posttrain.learn.logprobs import RootForward, completion_logprobs, log_partition, prompt_logprobs
from posttrain.learn.packing import row_tokens
from posttrain.learn.shard import LOCAL, Shard, over_runs
from posttrain.learn.update import batched_logprobs
from posttrain.rollout import Rollout


@torch.no_grad()
def token_entropies(model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, pad_id: int,
                    temperature: float, budget: int, shard: Shard = LOCAL, packing: bool = False) -> Tensor:
    """Entropy of the policy at every completion token, ``[N, T]`` on the CPU (not masked)."""

    def forward(rows: Tensor) -> Tensor:
        _, h = completion_logprobs(model, [row_prompts[i] for i in rows.tolist()], rollouts.token_ids[rows],
                                   rollouts.attention_mask[rows], pad_id=pad_id, temperature=temperature,
                                   with_entropy=True, packed=packing)
        return h.float().cpu()

    tokens = row_tokens(row_prompts, rollouts.attention_mask, packing)
    return torch.cat([h for _, h in over_runs(forward, tokens, budget, shard)])


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, pad_id: int,
                       temperature: float, budget: int, shard: Shard = LOCAL, packing: bool = False) -> Tensor:
    """Log pi_ref of every completion token, ``[N, T]`` on the CPU (not masked), at the sampling temperature."""
    return batched_logprobs(model, row_prompts, rollouts, pad_id=pad_id, temperature=temperature, budget=budget,
                            shard=shard, packing=packing)


@torch.no_grad()
def reference_log_partition(model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, pad_id: int,
                            temperature: float, budget: int, shard: Shard = LOCAL, packing: bool = False) -> Tensor:
    """Log pi_ref of every completion token and the log-partition log sum_a exp z_t(a) of the reference's logits
    that predict it, ``[N, T, 2]`` on the CPU (not masked), at the sampling temperature (the teacher-forcing-induced
    reward reads the logits as Q-values: ``advantages.induced_token_rewards``).
    """
    return batched_logprobs(model, row_prompts, rollouts, pad_id=pad_id, temperature=temperature, budget=budget,
                            terms=(log_partition,), shard=shard, packing=packing)


@torch.no_grad()
def values(model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, head: ValueHead, pad_id: int,
           temperature: float, budget: int, shard: Shard = LOCAL, packing: bool = False) -> Tensor:
    """V(s_t) of the critic at every completion token as its ``head`` reads it, ``[N, T]`` on the CPU (not masked;
    no temperature).
    """
    del temperature, packing  # a value head's output is not a distribution; the critic's forward is not packed
    width = rollouts.token_ids.shape[1]

    def forward(rows: Tensor) -> Tensor:
        return completion_values(model, [row_prompts[i] for i in rows.tolist()], rollouts.token_ids[rows],
                                 rollouts.attention_mask[rows], pad_id=pad_id, head=head).float().cpu()

    return torch.cat([v for _, v in over_runs(forward, [len(p) + width for p in row_prompts], budget, shard)])


@torch.no_grad()
def prompts_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], *, pad_id: int, temperature: float,
                     budget: int, shard: Shard = LOCAL, packing: bool = False) -> tuple[Tensor, Tensor]:
    """Log pi(x_j | x_<j) at every prompt token after the first, ``[P, L - 1]``, and its mask, on the CPU: each
    micro-batch left-padded to its own longest prompt and laid right-aligned into the batch's (``packing`` is
    not read: prompts carry no completion padding).
    """
    del packing
    width = max(max(map(len, prompt_ids)) - 1, 0)
    logp_PL, mask_PL = torch.zeros(len(prompt_ids), width), torch.zeros(len(prompt_ids), width, dtype=torch.long)

    def forward(rows: Tensor) -> tuple[Tensor, Tensor]:
        prompts = [prompt_ids[i] for i in rows.tolist()]
        if isinstance(model, RootForward):  # a sharded policy: the whole computation is the root's forward
            return model(prompt_logprobs, prompts, pad_id=pad_id, temperature=temperature)
        return prompt_logprobs(model, prompts, pad_id=pad_id, temperature=temperature)

    for rows, (lp, m) in over_runs(forward, [len(p) for p in prompt_ids], budget, shard):
        if lp.shape[1]:  # left-padded: the micro-batch's last columns are the batch's last columns
            logp_PL[rows, width - lp.shape[1]:] = lp.float()
            mask_PL[rows, width - lp.shape[1]:] = m.long()
    return logp_PL, mask_PL


# The forwards a Learner runs, by name, and which of its models each runs on
FORWARDS: dict[str, tuple[Callable[..., object], str]] = {
    "token_entropies": (token_entropies, "policy"),
    "reference_logprobs": (reference_logprobs, "reference"),
    "reference_log_partition": (reference_log_partition, "reference"),
    "values": (values, "critic"),
    "prompts_logprobs": (prompts_logprobs, "policy"),
}
