r"""``json_tools``: arithmetic the policy must do with JSON-schema tools, in a real model family's call format.

The environment of issue 34 item 4: tools declared as JSON schemas (:mod:`posttrain.envs.tool_schema`),
calls written the way Qwen / Hermes, Llama 3 or Mistral models write them (:mod:`posttrain.envs.tool_parsers`,
``parser``), several calls a turn, results returned as ``tool`` messages. After the multi-tool tasks of
BFCL's "parallel" and "multiple" categories and verl's / SkyRL's tool environments, reduced to problems
a verifier scores exactly.

Problems (``form``), operands of ``digits`` digits:

- ``chain``: ``(a+b)*c`` -- ``add(a, b)``, then ``mul(sum, c)`` (two turns of one call), then the answer;
- ``parallel``: ``a*b+c*d`` -- ``mul(a, b)`` and ``mul(c, d)`` in one turn, then ``add``, then the answer.

Tools (``tools``, names from :data:`TOOLS`): ``add(a, b)`` and ``mul(a, b)`` on integers of at most 12
digits; ``calculator(expression)`` (``envs/tools.py``'s exact calculator; the ``compact`` parser's
``=expr`` calls it). Register more with :func:`register_tool`.

A turn with at least one call (as ``parser`` reads it) runs the calls in order, at most ``max_calls``,
each under ``tool_timeout_s``, and answers with one result per call (``results = "tool"``: ``tool``
messages the chat template renders in its own format; ``"text"``: one ``user`` message of
``<tool_response>`` blocks, for a template without a tool role). A malformed call is answered with an
``error: ...`` result and counted, never raised: unreadable JSON (``tool_invalid_json``), a tool that
does not exist (``tool_unknown``), arguments that do not fit the schema (``tool_bad_args``), a tool that
raised or returned an error (``tool_raised``), one that passed its deadline (``tool_timeouts``), calls
past ``max_calls`` (one ``error`` result for all of them, ``tool_too_many``); every one of these is also a
``tool_errors``, penalised by ``tool_error_penalty`` each. A turn without a call is the final answer:
the last integer in its text equal to the value -> reward 1 (``success``), another integer -> 0, no
integer -> 0 with ``format_errors``. The episode ends there; ``max_turns`` = 4 (two tool turns, the
answer and a spare for a retried call).

``announce``: how the first messages name the tools: ``schemas`` (a system message with each tool's
OpenAI schema as JSON and the family's call format, for real models), ``brief`` (one short line of
signatures, for the tiny model's context) or ``none`` (the template's own ``tools=`` rendering; the
driver does not pass it yet). The expert calls the tools and copies the last result; with ``noise`` its
first call is, with that probability, given an argument as a string (a schema error), and it retries.

``available = false`` takes the tools away, the comparison of the issue's claim (as ``calc_tool``'s ``tool =
false``): the same first messages, but every call is answered ``error: no tools`` (a tool error), so the
policy must compute the answer itself.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from posttrain.envs.base import Message, StepResult, register
from posttrain.envs.tool_parsers import (
    PARSERS,
    Call,
    ResultRole,
    format_calls,
    parse_calls,
    parser_for_tokenizer,
    result_messages,
    supports_tool_role,
)
from posttrain.envs.tool_schema import Tool, tool
from posttrain.envs.tools import calculator as _calculator
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split

Form = Literal["chain", "parallel"]
Announce = Literal["schemas", "brief", "none"]
MAX_OPERAND = 10**12
PRINTABLE = "".join(chr(c) for c in range(32, 127))
TOOLS: dict[str, Tool] = {}
"""The tools an environment may name in ``tools``, by name."""


def register_tool(t: Tool) -> Tool:
    """Add ``t`` to :data:`TOOLS`; a name taken already is a ``ValueError``."""
    if t.name in TOOLS:
        raise ValueError(f"tool {t.name!r} is registered already")
    TOOLS[t.name] = t
    return t


def _operands(*values: int) -> None:
    if any(abs(v) >= MAX_OPERAND for v in values):
        raise ValueError("operands must have at most 12 digits")


@register_tool
@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend

    """
    _operands(a, b)
    return a + b


