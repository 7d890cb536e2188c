r"""Tools for environments: a tool-call parser, a calculator, a sandboxed Python tool, a :class:`ToolBox`.

Two call syntaxes (:class:`ToolBox` ``syntax``; :func:`parse_compact`, :func:`parse_hermes`):

* ``compact``, for the tiny character model: an action that starts with ``=`` calls the calculator
  with the rest as its expression (``=37*48``); an action that starts with ``!python`` runs the
  rest as Python (``!python print(2+3)``); any other ``!name`` is an unknown tool. Anything else
  is not a call (the policy's answer).
* ``hermes``, the Hugging Face / Qwen convention: ``<tool_call>{"name": "calculator",
  "arguments": {"expression": "37*48"}}</tool_call>`` anywhere in the text. Like vLLM's hermes
  parser, a last ``<tool_call>`` left unclosed (the turn ended) runs to the end of the text.
  ``arguments`` (or ``parameters``) may also be a JSON string holding the object (the OpenAI wire
  format); it must hold exactly the tool's parameters, each a string. One call per turn: a
  second ``<tool_call>`` is ignored.

Parsing never raises: it returns a :class:`ToolCall` whose ``status`` is ``ok``, ``no_call`` (the
text calls nothing), ``invalid_json`` (the call is not a JSON object with a string ``name``),
``unknown_tool`` or ``bad_args`` (arguments that are not exactly the tool's, each a string) -- the
statuses of PrimeIntellect's renderers (PR #22). :meth:`ToolBox.execute` turns any parsed call
(not ``no_call``: text that calls nothing is the environment's to read) into an observation
``(text, status)``, never raising either: a malformed call becomes ``error: ...``, a
tool that fails returns its error text (status ``error``), a Python run past its deadline returns
``error: timeout`` (status ``timeout``). The box counts ``tool_calls``, ``tool_errors`` and
``tool_timeouts`` for ``StepResult.info``.

Calculator (:func:`calculator`): the expression is parsed with :mod:`ast` (never ``eval``) and
evaluated over exact rationals (:class:`fractions.Fraction`). Allowed: integer literals of at most
:data:`MAX_DIGITS` digits, ``+ - * /``, parentheses, unary ``-`` / ``+``; the expression is at most
:data:`MAX_EXPRESSION` characters and every intermediate value stays below
``10 ** MAX_RESULT_DIGITS`` (numerator and denominator), so it cannot be used to burn CPU (no
``**``, no names, no calls, no attributes, no floats). The result is written as an integer when it
is one (``7/7`` -> ``1``, ``-3*4`` -> ``-12``), else as a decimal rounded half-even to
:data:`DECIMALS` places with trailing zeros dropped (``1/3`` -> ``0.333333``, ``10/4`` -> ``2.5``).
Every error is one of the fixed strings of :data:`CALCULATOR_ERRORS` (no echo of the input, so an
environment's alphabet can list every character the calculator can say).

Python tool (:func:`python_tool`): the code runs through :func:`posttrain.sandbox.run_python`
(the code reward's sandbox: no network, read-only filesystem, CPU/memory/process limits under
bwrap or unshare) with a wall and CPU limit of ``timeout_s`` (5 s), 256 MB of address space and
64 KiB of output; the observation is stdout, or on failure the tail of stderr, truncated to
``max_chars``. GEM ``gem/tools/python_code_tool.py``, SkyRL ``skyrl_gym/tools/python.py`` and
ROLL ``roll/pipeline/agentic/tools/python_code_tool.py`` ship the same tool with the same 5 s.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from posttrain.sandbox import Isolation, run_python

Syntax = Literal["compact", "hermes"]
ParseStatus = Literal["ok", "invalid_json", "unknown_tool", "bad_args", "no_call"]
ExecStatus = Literal["ok", "error", "timeout", "invalid_json", "unknown_tool", "bad_args"]

MAX_DIGITS = 12
MAX_RESULT_DIGITS = 24
MAX_EXPRESSION = 100
DECIMALS = 6

ERR_EMPTY = "error: empty"
ERR_TOO_LONG = "error: too long"
ERR_SYNTAX = "error: syntax"
ERR_ONLY = "error: only integers and + - * / ( )"
ERR_DIGITS = "error: number over 12 digits"
ERR_LARGE = "error: result too large"
ERR_ZERO = "error: division by zero"
CALCULATOR_ERRORS = (ERR_EMPTY, ERR_TOO_LONG, ERR_SYNTAX, ERR_ONLY, ERR_DIGITS, ERR_LARGE, ERR_ZERO)
"""Every error text :func:`calculator` can return."""

PARSE_ERRORS: dict[str, str] = {
    "invalid_json": "error: invalid json",
    "unknown_tool": "error: unknown tool",
    "bad_args": "error: bad arguments",
}
"""The observation of a malformed call, by status."""

TIMEOUT = "error: timeout"
TRUNCATED = "...[truncated]"


class _CalcError(Exception):
    """A calculator error; its message is one of :data:`CALCULATOR_ERRORS`."""


def _bounded(value: Fraction) -> Fraction:
    limit = 10**MAX_RESULT_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise _CalcError(ERR_LARGE)
    return value


def _evaluate(node: ast.AST) -> Fraction:
    """Evaluate an expression tree of integers and ``+ - * /`` exactly; anything else is an error."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if abs(node.value) >= 10**MAX_DIGITS:
            raise _CalcError(ERR_DIGITS)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return _bounded(left + right)
        if isinstance(node.op, ast.Sub):
            return _bounded(left - right)
        if isinstance(node.op, ast.Mult):
            return _bounded(left * right)
        if right == 0:
            raise _CalcError(ERR_ZERO)
        return _bounded(left / right)
    raise _CalcError(ERR_ONLY)


