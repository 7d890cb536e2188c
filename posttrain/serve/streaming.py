"""``"stream": true``: an answer sent as OpenAI's server-sent events, ``data: {chunk}`` lines and ``data: [DONE]``.

The engine samples a completion whole (``RolloutEngine.generate`` has no per-token hook, and a batch of
requests is one call), so there is nothing to send before sampling ends: a streamed request is sampled,
checked and recorded exactly as a plain one, and its finished answer is then cut into the chunks an OpenAI
client reads. Per choice, in order: one chunk with the whole delta (chat: ``role``, ``content`` and any
``tool_calls``; completions: ``text``) with its ``logprobs`` and ``token_ids``, then one with the
``finish_reason`` and an empty delta; with ``stream_options = {"include_usage": true}`` a last chunk with no
choices carries ``usage``; then ``data: [DONE]``. The chunks keep the answer's id, ``created`` and model, and
chat's first chunk its ``prompt_token_ids``, so a trainer gets the same exact tokens either way. The body is
sent with a ``Content-Length`` (the connection stays open for the next request).

Streaming thus saves a client nothing in latency (the first chunk comes when the last token is sampled); it
exists so that clients that always stream (agent frameworks, chat UIs) work unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from posttrain.serve.protocol import APIError

CHUNK_OBJECT = {"chat.completion": "chat.completion.chunk", "text_completion": "text_completion"}


def stream_flags(body: Mapping) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a request, checked: ``stream`` a boolean, ``stream_options`` an object
    whose ``include_usage`` is a boolean (read only when streaming, as OpenAI's clients send it only then).
    """
    stream = body.get("stream")
    if stream is None:
        return False, False
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be a boolean; got {json.dumps(stream)[:60]} ({type(stream).__name__})",
                       "stream", "invalid_value")
    opts = body.get("stream_options")
    if not stream or opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise APIError(400, f"'stream_options' must be an object such as {{\"include_usage\": true}}; got "
                       f"{json.dumps(opts)[:60]}", "stream_options", "invalid_value")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(400, f"'stream_options.include_usage' must be a boolean; got {json.dumps(usage)[:40]}",
                       "stream_options", "invalid_value")
    return True, usage


def _chat_delta(choice: Mapping) -> dict:
    message = choice["message"]
    delta: dict = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):  # a streamed call carries its position among the turn's calls
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    return delta


def chunks(answer: Mapping, include_usage: bool = False) -> list[dict]:
    """The stream chunks of a finished ``chat.completion`` or ``text_completion`` answer (module docstring)."""
    obj = answer["object"]
    if obj not in CHUNK_OBJECT:
        raise ValueError(f"cannot stream an answer of object {obj!r}; expected one of {sorted(CHUNK_OBJECT)}")
    chat = obj == "chat.completion"
    head = {"id": answer["id"], "object": CHUNK_OBJECT[obj], "created": answer["created"], "model": answer["model"]}
    if include_usage:
        head["usage"] = None  # OpenAI's chunks say null until the last one
    out: list[dict] = []
    for choice in answer["choices"]:
        i = choice["index"]
        if chat:
            first = {"index": i, "delta": _chat_delta(choice), "logprobs": choice.get("logprobs"),
                     "finish_reason": None, "token_ids": choice["token_ids"]}
            last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            first = {"index": i, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None,
                     "token_ids": choice["token_ids"], "prompt_token_ids": choice["prompt_token_ids"]}
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        out.append({**head, "choices": [first]})
        out.append({**head, "choices": [last]})
    if chat and out and "prompt_token_ids" in answer:
        out[0]["prompt_token_ids"] = answer["prompt_token_ids"]
    if include_usage:
        out.append({**head, "choices": [], "usage": answer["usage"]})
    return out


def sse(events: list[dict]) -> bytes:
    """The ``text/event-stream`` body of ``events``: one ``data: {json}`` event each, then ``data: [DONE]``."""
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


__all__ = ["chunks", "sse", "stream_flags"]
