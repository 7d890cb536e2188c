"""What the ``agent`` driver (``agent.py``) runs its episodes on: an OpenAI-compatible server over the rollout
engine with one base URL per episode, the record of every call's sampled tokens, and the agents' threads.

**One URL per episode.** The server (``serve/server.py``'s :class:`~posttrain.serve.server.ServeApp`, its routes
and checks) answers under ``/episodes/<id>/v1/...``: ``<id>`` links each call to its episode (a path the episode
does not own is a 404). Every call is sampled with the run's ``rollout.temperature`` and ``rollout.top_p``
(what the learner's log-probs assume), whatever the request says, and ``max_tokens`` is capped at
``rollout.max_new_tokens``.

**Segments.** Each answered call is recorded from the server's ``record`` hook: its prompt ids and each choice's
sampled ids and log-probs, as sampled (never re-tokenized). A call extends the episode's segment whose ids
(first prompt, then every context and sampled token so far) are a prefix of the call's prompt: the prompt's new
tokens become that turn's context (attended, not trained), its sampled tokens the turn's action. A call whose
prompt extends no segment (the agent rewrote or trimmed the history, or the template renders an earlier answer
differently: a reasoning model's dropped thoughts, a tool call re-serialized) starts a new segment. Choices after
the first of a call (``n`` > 1) each branch into a segment of their own. Concurrent calls of one episode each
extend what they find, so a call that does not see a sibling's answer starts a segment too.

**Sampled tokens given back.** A chat client sends an earlier answer back as text, which the chat template
encodes again; the sampled ids need not come back (a character-level model that sampled a special token, a
non-canonical BPE split). Before a call is sampled, a prompt that starts with a segment's history *as it
re-encodes* (each answer's text encoded again, its EOS kept when sampled) gets that history's sampled ids in its
place (:meth:`EpisodeLog.splice`, counted in ``agent/spliced``): the policy then reads, and the learner
trains, exactly the tokens that were sampled, and the segment goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.multiturn import Turn
from posttrain.serve.protocol import APIError, GenRequest, Limits, Sample
from posttrain.serve.server import Handler, ServeApp, ServeSettings
from posttrain.tasks.base import Example

EPISODE_PATH = re.compile(r"^/episodes/([A-Za-z0-9_-]+)(/.*)$")
_LOCAL = threading.local()  # the episode of the request this HTTP thread is answering


@dataclass
class Segment:
    """A run of calls each extending the last: the first call's prompt, one :class:`Turn` per call, and what each
    turn's action reads as once a client renders it back (``renders``: the answer's text re-encoded, EOS kept).
    """

    prompt: list[int]
    turns: list[Turn] = field(default_factory=list)
    renders: list[list[int]] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """Every token so far: the prompt, then each turn's context and action."""
        return self.prompt + [t for turn in self.turns for t in (*turn.context_ids, *turn.action_ids)]

    @property
    def rendered(self) -> list[int]:
        """:attr:`ids` with each action as a client's history renders it back (its text, re-encoded)."""
        return self.prompt + [t for turn, r in zip(self.turns, self.renders, strict=True)
                              for t in (*turn.context_ids, *r)]


@dataclass
class EpisodeLog:
    """One episode's calls, as segments; ``last`` is the one the latest call extended or started."""

    segments: list[Segment] = field(default_factory=list)
    last: int = -1
    calls: int = 0
    spliced: int = 0  # calls whose prompt held an earlier answer re-encoded, given its sampled tokens back
    closed: bool = False  # the driver has taken the episode: a late call (a hung agent's) is not recorded

    def splice(self, prompt: list[int]) -> list[int]:
        """``prompt`` with the longest segment's re-encoded history (:attr:`Segment.rendered`) that starts it
        replaced by the tokens that were sampled (:attr:`Segment.ids`); unchanged when none starts it or one
        already extends exactly.
        """
        best, size = None, -1
        for seg in self.segments:
            ids, rendered = seg.ids, seg.rendered
            if len(ids) > size and prompt[:len(ids)] == ids:
                best, size = None, len(ids)  # an exact extension: nothing to splice
            if ids != rendered and len(rendered) > size and prompt[:len(rendered)] == rendered:
                best, size = seg, len(rendered)
        if best is None:
            return prompt
        self.spliced += 1
        return best.ids + prompt[size:]

    def add(self, prompt: list[int], samples: list[Sample], renders: list[list[int]]) -> None:
        """Record one prompt of a call, its ``n`` samples and their renders (module docstring: which segment
        each extends).
        """
        base = self._extended_by(prompt)
        context = prompt[len(base.ids):] if base is not None else []
        for j, (s, r) in enumerate(zip(samples, renders, strict=True)):
            turn = Turn(list(context), list(s.token_ids), list(s.logprobs), None)
            if base is not None and j == 0:
                base.turns.append(turn)
                base.renders.append(r)
                self.last = next(i for i, seg in enumerate(self.segments) if seg is base)
                continue
            if base is not None:  # another choice of the same call: a branch of the same history
                seg = Segment(list(base.prompt), [*base.turns[:-1], turn], [*base.renders[:-1], r])
            else:
                seg = Segment(list(prompt), [turn], [r])
                base = seg  # further choices of a fresh call branch from it
            self.segments.append(seg)
            self.last = len(self.segments) - 1

    def _extended_by(self, prompt: list[int]) -> Segment | None:
        """The longest segment whose ids are a prefix of ``prompt`` (``None``: the call starts a new one)."""
        best = None
        for seg in self.segments:
            ids = seg.ids
            if len(ids) <= len(prompt) and prompt[:len(ids)] == ids and (best is None or len(ids) > len(best.ids)):
                best = seg
        return best

    @property
    def kept(self) -> Segment | None:
        """The segment the episode trains on: the one its last call extended or started."""
        return self.segments[self.last] if self.segments else None


