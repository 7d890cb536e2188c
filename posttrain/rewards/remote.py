"""The ``http`` reward: a reward service over HTTP scores the completions (OpenRLHF's remote reward model,
verl's reward servers).

``[[reward]] name = "http"`` with ``params = {url = "http://127.0.0.1:8000/score"}``. The completions of
a scoring batch go to ``url`` as JSON POSTs of at most ``batch_size`` samples each, at most
``max_concurrency`` requests in flight::

    [{"prompt": "...", "completion": "...", "answer": "...", <the example's other fields>}, ...]

and each answer must be ``{"rewards": [float | null, ...]}``, one entry per sample in order (``null``:
could not score, as a local reward's ``None``). Parameters:

- ``timeout_s`` (30): the longest one attempt may take, to the answer's last byte;
- ``retries`` (2) with ``backoff_s`` (0.5): a refused or reset connection, a timeout, HTTP 408, 429 and
  5xx are tried again after 0.5 s, 1 s, 2 s, ... (:mod:`posttrain.rewards.wire`); other answers are not;
- ``headers_env``: the name of an environment variable holding extra headers (an API key), as JSON
  (``{"Authorization": "Bearer ..."}``) or ``Name: value`` lines; read at start-up and never logged.

A request that fails for good (past its retries: a timeout, a refused connection, 5xx; at once: 4xx,
an answer that is not JSON, not ``{"rewards": [...]}`` or of the wrong length) scores its samples ``None``,
counted in ``reward/http/errors`` or ``reward/http/timeouts`` and written with the reason to
``reward_failures.jsonl``; so is each entry that is neither a number nor null. Other requests of the
batch keep their rewards, and the run goes on. A batch takes at most about
``ceil(requests / max_concurrency) * (retries + 1) * (timeout_s + backoff)``; the start-up line says it.

Runs in the trainer's process (a batched reward, like ``reward_model``): the threads wait on sockets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from posttrain.errors import ConfigError
from posttrain.rewards.pool import Outcome, classify
from posttrain.rewards.registry import register
from posttrain.rewards.wire import (
    MAX_BACKOFF_S,
    Endpoint,
    WireFailure,
    check_keys,
    check_positive,
    check_url,
    fan_out,
    headers_from_env,
    post_json,
)

OBJECTS = ("example", "task")  # fields the trainer adds that are Python objects, not the example's data


@dataclass(frozen=True)
class HttpSettings:
    """The ``http`` reward's parameters, validated (see the module docstring)."""

    url: str
    timeout_s: float = 30.0
    batch_size: int = 64
    max_concurrency: int = 4
    retries: int = 2
    backoff_s: float = 0.5
    headers_env: str | None = None

    def __post_init__(self) -> None:
        check_url("http's params.url", self.url)
        for key, integer, zero in (("timeout_s", False, False), ("batch_size", True, False),
                                   ("max_concurrency", True, False), ("retries", True, True),
                                   ("backoff_s", False, True)):
            check_positive(f"http's params.{key}", getattr(self, key), integer=integer, zero=zero)
        if self.headers_env is not None and (not isinstance(self.headers_env, str) or not self.headers_env):
            raise ConfigError(f"http's params.headers_env = {self.headers_env!r}: expected the name of an "
                              "environment variable")

    @classmethod
    def of(cls, params: Mapping[str, object]) -> HttpSettings:
        """Settings from a ``[[reward]]`` params table: unknown keys and a missing ``url`` are errors."""
        check_keys("http", params, [f.name for f in fields(cls)])
        if "url" not in params:
            raise ConfigError("http's params.url is required: the reward service's URL (http:// or https://)")
        return cls(**params)  # type: ignore[arg-type]

    def endpoint(self) -> Endpoint:
        """Where to POST, with the headers of ``headers_env`` read now."""
        headers = headers_from_env("http's params.headers_env", self.headers_env)
        return Endpoint(self.url, headers, self.timeout_s, self.retries, self.backoff_s)


