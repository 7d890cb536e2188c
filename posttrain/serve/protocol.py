"""The OpenAI wire format of ``posttrain serve``: requests read and checked into :class:`GenRequest`, and
the ``chat.completion`` / ``text_completion`` answers built from what the engine sampled.

A request is checked field by field before anything reaches the engine: a wrong type, a value out of
range or a feature the engine cannot honour (top-k alternatives, penalties, ``logit_bias``) is an
:class:`APIError` (HTTP 4xx, OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body) that
names the field, what was expected and what came. Fields this server does not know are ignored, as
OpenAI-compatible servers do (clients send new ones all the time). ``stream`` and ``stream_options`` are
read by the HTTP side (``streaming.py``): they change how an answer is sent, not what is sampled.

Every choice carries the exact sampled token ids (``token_ids``, EOS included when sampled) and the
request its ``prompt_token_ids``: what a trainer needs, never re-tokenized text. Log-probs
(``logprobs.content[].logprob`` for chat, ``logprobs.token_logprobs`` for completions) are the sampler's
own, ``log_softmax(logits / temperature)`` before top-p truncation (``rollout/sampling.py``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from posttrain.envs.tool_parsers import parse_calls
from posttrain.models.chat import ChatRenderError, encode_example
from posttrain.tasks.base import Example

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED_IF_SET = {  # field -> the value that means "not used" (anything else is refused)
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "echo": False,
    "suffix": None, "top_logprobs": 0, "best_of": None, "response_format": None,
}


class APIError(Exception):
    """A request the server answers with an HTTP error and OpenAI's error body (never a crash)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: ``max_tokens`` (the completion's length), ``n`` and stop strings."""

    max_tokens: int = 1024
    max_n: int = 16
    max_stop: int = 4


@dataclass
class GenRequest:
    """One checked request: its prompts' token ids and how to sample them."""

    kind: str  # "chat" | "completion"
    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: list[str]
    logprobs: bool
    tools: list[dict] | None = None
    parse_tools: bool = True  # False with tool_choice = "none": the tools are shown, the text is not read for calls
    model: str = ""
    extra: dict = field(default_factory=dict)


def _bad(name: str, want: str, got: object) -> APIError:
    shown = json.dumps(got)[:80] if not isinstance(got, str) else repr(got[:80])
    return APIError(400, f"{name!r} must be {want}; got {shown} ({type(got).__name__})", name, "invalid_value")


def _number(body: Mapping, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(name, "a number", v)
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(name, f"in {'(' if lo_open else '['}{lo}, {hi}]", v)
    return float(v)


def _int(body: Mapping, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, "an integer", v)
    if not lo <= v <= hi:
        raise APIError(400, f"{name!r} must be in [{lo}, {hi}]; got {v}", name, "invalid_value")
    return v


def _refuse_unsupported(body: Mapping) -> None:
    for name, unused in UNSUPPORTED_IF_SET.items():
        v = body.get(name)
        if v is None or v == unused or v in ({}, [], "") or (name == "response_format" and v == {"type": "text"}):
            continue
        raise APIError(400, f"{name!r} = {json.dumps(v)[:60]} is not supported by posttrain serve",
                       name, "unsupported_parameter")


def _stop(body: Mapping, limits: Limits) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "a non-empty string or a list of them", v)
    if len(stops) > limits.max_stop:
        raise APIError(400, f"'stop' holds {len(stops)} strings; at most {limits.max_stop}", "stop", "invalid_value")
    return stops


def sampling_fields(body: Mapping, limits: Limits) -> dict:
    """The sampling fields common to both endpoints, checked (``max_completion_tokens`` is chat's new name)."""
    _refuse_unsupported(body)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise _bad("model", "a string", model)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = body.get(name)
    if v is not None and not isinstance(v, bool) and isinstance(v, int) and v > limits.max_tokens:
        raise APIError(400, f"{name!r} = {v} is over this server's limit of {limits.max_tokens} "
                       "(posttrain serve --max-tokens)", name, "max_tokens_exceeded")
    return {
        "model": model,
        "max_tokens": _int(body, name, 1, limits.max_tokens) or 0,  # 0: as many as the context leaves
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "n": _int(body, "n", 1, limits.max_n) or 1,
        "seed": _int(body, "seed", -(2**63), 2**63 - 1),
        "stop": _stop(body, limits),
    }


def _content(m: Mapping, i: int) -> str:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise _bad(f"messages[{i}].content", "a string, null or a list of {'type': 'text', 'text': ...} parts", c)


