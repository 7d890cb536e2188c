"""``llm_judge``'s OpenAI-compatible backend: the judge is a model behind ``/v1/chat/completions`` (vLLM's or
SGLang's server, ``posttrain serve``, a hosted API) instead of a model loaded here.

One request a pair: ``{"model", "messages": [system?, user: the rendered rubric], "max_tokens",
"temperature", "n": samples, "seed"}``, at most ``max_concurrency`` in flight; the judgements are the
``choices[*].message.content``, parsed by the same rules as the local judge's
(:mod:`posttrain.rewards.judge_parse`). Each attempt is limited to ``timeout_s`` (default
:data:`DEFAULT_TIMEOUT_S`), and a refused connection, a timeout, 408, 429 or 5xx is retried ``retries``
times with exponential backoff (:mod:`posttrain.rewards.wire`). A pair whose request fails for good, or
whose answer has no ``choices`` with string contents, scores ``None`` with the reason (counted, logged).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from posttrain.errors import ConfigError
from posttrain.rewards.pool import Outcome
from posttrain.rewards.wire import Endpoint, WireFailure, fan_out, post_json

# params only a judge loaded here takes, and params only a judge behind an API takes
LOCAL_KEYS = ("path", "engine", "engine_params", "device", "dtype", "batch_size")
API_KEYS = ("api_base", "model", "api_key_env", "max_concurrency", "retries", "backoff_s")
DEFAULT_TIMEOUT_S = 60.0


def api_key(name: str | None) -> dict[str, str]:
    """The ``Authorization`` header from environment variable ``name`` (``None``: no header); an unset or
    empty variable is a :class:`ConfigError` that names it (never its value).
    """
    if name is None:
        return {}
    key = os.environ.get(name, "").strip()
    if not key:
        raise ConfigError(f"llm_judge's params.api_key_env = {name!r}: the environment variable {name} is not set "
                          "(or empty); it should hold the API key, sent as 'Authorization: Bearer <key>'")
    return {"Authorization": f"Bearer {key}"}


def endpoint(api_base: str, api_key_env: str | None, timeout_s: float | None, retries: int,
             backoff_s: float) -> Endpoint:
    """The chat-completions endpoint under ``api_base`` (which ends in ``/v1``, as the ``openai`` client's
    ``base_url`` does), with the API key read now.
    """
    url = api_base.rstrip("/") + "/chat/completions"
    limit = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    return Endpoint(url, api_key(api_key_env), limit, retries, backoff_s)


def read_choices(answer: object) -> list[str] | Outcome:
    """The judgements (``choices[*].message.content``) of one chat-completions answer, or a failed outcome."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices:
        got = f"keys {sorted(answer)[:8]}" if isinstance(answer, dict) else type(answer).__name__
        return Outcome(None, "error", f'malformed answer: expected {{"choices": [...]}} with at least one, got {got}')
    texts = []
    for j, choice in enumerate(choices):
        message = choice.get("message") if isinstance(choice, dict) else None
        content = message.get("content", "") if isinstance(message, dict) else None
        if content is None:  # a message with tool calls only: nothing to parse, as an empty judgement
            content = ""
        if not isinstance(content, str):
            return Outcome(None, "error", f"malformed answer: choices[{j}].message.content is not a string")
        texts.append(content)
    return texts


def judge_remote(ep: Endpoint, model: str, messages: Sequence[list[Mapping[str, str]]], *, max_tokens: int,
                 temperature: float, n: int, seed: int, max_concurrency: int) -> list[list[str] | Outcome]:
    """Per conversation in ``messages``: the judge's ``n`` texts, or the :class:`Outcome` of its failure."""

    def one(conversation: list[Mapping[str, str]]) -> list[str] | Outcome:
        body = {"model": model, "messages": conversation, "max_tokens": max_tokens, "temperature": temperature,
                "n": n, "seed": seed}
        try:
            return read_choices(post_json(ep, body))
        except WireFailure as e:
            return Outcome(None, e.status, e.message)
        except Exception as e:  # noqa: BLE001 - nothing the judge server does may stop the run
            return Outcome(None, "error", f"{type(e).__name__}: {e}")

    return fan_out(one, list(messages), max_concurrency)
