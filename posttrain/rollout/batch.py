"""The rollout batch: what an engine returns and what every later phase reads.

A :class:`Rollout` holds P prompts x n sampled completions, prompt-major (rows ``i*n .. i*n+n-1``
belong to prompt ``i``). The completion side is ``[N, T]`` (N = P * n, T = the longest
completion) and carries two masks:

- ``attention_mask``: 1 on every real token the model reads (what log-prob recomputation attends
  to), 0 on padding;
- ``loss_mask``: 1 on the tokens the policy is trained on. For a single-turn rollout it equals
  the attention mask; a multi-turn rollout attends to tool outputs and environment replies but
  trains only on what the policy sampled.

``behaviour_logprobs`` are log pi_behaviour(token) of the sampler, under ``logits / temperature``
before top-k / top-p truncation (what the trainer recomputes), 0 where ``loss_mask`` is 0.
``policy_version`` says which optimizer step's weights sampled each row (engines are told by
``sync``), so an off-policy correction or a staleness bound can read it. ``turn_ids`` maps every
completion token to the turn whose *sampled* action it belongs to (0, 1, ...) and -1 elsewhere
(context the environment or the chat template added, padding): turn-level advantages are
broadcast to tokens through it. A single-turn rollout has 0 on its loss-mask tokens. ``cut`` marks
the rows an interrupted ``generate`` stopped while they were still running (``finished`` False, short
of ``max_new_tokens``; ``rollout.on_new_weights = "resubmit"`` samples them again, ``"continue"`` continues
them): a flag of the row itself,
so that it survives :func:`concat_rollouts` of parts that stopped at different widths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Rollout:
    """Sampled completions of P prompts, n per prompt (see the module docstring)."""

    prompt_ids: list[list[int]]  # P token lists
    token_ids: Tensor  # long [N, T], pad id after the end
    attention_mask: Tensor  # float [N, T]
    loss_mask: Tensor  # float [N, T]
    behaviour_logprobs: Tensor  # float [N, T]
    finished: Tensor  # bool [N]: ended with EOS (else truncated at max_new_tokens)
    texts: list[str]  # N decoded completions (special tokens skipped)
    n: int  # completions per prompt (the group size G)
    policy_version: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # long [N]
    turn_ids: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # long [N, T]
    cut: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # bool [N]: stopped by an interrupt

    def __post_init__(self) -> None:
        n_rows = self.token_ids.shape[0]
        if self.policy_version.numel() == 0 and n_rows:
            self.policy_version = torch.zeros(n_rows, dtype=torch.long)
        if self.cut.numel() == 0 and n_rows:
            self.cut = torch.zeros(n_rows, dtype=torch.bool)
        if self.turn_ids.numel() == 0 and self.token_ids.numel():  # single turn: turn 0 on the trained tokens
            self.turn_ids = torch.where(self.loss_mask > 0, 0, -1).long()
        elif self.turn_ids.numel() == 0:
            self.turn_ids = torch.zeros(self.token_ids.shape, dtype=torch.long)
        shapes = {self.token_ids.shape, self.attention_mask.shape, self.loss_mask.shape,
                  self.behaviour_logprobs.shape, self.turn_ids.shape}
        if len(shapes) != 1:
            raise ValueError(f"a Rollout's [N, T] tensors disagree in shape: {sorted(map(tuple, shapes))}")
        if len(self.texts) != n_rows or self.policy_version.shape != (n_rows,) or self.cut.shape != (n_rows,):
            raise ValueError(
                f"a Rollout of {n_rows} token rows has {len(self.texts)} texts, policy versions of shape "
                f"{tuple(self.policy_version.shape)} and cut flags of shape {tuple(self.cut.shape)}"
            )

    def __setstate__(self, state: dict) -> None:
        """Unpickle, one pickled before ``cut`` existed (a checkpoint's batches made ahead) included."""
        self.__dict__.update(state)
        if "cut" not in state:
            self.cut = torch.zeros(len(self.texts), dtype=torch.bool)

    @classmethod
    def single_turn(
        cls,
        prompt_ids: list[list[int]],
        token_ids: Tensor,
        mask: Tensor,
        behaviour_logprobs: Tensor,
        finished: Tensor,
        texts: list[str],
        n: int,
        policy_version: int = 0,
        cut: Tensor | None = None,
    ) -> Rollout:
        """A single-turn batch: every completion token is both attended to and trained on (``cut``: the
        rows an interrupt stopped, none by default).
        """
        mask = mask.float()
        return cls(prompt_ids, token_ids, mask, mask.clone(), behaviour_logprobs, finished, texts, n,
                   torch.full((token_ids.shape[0],), policy_version, dtype=torch.long),
                   cut=torch.zeros(0, dtype=torch.bool) if cut is None else cut.bool())

    @property
    def group_ids(self) -> Tensor:
        """The prompt (group) index of every row, ``[N]``."""
        return torch.arange(len(self.prompt_ids)).repeat_interleave(self.n)

    @property
    def row_prompts(self) -> list[list[int]]:
        """The prompt of every row (N lists; the n rows of a group share one list)."""
        return [p for p in self.prompt_ids for _ in range(self.n)]

    @property
    def lengths(self) -> Tensor:
        """Response lengths in tokens, ``[N]``: the sampled (loss-mask) tokens, so that a multi-turn
        episode's environment replies do not count as the policy's length (OpenRLHF PR #1252).
        """
        return self.loss_mask.sum(dim=1).long()

    @property
    def num_tokens(self) -> int:
        """Total completion tokens (attended)."""
        return int(self.attention_mask.sum().item())

    def select_groups(self, groups: list[int]) -> Rollout:
        """The completions of the given prompt indices, in that order."""
        rows = [g * self.n + j for g in groups for j in range(self.n)]
        idx = torch.tensor(rows, dtype=torch.long)
        return Rollout(
            prompt_ids=[self.prompt_ids[g] for g in groups],
            token_ids=self.token_ids[idx],
            attention_mask=self.attention_mask[idx],
            loss_mask=self.loss_mask[idx],
            behaviour_logprobs=self.behaviour_logprobs[idx],
            finished=self.finished[idx],
            texts=[self.texts[i] for i in rows],
            n=self.n,
            policy_version=self.policy_version[idx],
            turn_ids=self.turn_ids[idx],
            cut=self.cut[idx],
        )


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Concatenate rollouts of several generation batches (same ``n``), right-padding to one T."""
    if len(parts) == 1:
        return parts[0]
    width = max(c.token_ids.shape[1] for c in parts)

    def pad(x: Tensor, value: float) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return Rollout(
        prompt_ids=[p for c in parts for p in c.prompt_ids],
        token_ids=torch.cat([pad(c.token_ids, pad_id) for c in parts]),
        attention_mask=torch.cat([pad(c.attention_mask, 0.0) for c in parts]),
        loss_mask=torch.cat([pad(c.loss_mask, 0.0) for c in parts]),
        behaviour_logprobs=torch.cat([pad(c.behaviour_logprobs, 0.0) for c in parts]),
        finished=torch.cat([c.finished for c in parts]),
        texts=[t for c in parts for t in c.texts],
        n=parts[0].n,
        policy_version=torch.cat([c.policy_version for c in parts]),
        turn_ids=torch.cat([pad(c.turn_ids, -1).long() for c in parts]),
        cut=torch.cat([c.cut for c in parts]),
    )


def join_groups(parts: list[Rollout], pad_id: int, prompt_ids: list[list[int]] | None = None) -> Rollout:
    """Rollouts of the same P prompts side by side: group p of the result is group p of every part in turn
    (the parts' n add up), right-padded to one T; ``prompt_ids`` default to the first part's. Where
    :func:`concat_rollouts` appends groups, this widens them (RL-PLUS's demonstration rows, RC-GRPO's
    reward-token slots).
    """
    P, width = len(parts[0].prompt_ids), max(r.token_ids.shape[1] for r in parts)

    def join(name: str, value: float) -> Tensor:
        xs = []
        for r in parts:
            x = getattr(r, name)
            if x.dim() == 2:
                x = torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
            xs.append(x.reshape(P, r.n, *x.shape[1:]))
        return torch.cat(xs, dim=1).flatten(0, 1)

    texts = [t for p in range(P) for r in parts for t in r.texts[p * r.n:(p + 1) * r.n]]
    return Rollout(prompt_ids=parts[0].prompt_ids if prompt_ids is None else prompt_ids,
                   token_ids=join("token_ids", pad_id), attention_mask=join("attention_mask", 0),
                   loss_mask=join("loss_mask", 0), behaviour_logprobs=join("behaviour_logprobs", 0),
                   finished=join("finished", 0), texts=texts, n=sum(r.n for r in parts),
                   policy_version=join("policy_version", 0), turn_ids=join("turn_ids", -1), cut=join("cut", 0))


def put_rows(into: Rollout, rows: list[int], part: Rollout, pad_id: int) -> Rollout:
    """``into`` with its rows ``rows`` replaced by the rows of ``part`` (in that order; both
    right-padded to the wider of the two). Prompts and the group layout are ``into``'s.
    """
    if part.token_ids.shape[0] != len(rows):
        raise ValueError(f"put_rows: {len(rows)} rows to replace, {part.token_ids.shape[0]} given")
    width = max(into.token_ids.shape[1], part.token_ids.shape[1])

    def merged(a: Tensor, b: Tensor, value: float) -> Tensor:
        a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=value).clone()
        a[rows] = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=value).to(a.dtype)
        return a

    idx = torch.tensor(rows, dtype=torch.long)
    texts = list(into.texts)
    for i, t in zip(rows, part.texts, strict=True):
        texts[i] = t
    finished, version, cut = into.finished.clone(), into.policy_version.clone(), into.cut.clone()
    finished[idx], version[idx], cut[idx] = part.finished, part.policy_version, part.cut
    return Rollout(
        prompt_ids=into.prompt_ids,
        token_ids=merged(into.token_ids, part.token_ids, pad_id),
        attention_mask=merged(into.attention_mask, part.attention_mask, 0.0),
        loss_mask=merged(into.loss_mask, part.loss_mask, 0.0),
        behaviour_logprobs=merged(into.behaviour_logprobs, part.behaviour_logprobs, 0.0),
        finished=finished,
        texts=texts,
        n=into.n,
        policy_version=version,
        turn_ids=merged(into.turn_ids, part.turn_ids, -1),
        cut=cut,
    )