def _tool_calls(m: Mapping, i: int) -> list[dict]:
    """An assistant turn's ``tool_calls`` as chat templates read them: ``arguments`` as a dict, not JSON text."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls", "a list", calls)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"messages[{i}].tool_calls[{j}]", "{'type': 'function', 'function': {'name', 'arguments'}}", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments", "JSON text", args) from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(body: Mapping) -> list[dict]:
    """The request's ``messages`` as the chat template gets them (``developer`` read as ``system``)."""
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required: a non-empty list of {'role', 'content'} objects",
                       "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of {'role', 'content'} objects", msgs)
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"an object whose 'role' is one of {list(ROLES)}", m)
        turn = {"role": "system" if m["role"] == "developer" else m["role"], "content": _content(m, i)}
        if m.get("tool_calls") is not None:
            turn["tool_calls"] = _tool_calls(m, i)
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                turn[key] = m[key]
        turns.append(turn)
    return turns


def _tools(body: Mapping) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise _bad("tools", "a list of {'type': 'function', 'function': {'name', 'parameters'}} objects", tools)
    return tools or None


def parse_chat(body: Mapping, tokenizer: object, limits: Limits) -> GenRequest:
    """A ``/v1/chat/completions`` body checked and rendered through the tokenizer's chat template."""
    turns, tools = chat_messages(body), _tools(body)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object", kwargs)
    fields = sampling_fields(body, limits)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "a boolean", logprobs)
    last_user = next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")
    example = Example(prompt=last_user, answer="", demonstration="", messages=turns, tools=tools,
                      chat_template_kwargs=kwargs or None)
    try:
        ids = encode_example(tokenizer, example)
    except ChatRenderError as e:
        raise APIError(400, str(e), "messages", "chat_template_error") from None
    return GenRequest("chat", [ids], logprobs=bool(logprobs), tools=tools,
                      parse_tools=body.get("tool_choice") != "none", **fields)


def _completion_prompts(body: Mapping, tokenizer: object, vocab: int) -> list[list[int]]:
    p = body.get("prompt")
    if p is None:
        raise APIError(400, "'prompt' is required: a string, a list of strings, or token ids", "prompt",
                       "missing_required_parameter")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise _bad("prompt", "a string, a non-empty list of strings or of token-id lists", p)
    out = []
    for i, one in enumerate(p):
        if isinstance(one, str):
            ids = list(tokenizer(one, add_special_tokens=True)["input_ids"])  # type: ignore[operator]
        elif isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in one):
            ids = list(one)
        else:
            raise _bad(f"prompt[{i}]", f"a string or a non-empty list of token ids in [0, {vocab})", one)
        if not ids:
            raise APIError(400, f"prompt[{i}] is empty after tokenization", "prompt", "invalid_value")
        out.append(ids)
    return out


def parse_completion(body: Mapping, tokenizer: object, limits: Limits) -> GenRequest:
    """A ``/v1/completions`` body checked; ``logprobs`` may be 0 (the sampled tokens' log-probs) or null."""
    prompts = _completion_prompts(body, tokenizer, len(tokenizer))  # type: ignore[arg-type]
    fields = sampling_fields(body, limits)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs != 0):
        raise APIError(400, f"'logprobs' = {json.dumps(logprobs)[:40]}: posttrain serve returns the sampled tokens' "
                       "log-probs only (logprobs = 0), no top alternatives", "logprobs", "unsupported_parameter")
    return GenRequest("completion", prompts, logprobs=logprobs is not None, **fields)


@dataclass(frozen=True)
class Sample:
    """One sampled completion as the engine gave it: token ids (EOS included when drawn), their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS


def cut_at_stop(tokenizer: object, sample: Sample, stops: Sequence[str]) -> tuple[str, Sample, bool]:
    """The completion's text ending before its first stop string, the tokens that produced it (those up to
    and including the one that completed the stop string, by bisection on decoded prefixes), and whether
    a stop string was met. Without one: the whole decoded text (special tokens skipped).
    """
    def text(k: int) -> str:
        return tokenizer.decode(sample.token_ids[:k], skip_special_tokens=True)  # type: ignore[attr-defined]

    full = text(len(sample.token_ids))
    hits = [(full.find(s), s) for s in stops if s in full]
    if not hits:
        return full, sample, False
    pos, _ = min(hits)
    lo, hi = 1, len(sample.token_ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text(mid) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return full[:pos], Sample(sample.token_ids[:lo], sample.logprobs[:lo], True), True


def tool_message(text: str, parser: str) -> tuple[str | None, list[dict] | None]:
    """``(content, tool_calls)`` of a completion when the request had tools: the calls ``parse_calls`` reads,
    in OpenAI's shape. A turn with a call that cannot be read keeps its whole text as content, no calls.
    """
    parsed = parse_calls(parser, text)
    if not parsed.calls or any(c.error or c.name is None for c in parsed.calls):
        return text, None
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments if c.arguments is not None else {})}}
             for c in parsed.calls]
    return (parsed.content.strip() or None), calls


__all__ = ["APIError", "GenRequest", "Limits", "Sample", "cut_at_stop", "parse_chat", "parse_completion",
           "tool_message"]
