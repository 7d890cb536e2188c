"""Multi-turn episodes: the policy (through any rollout engine) acts, an environment answers, token in
and token out, until the episode ends; then the episodes are packed into one :class:`Rollout`.

Episodes run in lockstep: each round is one batched ``engine.generate`` over the still active
episodes, from their token ids (the group's prompt plus everything so far), then every active
environment steps in its own thread under a deadline. The ids the engine sampled are kept as they
are; an environment's reply is appended as :class:`~posttrain.rollout.chat_delta.ChatDelta`'s
context ids (see that module). An episode ends, with its reason recorded, when:

- ``done``: the environment says so;
- ``max_turns``: its last allowed turn was taken;
- ``length``: a turn hit ``max_new_tokens`` without EOS (the environment never sees a cut turn);
- ``budget``: the episode's tokens after the prompt (actions and context) would pass ``max_tokens``
  (a whole-episode budget, not a per-turn one: rllm PR #575, SkyRL #406);
- ``error`` / ``timeout``: the environment raised, returned something that is not a
  :class:`StepResult`, or took longer than ``step_timeout_s``. The episode's reward is ``None``
  (scored like a failed reward call) and its transcript goes to the failure log; the run goes on.

Packed layout, one row per episode (prompt-major, G per group): ``token_ids`` = ``action_0 |
context_1 | action_1 | ...``; ``attention_mask`` 1 on all of it; ``loss_mask`` 1 only on sampled
action tokens (never inferred from ids: TRL #4974); ``behaviour_logprobs`` the sampler's on actions,
0 on context; ``turn_ids`` k on turn k's action tokens, -1 elsewhere. Turn-level arrays go beside it
in :class:`Turns` (``[P, G, K]``, K = the turn limit).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from posttrain.envs.base import Episode, Message, StepResult
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.batch import Rollout
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.tasks.base import Example

END_REASONS = ("done", "max_turns", "length", "budget", "error", "timeout")


@dataclass(frozen=True)
class Limits:
    """How long an episode may run."""

    max_turns: int
    max_tokens: int  # tokens after the prompt: actions and context together
    step_timeout_s: float = 10.0


@dataclass
class Turn:
    """One policy turn: the context that came before it (none for turn 0) and what was sampled."""

    context_ids: list[int]
    action_ids: list[int]
    logprobs: list[float]
    state_key: str | None  # the situation the action was taken in (before it)
    reward: float = 0.0


@dataclass
class EpisodeRecord:
    """A finished episode."""

    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # the transcript as messages
    reward: float | None = 0.0  # None: the environment failed
    success: float = 0.0
    end: str = ""
    info: dict[str, float] = field(default_factory=dict)  # every step's numbers, summed
    error: str | None = None

    @property
    def held(self) -> int:
        """Tokens after the prompt so far."""
        return sum(len(t.context_ids) + len(t.action_ids) for t in self.turns)


def run_episodes(
    engine: RolloutEngine,
    delta: ChatDelta,
    episodes: list[Episode],
    prompt_ids: list[list[int]],
    first_messages: list[list[Message]],
    sampling: SamplingParams,
    limits: Limits,
    seed_of: Callable[[int], int],
) -> list[EpisodeRecord]:
    """Run ``episodes`` (one prompt each, already reset) to their ends; ``seed_of(round)`` seeds each
    round's sampling. Returns one record per episode, in order.
    """
    recs = [EpisodeRecord(messages=list(m)) for m in first_messages]
    pending: list[list[int]] = [[] for _ in episodes]  # context ids waiting for the next turn
    for rnd in range(limits.max_turns):
        active = [i for i, r in enumerate(recs) if not r.end]
        if not active:
            break
        keys = [_state_key(episodes[i]) for i in active]
        room = [limits.max_tokens - recs[i].held - len(pending[i]) for i in active]
        sp = replace(sampling, n=1, max_new_tokens=max(1, min(sampling.max_new_tokens, max(room))))
        out = engine.generate([prompt_ids[i] + _ids_so_far(recs[i]) + pending[i] for i in active], sp,
                              seed=seed_of(rnd))
        stepping: list[tuple[int, str]] = []
        for row, (i, key, left) in enumerate(zip(active, keys, room, strict=True)):
            n = int(out.loss_mask[row].sum())
            ids, lps = out.token_ids[row, :n].tolist(), out.behaviour_logprobs[row, :n].tolist()
            ids, lps = ids[:left], lps[:left]
            recs[i].turns.append(Turn(pending[i], ids, lps, key))
            pending[i] = []
            text = delta.tokenizer.decode([t for t in ids if t != delta.eos_id], skip_special_tokens=True)
            recs[i].messages.append({"role": "assistant", "content": text})
            if ids and ids[-1] == delta.eos_id:
                stepping.append((i, text))
            else:  # cut before EOS: by the episode's budget, or by the turn's max_new_tokens
                recs[i].end = "budget" if len(ids) >= left else "length"
        results = _step_all([(episodes[i], text) for i, text in stepping], limits.step_timeout_s)
        for (i, _), res in zip(stepping, results, strict=True):
            _take_step(recs[i], res, rnd, limits, delta, pending, i)
    for r in recs:
        r.end = r.end or "max_turns"
    return recs


def _ids_so_far(rec: EpisodeRecord) -> list[int]:
    return [t for turn in rec.turns for t in (*turn.context_ids, *turn.action_ids)]


def _state_key(ep: Episode) -> str | None:
    get = getattr(ep, "state_key", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001 - a key is optional; a broken one only loses GiGPO's anchor
        return None


def _take_step(rec: EpisodeRecord, res: StepResult | str, rnd: int, limits: Limits, delta: ChatDelta,
               pending: list[list[int]], i: int) -> None:
    """Record one environment answer: reward, info, the end or the next context."""
    if isinstance(res, str):  # "error: ..." or "timeout"
        rec.end, rec.reward, rec.error = ("timeout" if res == "timeout" else "error"), None, res
        return
    rec.turns[-1].reward = float(res.reward)
    for k, v in res.info.items():
        rec.info[k] = rec.info.get(k, 0.0) + float(v)
    if "success" in res.info:
        rec.success = float(res.info["success"])
    rec.reward = float(res.info["final_reward"]) if "final_reward" in res.info else (rec.reward or 0.0) + res.reward
    rec.messages.extend(res.messages)
    if res.done:
        rec.end = "done"
    elif rnd == limits.max_turns - 1:
        rec.end = "max_turns"
    else:
        ctx = delta.context_ids(list(res.messages))
        if rec.held + len(ctx) >= limits.max_tokens:  # no room left for one more sampled token
            rec.end = "budget"
        else:
            pending[i] = ctx


def _step_all(calls: list[tuple[Episode, str]], timeout_s: float) -> list[StepResult | str]:
    """``episode.step(action)`` for every call, each in a daemon thread, all under one deadline: a
    result, ``"error: ..."`` or ``"timeout"`` (a hung environment is abandoned, never waited for).
    """
    results: list[StepResult | str] = ["timeout"] * len(calls)

    def run(k: int, ep: Episode, action: str) -> None:
        try:
            res = ep.step(action)
            if not isinstance(res, StepResult) or not math.isfinite(float(res.reward)):
                raise TypeError(f"step() returned {res!r:.200}, not a StepResult with a finite reward")
            results[k] = res
        except Exception as e:  # noqa: BLE001 - an environment's bug scores its episode None, the run goes on
            results[k] = f"error: {type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(k, ep, a), daemon=True) for k, (ep, a) in enumerate(calls)]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return results


def state_id(key: str | None) -> int:
    """A stable 63-bit id of a state key (-1 for none): equal keys, equal ids, in every process."""
    if key is None:
        return -1
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


@dataclass
class Turns:
    """Turn-level arrays of a batch of episodes, ``[P, G, K]`` (K = the turn limit)."""

    rewards: Tensor  # float: r_{i,k}, 0 on absent turns
    mask: Tensor  # bool: episode i reached turn k
    state_ids: Tensor  # long: state_id(state key before turn k), -1 without one
    agent_ids: Tensor  # long: who acted (0: one agent)

    def select(self, groups: list[int]) -> Turns:
        """The turns of the given prompt indices, in that order."""
        idx = torch.tensor(groups, dtype=torch.long)
        return Turns(self.rewards[idx], self.mask[idx], self.state_ids[idx], self.agent_ids[idx])

    @staticmethod
    def cat(parts: list[Turns]) -> Turns:
        """Groups of several generation batches, one after the other."""
        return Turns(*(torch.cat([getattr(p, f) for p in parts]) for f in ("rewards", "mask", "state_ids",
                                                                              "agent_ids")))


def pack(recs: list[EpisodeRecord], prompt_ids: list[list[int]], G: int, K: int, pad_id: int,
         version: int) -> tuple[Rollout, Turns]:
    """The episodes (prompt-major, ``G`` per prompt) as one :class:`Rollout` and their :class:`Turns`."""
    per_ep = [
        [x for k, turn in enumerate(r.turns)
         for x in [(t, 0.0, 0.0, -1) for t in turn.context_ids]
         + [(t, 1.0, p, k) for t, p in zip(turn.action_ids, turn.logprobs, strict=True)]]
        for r in recs
    ]  # (token, loss mask, behaviour log-prob, turn id) of every token after the prompt
    width = max(1, max(len(x) for x in per_ep))
    N = len(recs)
    ids = torch.full((N, width), pad_id, dtype=torch.long)
    attn, loss, lp = torch.zeros(N, width), torch.zeros(N, width), torch.zeros(N, width)
    tid = torch.full((N, width), -1, dtype=torch.long)
    for n, toks in enumerate(per_ep):
        if toks:
            t, m, p, k = zip(*toks, strict=True)
            L = len(toks)
            ids[n, :L], loss[n, :L], lp[n, :L], tid[n, :L] = map(torch.tensor, (t, m, p, k))
            attn[n, :L] = 1.0
    P = len(prompt_ids)
    turn_r, turn_m = torch.zeros(P, G, K), torch.zeros(P, G, K, dtype=torch.bool)
    sid = torch.full((P, G, K), -1, dtype=torch.long)
    for n, r in enumerate(recs):
        for k, turn in enumerate(r.turns[:K]):
            turn_r[n // G, n % G, k], turn_m[n // G, n % G, k] = turn.reward, True
            sid[n // G, n % G, k] = state_id(turn.state_key)
    finished = torch.tensor([r.end not in ("length", "budget") for r in recs])
    rollouts = Rollout(prompt_ids=[list(p) for p in prompt_ids], token_ids=ids, attention_mask=attn, loss_mask=loss,
                    behaviour_logprobs=lp, finished=finished, texts=[transcript_text(r) for r in recs], n=G,
                    policy_version=torch.full((N,), version, dtype=torch.long), turn_ids=tid)
    return rollouts, Turns(turn_r, turn_m, sid, torch.zeros(P, G, K, dtype=torch.long))


def task_episodes(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, task: EpisodeSource,
                  examples: list[Example], sampling: SamplingParams,
                  seed_of: Callable[[int], int]) -> tuple[list[EpisodeRecord], Rollout, Turns]:
    """``sampling.n`` episodes of every example in ``task``'s environment (``envs/task.py``), run
    and packed. The episodes of one example share its first messages (their prompt).
    """
    G = sampling.n
    bind = getattr(getattr(task, "env", None), "bind_tokenizer", None)
    if bind is not None:  # an environment that reads the template (json_tools: its call format, its tool role)
        bind(tokenizer)
    delta = ChatDelta(tokenizer)  # checks that the template is prefix-preserving
    episodes, first, prompts = [], [], []
    for ex in examples:
        for _ in range(G):
            ep, messages = task.start(ex)
            episodes.append(ep)
            first.append(messages)
        prompts.append(delta.prompt_ids(first[-1]))
    limits = Limits(task.max_turns, task.max_tokens, task.step_timeout_s)
    recs = run_episodes(engine, delta, episodes, [prompts[n // G] for n in range(len(episodes))], first,
                        sampling, limits, seed_of)
    rollouts, turns = pack(recs, prompts, G, task.max_turns, engine.pad_id, engine.version)
    return recs, rollouts, turns


class EpisodeSource(Protocol):
    """What :func:`task_episodes` reads of a task (``EnvTask``)."""

    max_turns: int
    max_tokens: int
    step_timeout_s: float

    def start(self, example: Example) -> tuple[Episode, list[Message]]:
        """A fresh episode on ``example`` and its first messages."""
        ...


def turn_advantage_share(adv_N: Tensor, turn_ids_NT: Tensor) -> float:
    """The share of the batch's turns (an episode's turn k) on whose sampled tokens the advantage is
    not 0: how much of the episodes a step's credit reaches. ``adv_N`` is ``[N]`` (one number an
    episode) or ``[N, T]``.
    """
    adv_NT = adv_N.reshape(adv_N.shape[0], -1).expand(turn_ids_NT.shape) if adv_N.dim() == 1 else adv_N
    nonzero = adv_NT.abs() > 1e-8
    turns = int(turn_ids_NT.max()) + 1 if turn_ids_NT.numel() else 0
    present = hit = 0
    for k in range(turns):
        at_k = turn_ids_NT == k
        present += int(at_k.any(1).sum())
        hit += int((at_k & nonzero).any(1).sum())
    return hit / present if present else 0.0


def transcript_text(rec: EpisodeRecord) -> str:
    """The episode after its first messages, one line per message (``assistant: 8``, ``user: higher``)."""
    first = next((i for i, m in enumerate(rec.messages) if m["role"] == "assistant"), len(rec.messages))
    return "\n".join(f"{m['role']}: {m['content']}" for m in rec.messages[first:])
