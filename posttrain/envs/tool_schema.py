r"""Tools declared as JSON schemas and bound to Python functions, the way chat models are offered them.

A :class:`Tool` is a name, a description, an OpenAI-style ``parameters`` JSON schema and the function
that runs it; :func:`tool` builds one from a typed Python function (its signature, type annotations and
docstring), as ``transformers.utils.get_json_schema`` and the OpenAI Agents SDK's ``function_tool`` do::

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    add.schema() == {"type": "function", "function": {"name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}

A Google-style ``Args:`` section in the docstring (``a: the first addend``) gives each property its
``description``; the text before it is the tool's.

Types: ``int`` -> ``integer``, ``float`` -> ``number``, ``str`` -> ``string``, ``bool`` -> ``boolean``,
``list[X]`` -> ``array`` of X, ``dict`` -> ``object``, ``Literal[...]`` -> ``enum``, ``X | None`` -> X that
may be ``null``. A parameter without a default is ``required``; unknown keys are refused
(``additionalProperties: false``). A function that cannot be described (``*args``, an unannotated or
unsupported parameter) is refused when the tool is made, naming the parameter.

:func:`validate_arguments` checks the arguments a policy wrote against the schema (an object; required
keys present; no unknown key; each value of its type, ``bool`` is not an integer, an integral float is)
and returns an error message or ``None``; it never raises. :meth:`Tool.run` runs the function under a
deadline and returns ``(text, status)`` with status ``ok``, ``error`` (the function raised: its exception
type and message; or it returned a string starting ``error:``, the convention of ``envs/tools.py``'s
calculator) or ``timeout``, never raising either. A Python function cannot be killed: a hung one is
abandoned in its daemon thread (as the multi-turn driver abandons a hung environment), so a tool that
can burn CPU without end (code execution) belongs in :mod:`posttrain.sandbox` (see
``envs/tools.py``'s ``python_tool``), not here.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

RunStatus = Literal["ok", "error", "timeout"]
JSONSchema = dict[str, object]

MAX_RESULT_CHARS = 1000
_PRIMITIVES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTIONS = ("args", "arguments", "parameters", "returns", "raises", "yields", "examples", "example", "note")
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


@dataclass(frozen=True)
class Tool:
    """A tool a policy may call: its schema, and the function behind it (keyword arguments, JSON values)."""

    name: str
    description: str
    parameters: JSONSchema  # a JSON schema of type "object"
    fn: Callable[..., object] = field(repr=False)
    timeout_s: float = 2.0  # a call past it is answered "error: timeout"
    max_chars: int = MAX_RESULT_CHARS  # the result text is cut there

    def schema(self) -> dict[str, object]:
        """The OpenAI / Hugging Face ``tools=`` entry: ``{"type": "function", "function": {...}}``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def validate(self, arguments: object) -> str | None:
        """An error message for arguments that do not fit the schema, or ``None`` (never raises)."""
        return validate_arguments(self.parameters, arguments, tool=self.name)

    def run(self, arguments: Mapping[str, object], timeout_s: float | None = None) -> tuple[str, RunStatus]:
        """Call the function with ``arguments`` (validated first) under ``timeout_s`` (the tool's own by
        default): ``(result text, "ok")``, ``(error text, "error")`` or ``(timeout text, "timeout")``.
        """
        error = self.validate(arguments)
        if error is not None:
            return error, "error"
        limit = self.timeout_s if timeout_s is None else timeout_s
        box: list[tuple[str, RunStatus]] = []
        kwargs = _integral(self.parameters, arguments)

        def call() -> None:
            try:
                text = _result_text(self.fn(**kwargs), self.max_chars)
                box.append((text, "error" if text.startswith("error:") else "ok"))
            except Exception as e:  # noqa: BLE001 - a failing tool is an observation for the policy
                box.append((_cut(f"error: {self.name} raised {type(e).__name__}: {e}", self.max_chars), "error"))

        worker = threading.Thread(target=call, daemon=True, name=f"tool-{self.name}")
        worker.start()
        worker.join(max(0.0, limit))
        if not box:  # still running: abandoned (a daemon thread does not keep the process alive)
            return f"error: {self.name} timed out after {limit:g}s", "timeout"
        return box[0]


def _integral(schema: Mapping[str, object], arguments: Mapping[str, object]) -> dict[str, object]:
    """The arguments with an integral float (``3.0``, valid JSON for an ``integer``) passed as the ``int`` the
    function's annotation promises.
    """
    properties = schema.get("properties") or {}
    assert isinstance(properties, Mapping)
    out = dict(arguments)
    for key, value in out.items():
        kind = properties.get(key, {}).get("type") if isinstance(properties.get(key), Mapping) else None
        integer = kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind)
        if integer and isinstance(value, float):
            out[key] = int(value)
    return out


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "...[truncated]"


def _result_text(value: object, max_chars: int) -> str:
    """A result as the policy reads it: a string as is, anything else as JSON (``str`` when it is not JSON)."""
    if isinstance(value, str):
        return _cut(value, max_chars)
    try:
        return _cut(json.dumps(value, ensure_ascii=False), max_chars)
    except (TypeError, ValueError):
        return _cut(str(value), max_chars)