@register_tool
@tool
def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor

    """
    _operands(a, b)
    return a * b


@register_tool
@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers and + - * / ( ) exactly.

    Args:
        expression: the expression, e.g. (12+34)*56

    """
    return _calculator(expression)


FORMAT_HINTS = {
    "hermes": 'Call a tool as <tool_call>{"name": <name>, "arguments": <object>}</tool_call>; '
              "several calls may go in one turn.",
    "llama3_json": 'Call a tool by replying with {"name": <name>, "parameters": <object>}; '
                   "separate several calls with ;.",
    "mistral": 'Call tools as [TOOL_CALLS][{"name": <name>, "arguments": <object>}, ...].',
    "compact": "Call the calculator as =<expression>.",
}
FORMAT_HINTS["any"] = FORMAT_HINTS["hermes"]
ANSWER_HINT = "Use the tools for every operation, then reply with the final number only."
NO_TOOLS = "error: no tools"


@dataclass
class ToolEpisode:
    """One problem, the environment's tools and parser, and the transcript so far."""

    prompt: str
    answer: str
    env: JsonTools
    history: list[str] = field(default_factory=list)
    turn: int = 0

    def reset(self) -> list[Message]:
        """The system message announcing the tools (unless ``announce = "none"``), then the problem."""
        self.history, self.turn = [], 0
        system = self.env.system_message()
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": self.prompt}]

    def step(self, action: str) -> StepResult:
        """Run the turn's calls (results as tool messages), or score the final answer (no call)."""
        parsed = parse_calls(self.env.parser, action)
        if not parsed.calls:
            return self._answer(parsed.content)
        if self.env.available:
            results, info = run_calls(parsed.calls, self.env.toolset, self.env.max_calls, self.env.tool_timeout_s)
        else:  # the tools taken away (``available = false``): every call is an error, the policy is on its own
            results = [((c.name or "error")[:40], NO_TOOLS) for c in parsed.calls]
            info = {**dict.fromkeys(COUNTERS, 0.0), "tool_calls": len(results) * 1.0, "tool_errors": len(results) * 1.0}
        self.turn += 1
        self.history.append(action.strip() + ">" + "|".join(text for _, text in results))
        messages = result_messages(results, self.env.result_role, self.turn)
        return StepResult(messages=tuple(messages), reward=0.0 - self.env.tool_error_penalty * info["tool_errors"],
                          info={"success": 0.0, **info})

    def _answer(self, text: str) -> StepResult:
        numbers = re.findall(r"-?\d+", text)
        if not numbers or len(numbers[-1]) > 40:  # int() of thousands of digits is refused (and slow)
            return StepResult(done=True, info={"success": 0.0, "format_errors": 1.0})
        success = float(int(numbers[-1]) == int(self.answer))
        return StepResult(reward=success, done=True, info={"success": success})

    def state_key(self) -> str:
        """The problem and every tool turn so far with its results."""
        return "|".join([self.prompt, *self.history])


COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_invalid_json", "tool_unknown", "tool_bad_args",
            "tool_raised", "tool_too_many")


def run_calls(calls: Sequence[Call], tools: dict[str, Tool], max_calls: int,
              timeout_s: float) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """Run ``calls`` in order (at most ``max_calls``): ``(tool name, result text)`` of each, one more
    ``error`` result for the calls past the limit, and the :data:`COUNTERS`. Never raises.
    """
    info = dict.fromkeys(COUNTERS, 0.0)
    results: list[tuple[str, str]] = []
    for call in calls[:max_calls]:
        info["tool_calls"] += 1
        if call.error is not None or call.name is None:
            kind, text = "tool_invalid_json", call.error or "error: unreadable call"
        elif call.name not in tools:
            kind = "tool_unknown"
            text = f"error: unknown tool {call.name[:40]!r}; tools: {', '.join(tools)}"
        else:
            t = tools[call.name]
            text = t.validate(call.arguments) or ""
            kind = "tool_bad_args" if text else ""
            if not text:
                text, status = t.run(call.arguments, timeout_s)  # type: ignore[arg-type]
                kind = {"ok": "", "error": "tool_raised", "timeout": "tool_timeouts"}[status]
        if kind:
            info[kind] += 1
            info["tool_errors"] += 1
        results.append(((call.name or "error")[:40], text))
    extra = len(calls) - max_calls
    if extra > 0:
        results.append(("error", f"error: {extra} call(s) past the limit of {max_calls} a turn were not run"))
        info["tool_too_many"] += 1
        info["tool_errors"] += 1
    return results, info