def format_number(value: Fraction) -> str:
    """An integer as is; else a decimal rounded half-even to :data:`DECIMALS` places, zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)  # Fraction.__round__: exact, half to even
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**DECIMALS)
    digits = str(frac).rjust(DECIMALS, "0").rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def calculator(expression: str) -> str:
    """The value of ``expression`` (see the module docstring), or an error string; never raises.

    ``"37*48"`` -> ``"1776"``; ``"(2+3)*-4"`` -> ``"-20"``; ``"1/8"`` -> ``"0.125"``;
    ``"2**8"`` -> ``"error: only integers and + - * / ( )"``.
    """
    text = expression.strip()
    if not text:
        return ERR_EMPTY
    if len(text) > MAX_EXPRESSION:
        return ERR_TOO_LONG
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return ERR_SYNTAX
    try:
        return format_number(_evaluate(tree.body))
    except _CalcError as e:
        return str(e)
    except RecursionError:  # pragma: no cover - MAX_EXPRESSION keeps trees shallow
        return ERR_TOO_LONG


def truncate(text: str, max_chars: int, *, tail: bool = False) -> str:
    """``text`` cut to ``max_chars`` characters plus :data:`TRUNCATED` (its end kept when ``tail``)."""
    if len(text) <= max_chars:
        return text
    return TRUNCATED + text[-max_chars:] if tail else text[:max_chars] + TRUNCATED


def python_tool(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output: int = 1 << 16,
    max_chars: int = 1000,
    isolation: Isolation = "auto",
) -> tuple[str, ExecStatus]:
    """Run ``code`` in the sandbox: ``(stdout, "ok")``, ``(error text, "error")`` or
    ``(TIMEOUT, "timeout")``; never raises (a sandbox failure is an ``error`` observation).
    """
    try:
        res = run_python(
            code, wall_s=timeout_s, cpu_s=timeout_s, memory_mb=memory_mb, max_output=max_output,
            nproc=16, isolation=isolation,
        )
    except Exception as e:  # noqa: BLE001 - a broken sandbox is an observation, not a crash
        return truncate(f"error: sandbox failed: {type(e).__name__}: {e}", max_chars), "error"
    if res.timed_out:
        return f"{TIMEOUT} ({timeout_s:g}s)", "timeout"
    if res.output_truncated:
        return truncate(res.stdout, max_chars) + "\nerror: output limit exceeded", "error"
    if res.returncode != 0:
        detail = res.stderr.strip() or f"exit status {res.returncode}"
        return "error: " + truncate(detail, max_chars, tail=True), "error"
    return truncate(res.stdout, max_chars), "ok"


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: ``status`` ``ok`` with ``name`` and ``arguments``, or why not."""

    status: ParseStatus
    name: str | None = None
    arguments: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A tool: a function of string keyword arguments returning ``(text, status)``."""

    name: str
    params: tuple[str, ...]
    run: Callable[..., tuple[str, ExecStatus]]


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)
_COMPACT_NAME = re.compile(r"!([A-Za-z_][A-Za-z0-9_]*)\s?(.*)\Z", re.DOTALL)


def parse_compact(text: str, tools: Mapping[str, Tool]) -> ToolCall:
    """``=expr`` -> calculator, ``!python code`` -> python, other ``!name`` -> unknown, else no call."""
    stripped = text.strip()
    if stripped.startswith("="):
        if "calculator" not in tools:
            return ToolCall("unknown_tool", "calculator")
        expression = stripped[1:].strip()
        return ToolCall("ok", "calculator", {"expression": expression}) if expression else ToolCall(
            "bad_args", "calculator")
    if stripped.startswith("!"):
        match = _COMPACT_NAME.match(stripped)
        if match is None:
            return ToolCall("unknown_tool")
        name, rest = match.group(1), match.group(2)
        if name != "python" or name not in tools:
            return ToolCall("unknown_tool", name)
        return ToolCall("ok", name, {"code": rest}) if rest.strip() else ToolCall("bad_args", name)
    return ToolCall("no_call")


def parse_hermes(text: str, tools: Mapping[str, Tool]) -> ToolCall:
    """The first ``<tool_call>{json}</tool_call>`` in ``text`` (see the module docstring)."""
    match = _HERMES.search(text)
    if match is None:
        return ToolCall("no_call")
    try:
        call = json.loads(match.group(1).strip())
    except (ValueError, RecursionError):
        return ToolCall("invalid_json")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("invalid_json")
    name = call["name"]
    if name not in tools:
        return ToolCall("unknown_tool", name)
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI wire format: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ToolCall("bad_args", name)
    if not isinstance(arguments, dict):
        return ToolCall("bad_args", name)
    if set(arguments) != set(tools[name].params) or not all(isinstance(v, str) for v in arguments.values()):
        return ToolCall("bad_args", name)
    return ToolCall("ok", name, arguments)


def format_hermes(name: str, arguments: Mapping[str, object]) -> str:
    """The hermes text of a call: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{TOOL_CALL_CLOSE}"