def read_rewards(answer: object, n: int) -> list[float | Outcome]:
    """The ``n`` rewards of one answer ``{"rewards": [...]}``; a malformed answer fails all ``n`` samples,
    an entry that is neither a number nor null fails its own sample.
    """
    if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
        got = f"an object with keys {sorted(answer)[:8]}" if isinstance(answer, dict) else type(answer).__name__
        return [Outcome(None, "error", f'malformed answer: expected {{"rewards": [...]}}, got {got}')] * n
    rewards = answer["rewards"]
    if len(rewards) != n:
        return [Outcome(None, "error", f"the server returned {len(rewards)} rewards for {n} samples")] * n
    out: list[float | Outcome] = []
    for j, v in enumerate(rewards):
        got = classify(v)
        if got.status == "error":
            got = Outcome(None, "error", f"rewards[{j}] = {v!r:.60} is neither a number nor null")
        out.append(got.value if got.status == "ok" else got)
    return out


def score_remote(s: HttpSettings, prompts: Sequence[str], completions: Sequence[str],
                 columns: Mapping[str, Sequence[object]]) -> list[float | Outcome]:
    """Score every sample through ``s.url``: one request per ``batch_size`` samples, ``max_concurrency`` at once."""
    try:
        ep = s.endpoint()
    except ConfigError as e:  # the variable went away after start-up: every sample fails, the run goes on
        return [Outcome(None, "error", str(e))] * len(completions)
    extra = {k: v for k, v in columns.items() if k not in OBJECTS}
    rows = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        row: dict[str, object] = {"prompt": p, "completion": c}
        row.update((k, v[i]) for k, v in extra.items() if k not in row)
        rows.append(row)
    chunks = [rows[i : i + s.batch_size] for i in range(0, len(rows), s.batch_size)]

    def one(chunk: list[dict[str, object]]) -> list[float | Outcome]:
        try:
            return read_rewards(post_json(ep, chunk), len(chunk))
        except WireFailure as e:
            return [Outcome(None, e.status, e.message)] * len(chunk)
        except Exception as e:  # noqa: BLE001 - e.g. a field json cannot write; never stops the run
            return [Outcome(None, "error", f"{type(e).__name__}: {e}")] * len(chunk)

    return [r for block in fan_out(one, chunks, s.max_concurrency) for r in block]


@register("http")
def http_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    url: str,
    timeout_s: float = 30.0,
    batch_size: int = 64,
    max_concurrency: int = 4,
    retries: int = 2,
    backoff_s: float = 0.5,
    headers_env: str | None = None,
    **fields: Sequence[object],
) -> list[float | Outcome]:
    """A reward service over HTTP scores each completion (OpenRLHF's remote RM, verl's reward servers); batched.

    POSTs ``[{"prompt", "completion", <example fields>}, ...]`` (``batch_size`` a request, at most
    ``max_concurrency`` in flight) to ``url`` and reads ``{"rewards": [float | null, ...]}``. Each attempt is
    limited to ``timeout_s``; refused connections, timeouts and 5xx are retried ``retries`` times after
    ``backoff_s * 2**k`` s; ``headers_env`` names an environment variable of extra headers (JSON or
    ``Name: value`` lines). A failed request scores its samples ``None`` (counted, logged with the reason).
    """
    settings = HttpSettings(url=url, timeout_s=timeout_s, batch_size=batch_size, max_concurrency=max_concurrency,
                            retries=retries, backoff_s=backoff_s, headers_env=headers_env)
    return score_remote(settings, prompts, completions, fields)


def check(params: Mapping[str, object]) -> None:
    """Validate a ``[[reward]]`` params table at config time (nothing is contacted, no variable is read)."""
    HttpSettings.of(params)


def describe(params: Mapping[str, object]) -> str:
    """Check the params and read ``headers_env`` (the trainer calls this at start-up, so a missing variable
    stops the run before training); one log line saying where rewards come from and the worst-case wait.
    """
    s = HttpSettings.of(params)
    headers = s.endpoint().headers
    waits = sum(min(s.backoff_s * 2**k, MAX_BACKOFF_S) for k in range(s.retries))
    per_request = (s.retries + 1) * s.timeout_s + waits
    auth = f", {len(headers)} header(s) from ${s.headers_env}" if s.headers_env else ""
    return (f"reward 'http': POST {s.url}, {s.batch_size} samples a request, {s.max_concurrency} in flight, "
            f"timeout {s.timeout_s:g} s, {s.retries} retries{auth}; a request gives up after at most "
            f"{math.ceil(per_request)} s")


http_reward.batched = True  # type: ignore[attr-defined]
http_reward.describe = describe  # type: ignore[attr-defined]  # printed (and so checked) at start-up
http_reward.check = check  # type: ignore[attr-defined]  # config time: loads nothing, contacts nothing