@register("json_tools")
class JsonTools:
    """Arithmetic with JSON-schema tools in a model family's call format (see the module docstring)."""

    name = "json_tools"
    max_turns = 4

    def __init__(
        self, digits: int = 2, form: Form = "chain", parser: str = "hermes", tools: Sequence[str] = ("add", "mul"),
        results: Literal["auto", "tool", "text"] = "auto", announce: Announce = "schemas", max_calls: int = 4,
        tool_timeout_s: float = 2.0, tool_error_penalty: float = 0.0, noise: float = 0.0, available: bool = True,
    ) -> None:
        self._check(digits, form, parser, tools, results, announce, max_calls, tool_timeout_s, noise)
        self.available = available
        self.digits, self.form, self.parser, self.results, self.announce = digits, form, parser, results, announce
        self.toolset = {n: TOOLS[n] for n in tools}
        self.max_calls, self.tool_timeout_s = max_calls, tool_timeout_s
        self.tool_error_penalty, self.noise = tool_error_penalty, noise
        # Every printable character: JSON calls, error texts that name what the policy wrote, schemas.
        self.alphabet = make_alphabet(PRINTABLE, "\n")

    @staticmethod
    def _check(digits: int, form: str, parser: str, tools: Sequence[str], results: str, announce: str,
               max_calls: int, tool_timeout_s: float, noise: float) -> None:
        def bad(key: str, value: object, expected: str) -> ValueError:
            return ValueError(f"json_tools: {key} = {value!r}; expected {expected}")

        if form not in ("chain", "parallel"):
            raise bad("form", form, "chain or parallel")
        if parser not in PARSERS:
            raise bad("parser", parser, ", ".join(PARSERS.names()))
        unknown = [t for t in tools if t not in TOOLS]
        if unknown or not tools:
            raise bad("tools", list(tools), f"names among {', '.join(TOOLS)}")
        if not ({"add", "mul"} <= set(tools) or "calculator" in tools):
            raise bad("tools", list(tools), "add and mul, or calculator (the problems need both operations)")
        if parser == "compact" and ("calculator" not in tools or form == "parallel"):
            raise bad("parser", parser, "hermes, llama3_json or mistral: compact writes one calculator call a "
                      "turn (tools must hold calculator, form must be chain)")
        if results not in ("auto", "tool", "text"):
            raise bad("results", results, "auto, tool or text")
        if announce not in ("schemas", "brief", "none"):
            raise bad("announce", announce, "schemas, brief or none")
        if not 1 <= digits <= 6 or max_calls < 1 or tool_timeout_s <= 0 or not 0.0 <= noise <= 1.0:
            raise ValueError(f"json_tools: need 1 <= digits <= 6 ({digits}), max_calls >= 1 ({max_calls}), "
                             f"tool_timeout_s > 0 ({tool_timeout_s}), 0 <= noise <= 1 ({noise})")

    def bind_tokenizer(self, tokenizer: object) -> None:
        """Resolve ``parser = "any"`` (when the template shows a family) and ``results = "auto"`` from the
        tokenizer's chat template (its call format; whether it has a tool role). Until bound, ``any`` sniffs
        each turn and answers as ``tool``.
        """
        if self.parser == "any":
            self.parser = parser_for_tokenizer(tokenizer, default="any")  # no marker: keep sniffing
        if self.results == "auto":
            self.results = "tool" if supports_tool_role(tokenizer) else "text"

    @property
    def result_role(self) -> ResultRole:
        """``tool`` or ``text`` (``auto`` unbound: ``tool``)."""
        return "text" if self.results == "text" else "tool"

    def tool_schemas(self) -> list[dict[str, object]]:
        """The tools' OpenAI schemas: what a chat template's ``tools=`` argument takes."""
        return [t.schema() for t in self.toolset.values()]

    def system_message(self) -> str | None:
        """The first message naming the tools (``announce``)."""
        if self.announce == "none":
            return None
        if self.announce == "brief":
            sigs = [f"{n}({','.join(t.parameters['properties'])})" for n, t in self.toolset.items()]  # type: ignore[arg-type]
            return f"tools: {' '.join(sigs)}"
        schemas = "\n".join(json.dumps(schema) for schema in self.tool_schemas())
        return f"You can call these tools:\n<tools>\n{schemas}\n</tools>\n{FORMAT_HINTS[self.parser]} {ANSWER_HINT}"

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """``(a+b)*c`` or ``a*b+c*d`` with operands of ``digits`` digits; ``demonstration`` is the first call turn."""
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1

        def draw(rng: random.Random) -> tuple[str, Example]:
            a, b, c, d = (rng.randint(lo, hi) for _ in range(4))
            if self.form == "chain":
                prompt, value = f"({a}+{b})*{c}", (a + b) * c
            else:
                prompt, value = f"{a}*{b}+{c}*{d}", a * b + c * d
            fields = {"operands": [a, b, c] if self.form == "chain" else [a, b, c, d]}
            return f"json_tools:{self.form}:{prompt}", Example(prompt, str(value), "", fields)

        out = sample_split(split, n, seed, draw)
        return [Example(ex.prompt, ex.answer, self._turn(self._plan(ex)[0]), dict(ex.fields)) for ex in out]

    def _plan(self, example: Example) -> list[list[tuple[str, int, int]]]:
        """The expert's tool turns: each a list of ``(operation, x, y)``."""
        ops = list(example.fields["operands"])  # type: ignore[arg-type]
        if self.form == "chain":
            a, b, c = ops
            return [[("add", a, b)], [("mul", a + b, c)]]
        a, b, c, d = ops
        return [[("mul", a, b), ("mul", c, d)], [("add", a * b, c * d)]]

    def _turn(self, calls: list[tuple[str, object, object]]) -> str:
        """The text of one turn of calls in the parser's format (``calculator`` when add/mul are absent)."""
        written = []
        for op, x, y in calls:
            if op in self.toolset:
                written.append((op, {"a": x, "b": y}))
            else:
                written.append(("calculator", {"expression": f"{x}{'+' if op == 'add' else '*'}{y}"}))
        return format_calls("hermes" if self.parser == "any" else self.parser, written)

    def start(self, example: Example) -> ToolEpisode:
        """An episode on ``example``."""
        return ToolEpisode(example.prompt, example.answer, self)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """Call, read, call, read, answer; a noisy expert's first call passes ``a`` as a string, then it retries."""
        rng = random.Random(seed)
        ep = self.start(example)
        messages = ep.reset()
        plan = self._plan(example)
        turns: list[list[tuple[str, object, object]]] = [list(t) for t in plan]
        if rng.random() < self.noise and all(op in self.toolset for op, _, _ in plan[0]):
            op, x, y = plan[0][0]
            turns.insert(0, [(op, str(x), y), *plan[0][1:]])  # "a": "37": the schema wants an integer
        last = ""
        for calls in turns:
            action = self._turn(calls)
            res = ep.step(action)
            messages += [{"role": "assistant", "content": action}, *res.messages]
            last = res.messages[-1]["content"]
        if self.result_role == "text":  # the last block's content
            last = json.loads(last.split("<tool_response>")[-1].removesuffix("</tool_response>"))["content"]
        messages.append({"role": "assistant", "content": last})
        return messages