def calculator_tool() -> Tool:
    """:func:`calculator` as a tool (argument ``expression``)."""

    def run(expression: str) -> tuple[str, ExecStatus]:
        text = calculator(expression)
        return text, "error" if text.startswith("error:") else "ok"

    return Tool("calculator", ("expression",), run)


def sandbox_python_tool(timeout_s: float = 5.0, max_chars: int = 1000, isolation: Isolation = "auto") -> Tool:
    """:func:`python_tool` as a tool (argument ``code``)."""

    def run(code: str) -> tuple[str, ExecStatus]:
        return python_tool(code, timeout_s=timeout_s, max_chars=max_chars, isolation=isolation)

    return Tool("python", ("code",), run)


@dataclass
class ToolBox:
    """Parses and runs the tool calls of one episode, counting them.

    ``calls`` / ``errors`` / ``timeouts`` are the episode's totals (a timeout is also an error);
    :meth:`info` gives the last call's increments under the ``StepResult.info`` names.
    """

    tools: Mapping[str, Tool]
    syntax: Syntax = "compact"
    calls: int = 0
    errors: int = 0
    timeouts: int = 0

    def __post_init__(self) -> None:
        if self.syntax not in ("compact", "hermes"):
            raise ValueError(f"unknown tool-call syntax {self.syntax!r}; choices: compact, hermes")

    def parse(self, text: str) -> ToolCall:
        """The call in ``text`` (never raises)."""
        try:
            return (parse_compact if self.syntax == "compact" else parse_hermes)(text, self.tools)
        except Exception:  # noqa: BLE001 - defensive: a parser bug must not kill the episode
            return ToolCall("invalid_json")

    def execute(self, call: ToolCall) -> tuple[str, ExecStatus]:
        """Run ``call``: ``(observation, status)``; a malformed call is an ``error: ...`` observation."""
        if call.status == "no_call":
            raise ValueError("execute() needs a call; the text called no tool")
        self.calls += 1
        if call.status != "ok":
            self.errors += 1
            return PARSE_ERRORS[call.status], call.status
        tool = self.tools[str(call.name)]
        try:
            text, status = tool.run(**{k: str(v) for k, v in call.arguments.items()})
        except Exception as e:  # noqa: BLE001 - a failing tool is an observation
            text, status = f"error: {type(e).__name__}", "error"
        if status != "ok":
            self.errors += 1
        if status == "timeout":
            self.timeouts += 1
        return text, status

    @staticmethod
    def info(status: ExecStatus) -> dict[str, float]:
        """The ``StepResult.info`` increments of one executed call with ``status``."""
        return {
            "tool_calls": 1.0,
            "tool_errors": float(status != "ok"),
            "tool_timeouts": float(status == "timeout"),
        }