class EpisodeApp(ServeApp):
    """A :class:`ServeApp` that samples with the run's settings and records each call into its episode's log."""

    def __init__(self, engine: RolloutEngine, tokenizer: object, sampling: SamplingParams, *, seed: int,
                 tool_parser: str | None, max_rows: int) -> None:
        settings = ServeSettings(model_name="policy", limits=Limits(max_tokens=1 << 20, max_n=64),
                                 accept_any_model=True, tool_parser=tool_parser, seed=seed,
                                 max_batch_rows=max(64, max_rows))
        super().__init__(engine, tokenizer, settings, record=self._record)
        self.sampling = sampling
        self.episodes: dict[str, EpisodeLog] = {}
        self.lock = threading.Lock()

    def generate(self, req: GenRequest) -> list[Sample]:
        """The request with the run's temperature and top-p and its ``max_tokens`` capped, sampled."""
        cap = self.sampling.max_new_tokens
        req.temperature, req.top_p = self.sampling.temperature, self.sampling.top_p
        req.max_tokens = min(req.max_tokens or cap, cap)
        ep = self.episodes.get(getattr(_LOCAL, "episode", None) or "")
        if ep is not None:
            with self.lock:
                req.prompts = [ep.splice(list(p)) for p in req.prompts]
        return super().generate(req)

    def _render(self, s: Sample) -> list[int]:
        """The answer as a client sends it back: its text (special tokens skipped) encoded again, EOS kept."""
        tok = self.tokenizer
        text = tok.decode(s.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        ids = list(tok(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
        eos = getattr(tok, "eos_token_id", None)
        return ids + [eos] if s.token_ids and s.token_ids[-1] == eos else ids

    def _record(self, req: GenRequest, samples: list[Sample]) -> None:
        ep = self.episodes.get(getattr(_LOCAL, "episode", None) or "")
        if ep is None:
            return
        with self.lock:
            if ep.closed:
                return
            ep.calls += 1
            for i, prompt in enumerate(req.prompts):  # a completion call may send several prompts, n samples each
                mine = samples[i * req.n:(i + 1) * req.n]
                ep.add(list(prompt), mine, [self._render(s) for s in mine])


class EpisodeHandler(Handler):
    """``/episodes/<id>/v1/...``: the id names the episode, the rest is the ordinary route."""

    def _handle(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        m = EPISODE_PATH.match(path)
        if path.rstrip("/") == "/health":
            super()._handle(method)
            return
        if m is None or m.group(1) not in self.server.app.episodes:  # type: ignore[attr-defined]
            err = APIError(404, f"{path} is not an episode's route here: use the base URL the agent was given "
                           "(http://HOST:PORT/episodes/<id>/v1)", None, "not_found")
            self._send(err.status, err.body(), close=method == "POST")  # an unread body: close after the answer
            return
        _LOCAL.episode, self.path = m.group(1), m.group(2)
        try:
            super()._handle(method)
        finally:
            _LOCAL.episode = None


class EpisodeServer(ThreadingHTTPServer):
    """The loopback HTTP server of one generation batch's episodes."""

    daemon_threads = True
    request_queue_size = 256

    def __init__(self, app: EpisodeApp) -> None:
        self.app = app
        super().__init__(("127.0.0.1", 0), EpisodeHandler)

    def start(self) -> None:
        """Serve in a daemon thread; stop with ``shutdown()``, ``server_close()`` and the app's ``close()``."""
        threading.Thread(target=self.serve_forever, name="posttrain-agent-serve", daemon=True).start()

    def url(self, episode: str) -> str:
        """The base URL of ``episode`` (what an OpenAI client takes as ``base_url``)."""
        return f"http://127.0.0.1:{self.server_address[1]}/episodes/{episode}/v1"


@dataclass
class Outcome:
    """What an agent's episode came to: ``status`` is ok, no_reward (returned None), error or timeout."""

    status: str
    reward: float | None
    message: str = ""


def run_agents(fn: Callable, urls: list[str], examples: list[Example], timeout_s: float) -> list[Outcome]:
    """``fn(url, example)`` for every episode, each in a daemon thread (a coroutine function in its own event
    loop), all under one deadline of ``timeout_s``: an agent still running then is abandoned (never waited
    for) and scores None, as one that raises or returns None or a non-finite number does.
    """
    out: list[Outcome | None] = [None] * len(urls)

    def one(k: int) -> None:
        try:
            got = fn(urls[k], examples[k])
            if inspect.isawaitable(got):
                got = asyncio.run(_awaited(got))
            if got is None:
                out[k] = Outcome("no_reward", None, "the agent returned None")
            elif not math.isfinite(value := float(got)):
                out[k] = Outcome("error", None, f"the agent returned {got!r}, not a finite number")
            else:
                out[k] = Outcome("ok", value)
        except Exception as e:  # noqa: BLE001 - an agent's bug scores its episode None; the run goes on
            out[k] = Outcome("error", None, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(k,), name=f"posttrain-agent-{k}", daemon=True)
               for k in range(len(urls))]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [o if o is not None and not t.is_alive() else Outcome("timeout", None, f"no reward within {timeout_s} s")
            for o, t in zip(out, threads, strict=True)]


async def _awaited(awaitable: object) -> object:
    return await awaitable  # type: ignore[misc]


__all__ = ["EpisodeApp", "EpisodeLog", "EpisodeServer", "Outcome", "Segment", "run_agents"]