def type_schema(annotation: object, where: str) -> JSONSchema:
    """The JSON schema of a Python annotation (see the module docstring); others raise ``TypeError``."""
    if annotation in _PRIMITIVES:
        return {"type": _PRIMITIVES[annotation]}  # type: ignore[index]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = {_PRIMITIVES.get(type(a)) for a in args}
        if None in kinds or len(kinds) != 1:
            raise TypeError(f"{where}: a Literal's values must share one of the types int, float, str, bool")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: only 'X | None' unions can be described; got {annotation}")
        inner = type_schema(rest[0], where)
        return {**inner, "type": [inner["type"], "null"]} if len(args) > len(rest) else inner
    if annotation is list or origin is list:
        return {"type": "array", **({"items": type_schema(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    raise TypeError(f"{where}: cannot describe type {annotation!r} as JSON (int, float, str, bool, list, dict, "
                    "Literal, X | None)")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The description (the text before ``Args:``) and each argument's line from the ``Args:`` section."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    head: list[str] = []
    args: dict[str, str] = {}
    section = ""  # "" before the first section header: the description
    for line in lines:
        header = line.strip().rstrip(":").lower()
        if line.strip().endswith(":") and header in _SECTIONS:
            section = header
            continue
        if section in ("args", "arguments", "parameters"):
            match = _ARG_LINE.match(line)
            if match:
                args[match.group(1)] = match.group(2).strip()
        elif not section:
            head.append(line)
    return " ".join(" ".join(head).split()), args


def tool(fn: Callable[..., object] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float = 2.0, max_chars: int = MAX_RESULT_CHARS) -> Tool | Callable[[Callable[..., object]], Tool]:
    """A :class:`Tool` from a typed function: ``@tool``, ``@tool(timeout_s=5)`` or ``tool(fn)``. The name is
    the function's, the description its docstring before ``Args:``, each parameter's description its
    ``Args:`` line. Raises ``TypeError`` naming a parameter that cannot be described.
    """

    def make(f: Callable[..., object]) -> Tool:
        tool_name = name or f.__name__
        hints = typing.get_type_hints(f)
        text, arg_docs = _docstring_parts(inspect.getdoc(f) or "")
        properties: dict[str, JSONSchema] = {}
        required: list[str] = []
        for p in inspect.signature(f).parameters.values():
            where = f"tool {tool_name!r}, parameter {p.name!r}"
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise TypeError(f"{where}: a tool takes named arguments only (no *args, **kwargs or positional-only)")
            if p.name not in hints:
                raise TypeError(f"{where}: has no type annotation (the schema needs one)")
            prop = type_schema(hints[p.name], where)
            if p.name in arg_docs:
                prop["description"] = arg_docs[p.name]
            properties[p.name] = prop
            if p.default is p.empty:
                required.append(p.name)
        params: JSONSchema = {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False}
        return Tool(tool_name, description if description is not None else text, params, f, timeout_s, max_chars)

    return make(fn) if fn is not None else make


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _fits(kind: str, value: object) -> bool:
    got = _kind_of(value)
    if kind == "number":
        return got in ("integer", "number") and math.isfinite(float(value))  # type: ignore[arg-type]
    if kind == "integer" and got == "number":
        return math.isfinite(value) and float(value).is_integer()  # type: ignore[arg-type]
    return got == kind


def check_value(schema: Mapping[str, object], value: object, where: str) -> str | None:
    """Why ``value`` does not fit ``schema`` (``type``, ``enum``, array ``items``), or ``None``."""
    kinds = schema.get("type")
    allowed = [kinds] if isinstance(kinds, str) else list(kinds or [])  # type: ignore[arg-type]
    if allowed and not any(_fits(str(k), value) for k in allowed):
        shown = json.dumps(value)[:40] if _kind_of(value) in ("string", "integer", "number", "boolean") else ""
        return f"{where} must be {' or '.join(map(str, allowed))}, got {_kind_of(value)} {shown}".rstrip()
    enum = schema.get("enum")
    if isinstance(enum, list) and value not in enum:
        return f"{where} must be one of {json.dumps(enum)[:80]}"
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, Mapping):
        for i, item in enumerate(value):
            error = check_value(items, item, f"{where}[{i}]")
            if error:
                return error
    return None


def validate_arguments(schema: Mapping[str, object], arguments: object, tool: str = "tool") -> str | None:
    """An ``error: ...`` message naming the first problem of ``arguments`` against an object ``schema``
    (not an object, a missing required key, an unknown key, a value of the wrong type), or ``None``.
    """
    if not isinstance(arguments, Mapping):
        return f"error: {tool}: arguments must be a JSON object, got {_kind_of(arguments)}"
    properties = schema.get("properties") or {}
    assert isinstance(properties, Mapping)
    missing = [k for k in schema.get("required") or [] if k not in arguments]  # type: ignore[union-attr]
    if missing:
        return f"error: {tool}: missing required argument(s) {', '.join(map(str, missing))}"
    unknown = [str(k)[:40] for k in arguments if k not in properties]
    if unknown and schema.get("additionalProperties", True) is False:
        return f"error: {tool}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(properties)}"
    for key, value in arguments.items():
        if key in properties:
            error = check_value(properties[key], value, f"argument {key!r}")
            if error:
                return f"error: {tool}: {error}"
    return None
