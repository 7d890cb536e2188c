r"""Tool-call parsers for the main model families, a registry chosen by name, and how results go back.

Every parser reads the decoded text of one policy turn and returns :class:`Parsed`: the calls in the
order written (each a name and its arguments as written, or why it could not be read) and the text
outside them. Parsers never raise and never check names or arguments: the environment does that
against its tools' schemas (``tool_schema.validate_arguments``), so every malformed call becomes an
``error: ...`` tool result, not a crash.

========================  ====================================================================
``hermes``                Hermes / Qwen 2.5-3 / NousResearch: ``<tool_call>{"name": "add", "arguments":
                          {"a": 1, "b": 2}}</tool_call>``, any number in a turn; a last block left unclosed
                          (the turn ended) runs to the end of the text (vLLM's ``hermes`` parser).
``llama3_json``           Llama 3.1-3.3 JSON tool calling: the turn is ``{"name": "add", "parameters":
                          {...}}``, optionally after ``<|python_tag|>``; several objects separated by
                          ``;`` (Llama 3.2). A turn that does not start with ``{`` is an answer.
``mistral``               Mistral: ``[TOOL_CALLS][{"name": "add", "arguments": {...}}, ...]``, and the
                          v11+ tokenizer form ``[TOOL_CALLS]add[ARGS]{...}``.
``compact``               posttrain's own ``=expr``: the ``calculator`` tool with ``expression`` (one call).
``any``                   sniffs the family from the text's own markers (the first of the above to match).
========================  ====================================================================

``arguments`` may also be spelled ``parameters`` and may be a JSON string holding the object (the
OpenAI wire format), in every JSON family.

The rollout driver decodes a turn with special tokens skipped, so where ``<|python_tag|>`` or
``[TOOL_CALLS]`` is a special token of the real tokenizer (Llama 3.1, Mistral v3+) it is gone from the
text the parser sees: ``llama3_json`` and ``mistral`` read the bare form (``{...}``, ``[{...}]``) too.
Qwen's ``<tool_call>`` is an added, non-special token and survives decoding.

:func:`parser_for_template` picks a parser from a chat template's text (``<tool_call>`` -> ``hermes``,
``[TOOL_CALLS]`` -> ``mistral``, ``<|python_tag|>`` or ``ipython`` -> ``llama3_json``).

Results go back as one ``tool`` message per call (``name``, a 9-character ``tool_call_id`` as Mistral's
templates demand, ``content``), which the chat template renders in its own tool format (Qwen's
``<tool_response>`` blocks, Llama's ``ipython`` turn, Mistral's ``[TOOL_RESULTS]``); a template that has
no tool role (:func:`supports_tool_role` is false: it raises on one, or drops its text) gets the
results as one ``user`` message of ``<tool_response>`` blocks instead (:func:`result_messages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from posttrain.algorithms.registry import Registry

ResultRole = Literal["tool", "text"]


@dataclass(frozen=True)
class Call:
    """One call as written: ``name`` and ``arguments`` (unchecked), or ``error`` when it could not be read."""

    name: str | None
    arguments: object = None
    error: str | None = None  # "error: ..." for a call that is not readable JSON with a string name


@dataclass(frozen=True)
class Parsed:
    """The calls of one turn, in order, and the text outside them (the answer when there is no call)."""

    calls: tuple[Call, ...] = ()
    content: str = ""


Parser = Callable[[str], Parsed]
PARSERS: Registry[Parser] = Registry("tool-call parser")
register_parser = PARSERS.register

NOT_JSON = "error: the call is not valid JSON"
NOT_A_CALL = 'error: a call must be a JSON object with a string "name"'
ARGS_NOT_JSON = "error: the call's arguments string is not valid JSON"


def call_from_json(obj: object) -> Call:
    """A :class:`Call` from a decoded call object: ``name`` and ``arguments`` (or ``parameters``; a JSON
    string holding the object is decoded). Anything else is a :class:`Call` with an ``error``.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, None, NOT_A_CALL)
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}: OpenAI's nesting
        return call_from_json(obj["function"])
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return Call(obj["name"], None, ARGS_NOT_JSON)
    return Call(obj["name"], arguments)


def _loads(text: str) -> Call:
    try:
        return call_from_json(json.loads(text))
    except (ValueError, RecursionError):
        return Call(None, None, NOT_JSON)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> Parsed:
    """Every ``<tool_call>{json}</tool_call>`` block, in order (Hermes, Qwen)."""
    calls = tuple(_loads(m.group(1).strip()) for m in _HERMES.finditer(text))
    return Parsed(calls, _HERMES.sub("", text).strip())


def _json_sequence(text: str, separators: str) -> tuple[list[object], str, bool]:
    """JSON values at the start of ``text``, separated by ``separators``: ``(values, rest, ok)``; ``ok`` is
    false when a value does not decode.
    """
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (values and text[i] in separators)):
            i += 1
        if i >= len(text) or text[i] not in "{[":
            return values, text[i:], True
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return values, text[i:], False
        values.append(value)


