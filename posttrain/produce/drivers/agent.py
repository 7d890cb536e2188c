"""The ``agent`` rollout driver: train agents that run outside posttrain, over an OpenAI-compatible API.

``rollout.driver_params.agent = "my_agent.py:run"`` names a callable (sync or ``async``), called once per
sample as ``run(base_url, example) -> float | None``: ``example`` is the task's
:class:`~posttrain.tasks.base.Example`, ``base_url`` (``http://127.0.0.1:PORT/episodes/<id>/v1``) is the
episode's own address on a loopback server over the policy being trained (the run's rollout engine,
``agent_episodes.py``). The agent talks to it with any OpenAI client, for as many calls as it likes, and returns
the episode's reward. P prompts, G episodes each, all running at once.

**What is trained.** posttrain records the token ids each call sampled and their log-probs (never re-tokenized)
and links them to the episode by its URL. Calls that extend one another (each call's prompt starts with the
previous call's prompt and answer, as a chat client's history does when the chat template renders an earlier
answer to the tokens that were sampled) form one *segment*, packed as one row the way ``multi_turn`` packs an
episode (``rollout/multiturn.py``): the first call's prompt, then each later call's new prompt tokens as context
(loss mask 0) and each call's sampled tokens as that turn's action (loss mask 1, the sampler's log-probs, turn id
k). A call that does not extend the episode so far starts a new segment; the episode trains on its *last*
segment (the one its last call extended or started) and the others are dropped, counted in
``agent/segments_dropped``: a row never joins tokens that were not sampled after one another. The rows of a group
share their prompts' longest common prefix as the group's prompt; the rest of each row's first prompt is context.

**Failures.** An agent that raises, returns None or a non-finite number, or has not returned within
``driver_params.timeout_s`` (abandoned, never waited for) scores None: ``scoring.on_error`` says whether that is 0
or masks the row; its transcript (every segment's tokens, decoded) goes to the failure log and the run goes on.
An episode that made no call has nothing to train and is masked out.

The agent's reward takes the place of the ``[[reward]]`` components: exactly one (its weight scales it).
``accuracy`` is the share of episodes whose reward is above 0.5. Every call samples with ``rollout.temperature``
and ``rollout.top_p`` (what the learner's log-probs assume), whatever the request asks, its ``max_tokens`` capped at
``rollout.max_new_tokens``. Stateless.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from posttrain.config.base import Section
from posttrain.errors import ConfigError
from posttrain.models.chat import encode_example
from posttrain.plugins import import_plugins, is_file_entry, loaded_plugins
from posttrain.produce.batch import Batch
from posttrain.produce.drivers.agent_episodes import EpisodeApp, EpisodeLog, EpisodeServer, Outcome, run_agents
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register
from posttrain.rollout import Rollout
from posttrain.rollout.multiturn import EpisodeRecord, Turn, pack
from posttrain.seeds import derive_seed

if TYPE_CHECKING:
    from posttrain.config import ProduceSettings


class AgentParams(Section):
    """``rollout.driver = "agent"``: an outside agent's episodes over an OpenAI-compatible API
    (posttrain/produce/drivers/agent.py).
    """

    agent: str = Field("", description="the agent, 'FILE.py:FUNCTION' or 'MODULE:FUNCTION', called as "
                       "run(base_url, example) -> float | None (sync or async); a relative FILE is looked up among "
                       "the recipe's plugins, then in the working directory")
    timeout_s: float = Field(60.0, gt=0, description="longest a generation batch's agents may run; one still "
                             "running then scores None")
    tool_parser: str | None = Field(None, description="how tool calls are read back from the sampled text "
                                    "(hermes, llama3_json, mistral, compact, any; default: the chat template's)")


def load_agent(spec: str) -> Callable:
    """The callable ``spec`` names; raises ``ValueError`` naming the key, what was expected and what was found."""
    key = "rollout.driver_params.agent"
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{key}: expected 'FILE.py:FUNCTION' or 'MODULE:FUNCTION', got {spec!r}")
    try:
        module = sys.modules[_plugin_module(where)] if is_file_entry(where) else importlib.import_module(where)
    except (ConfigError, ImportError) as e:
        raise ValueError(f"{key}: {spec!r}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}: {where} has no callable {name!r} (found {type(fn).__name__})")
    return fn


def _plugin_module(where: str) -> str:
    """The module name of agent file ``where``: a recipe plugin it names (resolved against the recipe's folder,
    matched by its trailing path), else the file resolved against the working directory, imported as a plugin.
    """
    tail = Path(where).expanduser().as_posix().removeprefix("./")
    for entry, module in loaded_plugins().items():
        if is_file_entry(entry) and (entry == where or Path(entry).as_posix().endswith("/" + tail)):
            return module
    (entry,) = import_plugins([where])
    return loaded_plugins()[entry]


def agent_fits(settings: ProduceSettings) -> None:
    """The agent loads; its reward is the one component; episodes are sampled by one policy each."""
    r = settings.rollout
    if len(settings.reward_weights) != 1:
        raise ValueError(f"reward: the agent's returned reward is the episode's only component; got "
                         f"{len(settings.reward_weights)} [[reward]] components (keep one, its weight scales it)")
    if r.on_new_weights != "finish":
        raise ValueError(f"rollout.on_new_weights = '{r.on_new_weights}' does not run with the agent driver (an "
                         "episode cut between calls would span two policies); use rollout.on_new_weights = 'finish'")
    load_agent(r.params().agent)


@register("agent", options=AgentParams, check=agent_fits, replayable=False,
          note="an agent's rows carry turn masks and turn ids")
def agent(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """P stream prompts, G agent episodes each, run against the policy's server and scored by the agents
    (module docstring). Stateless.
    """
    s, G = ctx.settings, ctx.sampling.n
    opts, P = s.rollout.params(), s.rollout.prompts_per_step
    fn = load_agent(opts.agent)
    examples = draw_prompts(ctx.task, P, s.seed, cursor)
    t0 = time.perf_counter()
    app = EpisodeApp(ctx.engine, ctx.tokenizer, ctx.sampling, seed=derive_seed(s.seed, "sample", step, batch),
                     tool_parser=opts.tool_parser, max_rows=P * G)
    server = EpisodeServer(app)
    names = [f"s{step}b{batch}e{n}" for n in range(P * G)]
    logs = [app.episodes.setdefault(name, EpisodeLog()) for name in names]
    rows = [ex for ex in examples for _ in range(G)]
    server.start()
    try:
        outcomes = run_agents(fn, [server.url(n) for n in names], rows, opts.timeout_s)
    finally:
        with app.lock:
            for log in logs:
                log.closed = True
        server.shutdown()
        server.server_close()
        app.close()
    fallback = [encode_example(ctx.tokenizer, ex, s.task.system_prompt) for ex in examples]
    rollouts, recs, dropped = pack_episodes(logs, fallback, G, ctx.engine.pad_id, ctx.engine.version,
                                            ctx.tokenizer)
    return _scored(ctx, examples, rollouts, recs, logs, outcomes, dropped, time.perf_counter() - t0), state


def pack_episodes(logs: list[EpisodeLog], fallback: list[list[int]], G: int, pad_id: int, version: int,
                  tokenizer: object) -> tuple[Rollout, list[EpisodeRecord], list[bool]]:
    """Each episode's kept segment as one row (``multiturn.pack``'s layout), prompt-major, G per group.

    Group p's prompt is the longest common prefix of its kept segments' prompts (``fallback[p]``, the
    example's encoded chat prompt, when none made a call); the rest of a row's prompt is its first context. A
    row whose prompt shares no token with the group's first is left empty, as is one that made no call: the
    returned flags mark them (nothing to train).
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    prompts, recs, empty = [], [], []
    for p in range(len(fallback)):
        kept = [log.kept for log in logs[p * G:(p + 1) * G]]
        firsts = [seg.prompt for seg in kept if seg is not None]
        prompt = common_prefix(firsts) if firsts else fallback[p]
        if not prompt:  # prompts that differ from their first token: the group's first row's prompt
            prompt = firsts[0]
        prompts.append(prompt)
        for seg in kept:
            if seg is None or seg.prompt[:len(prompt)] != prompt or not seg.turns:
                recs.append(EpisodeRecord(end="error"))
                empty.append(True)
                continue
            first = seg.turns[0]
            turns = [Turn(seg.prompt[len(prompt):] + first.context_ids, first.action_ids, first.logprobs, None),
                     *seg.turns[1:]]
            cut = not turns[-1].action_ids or turns[-1].action_ids[-1] != eos
            recs.append(EpisodeRecord(turns=turns, end="length" if cut else "done"))
            empty.append(False)
    K = max(1, max(len(r.turns) for r in recs))
    rollouts, _ = pack(recs, prompts, G, K, pad_id, version)
    texts = [tokenizer.decode(rollouts.token_ids[n][rollouts.attention_mask[n] > 0].tolist(),  # type: ignore
                              skip_special_tokens=False) for n in range(len(recs))]
    return replace(rollouts, texts=texts), recs, empty


def common_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest list that starts every one of ``seqs``: [[1, 2, 3], [1, 2, 4]] -> [1, 2]."""
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        n = next((i for i in range(n) if s[i] != first[i]), n)
    return list(first[:n])


def transcript(tokenizer: object, log: EpisodeLog) -> str:
    """Every segment of the episode, decoded with its special tokens (the failure log's record)."""
    parts = [tokenizer.decode(seg.ids, skip_special_tokens=False) for seg in log.segments]  # type: ignore
    return "\n--- new segment ---\n".join(parts) if parts else "(no call)"


def _scored(ctx: ProduceContext, examples: list, rollouts: Rollout, recs: list[EpisodeRecord], logs: list[EpisodeLog],
            outcomes: list[Outcome], empty: list[bool], seconds: float) -> Batch:
    """The :class:`Batch` of the episodes: rewards ``[P, G, 1]``, validity, metrics and the failure log."""
    P, G = len(examples), ctx.sampling.n
    name = ctx.rewards[0][0]
    reward_N = torch.tensor([math.nan if o.reward is None else o.reward for o in outcomes])
    missing = reward_N.isnan()
    valid = ~missing if ctx.settings.scoring.on_error == "mask" else torch.ones(len(outcomes), dtype=torch.bool)
    valid &= ~torch.tensor(empty)
    failures = [{"reward": name, "index": n, "status": o.status, "message": o.message,
                 "prompt": examples[n // G].prompt, "completion": transcript(ctx.tokenizer, logs[n])}
                for n, o in enumerate(outcomes) if o.reward is None]
    n = max(len(outcomes), 1)
    segments = [len(log.segments) for log in logs]
    metrics = {"accuracy": float((reward_N.nan_to_num(0.0) > 0.5).float().mean()),
               f"reward/{name}/mean": float(reward_N.nan_to_num(0.0).mean()),
               f"reward/{name}/errors": float(sum(o.status == "error" for o in outcomes)),
               f"reward/{name}/nonfinite": 0.0,
               f"reward/{name}/timeouts": float(sum(o.status == "timeout" for o in outcomes)),
               "reward/invalid_frac": float(missing.float().mean()),
               "agent/no_reward": float(sum(o.status == "no_reward" for o in outcomes)),
               "agent/calls_mean": sum(log.calls for log in logs) / n,
               "agent/turns_mean": sum(len(r.turns) for r in recs) / n,
               "agent/segments_mean": sum(segments) / n,
               "agent/spliced": sum(log.spliced for log in logs) / n,
               "agent/segments_dropped": sum(max(0, k - 1) for k in segments) / n,
               "agent/no_call_frac": sum(k == 0 for k in segments) / n}
    return Batch(
        examples=examples, prompt_ids=rollouts.prompt_ids, rollouts=rollouts, scored_texts=rollouts.texts,
        rewards_PGK=reward_N.nan_to_num(0.0).view(P, G, 1) * ctx.weights_K, valid_PG=valid.view(P, G),
        correct_PG=(reward_N.nan_to_num(0.0) > 0.5).view(P, G), rerolled_P=torch.zeros(P, dtype=torch.bool),
        metrics=metrics, failures=failures, consumed=P, generate_s=seconds, reward_s=0.0,
        gen_tokens=int(rollouts.loss_mask.sum()))