@register_parser("llama3_json")
def parse_llama3_json(text: str) -> Parsed:
    """A turn that is ``{"name": ..., "parameters": {...}}`` (``;`` between several), ``<|python_tag|>`` optional."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return Parsed((Call(None, None, NOT_JSON),), body) if tagged else Parsed((), body)
    values, rest, ok = _json_sequence(body, ";")
    calls = [call_from_json(v) for v in values]
    if not ok:
        calls.append(Call(None, None, NOT_JSON))
    return Parsed(tuple(calls), rest.strip() if ok else "")


_MISTRAL_V11 = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?\s*")


@register_parser("mistral")
def parse_mistral(text: str) -> Parsed:
    """``[TOOL_CALLS][{...}, ...]`` (or a turn that starts ``[{`` once the special token is decoded away),
    and ``[TOOL_CALLS]name[ARGS]{...}`` repeated.
    """
    marker = "[TOOL_CALLS]"
    if marker in text:
        head, _, body = text.partition(marker)
    elif re.match(r"\s*\[\s*\{", text):
        head, body = "", text.lstrip()
    else:
        return Parsed((), text.strip())
    calls: list[Call] = []
    for segment in body.split(marker):
        seg = segment.strip()
        if seg.startswith("["):
            values, _, ok = _json_sequence(seg, ",")
            items = values[0] if values and isinstance(values[0], list) else values
            calls += [call_from_json(v) for v in items] if ok and values else [Call(None, None, NOT_JSON)]
            continue
        named = _MISTRAL_V11.match(seg)
        if named is None or not named.group(1):
            calls.append(Call(None, None, NOT_JSON))
            continue
        values, _, ok = _json_sequence(seg[named.end():], "")
        calls.append(call_from_json({"name": named.group(1), "arguments": values[0]}) if ok and values
                     else Call(named.group(1), None, NOT_JSON))
    return Parsed(tuple(calls), head.strip())


@register_parser("compact")
def parse_compact(text: str) -> Parsed:
    """``=expr``: one call of ``calculator`` with ``expression`` (``envs/tools.py``'s compact form)."""
    body = text.strip()
    if not body.startswith("="):
        return Parsed((), body)
    expression = body[1:].strip()
    return Parsed((Call("calculator", {"expression": expression} if expression else {}),))


@register_parser("any")
def parse_any(text: str) -> Parsed:
    """The family whose marker the text carries: ``<tool_call>``, ``[TOOL_CALLS]`` / ``[{``,
    ``<|python_tag|>`` / ``{``, ``=``; else no call.
    """
    body = text.strip()
    if "<tool_call>" in body:
        return parse_hermes(text)
    if "[TOOL_CALLS]" in body or re.match(r"\[\s*\{", body):
        return parse_mistral(text)
    if body.startswith(("<|python_tag|>", "{")):
        return parse_llama3_json(text)
    return parse_compact(text)


def parse_calls(parser: str, text: str) -> Parsed:
    """``text`` through parser ``parser``; a parser bug becomes one unreadable call, never an exception."""
    try:
        return PARSERS.get(parser)(text)
    except Exception as e:  # noqa: BLE001 - defensive: a parser must not end the episode
        return Parsed((Call(None, None, f"error: the call could not be parsed ({type(e).__name__})"),))


def format_calls(parser: str, calls: Sequence[tuple[str, Mapping[str, object]]]) -> str:
    """The text a model of family ``parser`` writes for ``calls`` (for expert demonstrations and docs)."""
    if parser in ("hermes", "any"):
        return "\n".join(f"<tool_call>{json.dumps({'name': n, 'arguments': dict(a)})}</tool_call>" for n, a in calls)
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": dict(a)}) for n, a in calls)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": dict(a)} for n, a in calls])
    if parser == "compact":
        if len(calls) != 1 or calls[0][0] != "calculator":
            raise ValueError("the compact form writes one calculator call a turn")
        return f"={calls[0][1].get('expression', '')}"
    raise ValueError(f"no call format for parser {parser!r}; choices: {', '.join(PARSERS.names())}")


TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)


def parser_for_template(template: object) -> str | None:
    """The parser of a chat template (its text; a dict or list of named templates is searched whole), by
    :data:`TEMPLATE_MARKERS` in that order; ``None`` when it shows no tool-call format.
    """
    text = template if isinstance(template, str) else json.dumps(template, default=str)
    return next((name for marker, name in TEMPLATE_MARKERS if marker in text), None)


def parser_for_tokenizer(tokenizer: object, default: str = "hermes") -> str:
    """:func:`parser_for_template` of the tokenizer's ``chat_template``, ``default`` when it shows none."""
    return parser_for_template(getattr(tokenizer, "chat_template", None) or "") or default


def call_id(turn: int, index: int) -> str:
    """A call's id: 9 letters and digits (Mistral's templates refuse any other), unique in an episode."""
    return f"t{turn % 100:02d}c{index % 100000:05d}"


def result_messages(results: Sequence[tuple[str, str]], role: ResultRole, turn: int = 0) -> list[dict[str, str]]:
    """``(tool name, result text)`` of one turn's calls as messages: one ``tool`` message each (``name``,
    ``tool_call_id``, ``content``), or for ``text`` one ``user`` message of ``<tool_response>`` blocks.
    """
    if role == "tool":
        return [{"role": "tool", "name": name, "tool_call_id": call_id(turn, i), "content": text}
                for i, (name, text) in enumerate(results)]
    blocks = [f"<tool_response>{json.dumps({'name': n, 'content': t}, ensure_ascii=False)}</tool_response>"
              for n, t in results]
    return [{"role": "user", "content": "\n".join(blocks)}]


_PROBE = "posttrain-tool-probe-7f3a"


def supports_tool_role(tokenizer: object) -> bool:
    """Whether the tokenizer's chat template renders a ``tool`` message (with ``name`` and ``tool_call_id``)
    after an assistant turn and keeps its text; a template that raises on it or drops it has none.
    """
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                {"role": "tool", "name": "probe", "tool_call_id": call_id(0, 0), "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - jinja's raise_exception, a missing template: no tool role
        return False
    return isinstance(text, str) and _PROBE in text
