r"""``calc_tool``: multiply two numbers, with a calculator the policy may call first.

The tool-use environment of the research notes (``research-agents.md`` §5.5, item 3), after TRL's
``multiply_tool`` test tool and ``IncrementEnv``, verl's ``verl/tools/gsm8k_tool.py`` (a tool
call, then the final answer scored by the task's verifier) and tinker-cookbook's
``recipes/math_rl/arithmetic_env.py``; SkyRL's ``examples/train/multiply`` is the same problem
without the tool. The issue's target is 4-digit multiplication (``digits=4``), too hard for the
tiny model to do in its head and trivial with the tool.

Prompt: ``37*48`` (operands of ``digits`` digits, most-significant first). A turn is either a tool
call (the ``compact`` syntax of :mod:`posttrain.envs.tools`: ``=37*48``; ``hermes`` for real
models, with a system message naming the tool), answered by a ``tool`` message with the
calculator's output (``1776``, or an ``error: ...`` text, counted in ``tool_errors`` and
penalised by ``tool_error_penalty``, 0 by default; verl's gsm8k tool uses -0.05), or the final
answer, which ends the episode: digits equal to the product -> reward 1.0 (``success`` 1),
other digits -> 0, anything else (not digits) -> 0 with ``format_errors`` 1. ``max_turns`` = 3
(a call, the answer, a spare for a retried call); the driver ends an episode that keeps calling.

Episode: ``37*48`` -> ``=37*48`` -> tool ``1776`` -> ``1776`` (reward 1.0, done).

``tool = false`` takes the calculator away (the comparison of the issue's claim): a call is answered
with ``error: no calculator`` (a tool error), the hermes system message is not shown, and the
expert answers in one turn.

The state key is the problem and the transcript so far (``37*48|=37*48>1776``). The expert calls
the calculator with the problem, then copies the result; with ``noise`` its first call is, with
that probability, a typo (one operand digit changed), whose result it does not trust: it calls
again with the right expression, then answers (three turns).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from posttrain.envs.base import Message, StepResult, register
from posttrain.envs.tools import (
    CALCULATOR_ERRORS,
    PARSE_ERRORS,
    Syntax,
    ToolBox,
    calculator_tool,
    format_hermes,
)
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.tasks.base import Example, Split, make_alphabet

NO_TOOL = "error: no calculator"
HERMES_SYSTEM = (
    'Tool: calculator(expression). Call it as <tool_call>{"name": "calculator", "arguments": '
    '{"expression": "2*3"}}</tool_call>. Reply with the final number only.'
)


@dataclass
class CalcEpisode:
    """One problem, its tool box and the transcript so far."""

    prompt: str
    answer: str
    syntax: Syntax
    tool_error_penalty: float = 0.0
    tool: bool = True
    box: ToolBox = field(init=False)
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.box = ToolBox({"calculator": calculator_tool()}, self.syntax)

    def reset(self) -> list[Message]:
        """The problem (after a system message naming the tool, in ``hermes`` syntax)."""
        self.box = ToolBox({"calculator": calculator_tool()}, self.syntax)
        self.history = []
        messages: list[Message] = [{"role": "user", "content": self.prompt}]
        if self.syntax == "hermes" and self.tool:
            messages.insert(0, {"role": "system", "content": HERMES_SYSTEM})
        return messages

    def step(self, action: str) -> StepResult:
        """A tool call (answered by a ``tool`` message) or the final answer (ends the episode)."""
        call = self.box.parse(action)
        if call.status != "no_call":
            text, status = self.box.execute(call) if self.tool else (NO_TOOL, "error")
            self.history.append(f"{action.strip()}>{text}")
            reward = -self.tool_error_penalty if status != "ok" else 0.0
            return StepResult(
                messages=({"role": "tool", "content": text},), reward=reward,
                info={"success": 0.0, **ToolBox.info(status)},
            )
        text = action.strip()
        if not (text.isascii() and text.isdigit()):
            return StepResult(reward=0.0, done=True, info={"success": 0.0, "format_errors": 1.0})
        success = float((text.lstrip("0") or "0") == self.answer)  # "01776" is 1776
        return StepResult(reward=success, done=True, info={"success": success})

    def state_key(self) -> str:
        """The problem and the calls and results so far."""
        return "|".join([self.prompt, *self.history])


@register("calc_tool")
class CalcTool:
    """Multiplication with a calculator tool (see the module docstring)."""

    name = "calc_tool"
    max_turns = 3

    def __init__(
        self, digits: int = 2, syntax: Syntax = "compact", tool_error_penalty: float = 0.0, noise: float = 0.0,
        tool: bool = True,
    ) -> None:
        if syntax not in ("compact", "hermes"):
            raise ValueError(f"calc_tool: unknown syntax {syntax!r}; choices: compact, hermes")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"calc_tool: noise must be in [0, 1]; got {noise}")
        self.task = ArithmeticTask(digits=digits, ops="*", reverse=False)
        self.syntax, self.tool_error_penalty, self.noise, self.tool = syntax, tool_error_penalty, noise, tool
        # What the calculator can answer to any call (results: signs, decimals) and to a bad one.
        replies = make_alphabet("0123456789-.", *CALCULATOR_ERRORS, *PARSE_ERRORS.values(), NO_TOOL)
        calls = "=" if syntax == "compact" else make_alphabet(HERMES_SYSTEM, format_hermes("calculator", {}))
        self.alphabet = make_alphabet(self.task.alphabet, replies, calls)

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Products of two ``digits``-digit numbers (the arithmetic task's ``*`` problems and splits);
        ``demonstration`` is the call.
        """
        out = []
        for ex in self.task.examples(split, n, seed):
            prompt = ex.prompt.removesuffix("=")
            out.append(Example(prompt, ex.answer, self._call(prompt), dict(ex.fields)))
        return out

    def _call(self, expression: str) -> str:
        if self.syntax == "compact":
            return f"={expression}"
        return format_hermes("calculator", {"expression": expression})

    def start(self, example: Example) -> CalcEpisode:
        """An episode on ``example``."""
        return CalcEpisode(example.prompt, example.answer, self.syntax, self.tool_error_penalty, self.tool)

    def demonstration(self, example: Example, seed: int) -> list[Message]:
        """Call, read the result, answer it; a noisy expert's first call may be a typo (then it calls again)."""
        rng = random.Random(seed)
        ep = self.start(example)
        messages = ep.reset()
        if not self.tool:  # the answer, worked out in the head
            return [*messages, {"role": "assistant", "content": example.answer}]
        calls = [example.prompt]
        if rng.random() < self.noise:
            p = example.prompt
            i = rng.choice([j for j, c in enumerate(p) if c.isdigit()])
            leading = i == 0 or not p[i - 1].isdigit()  # no leading zero: "07" is not a number
            typo = rng.choice([d for d in "0123456789" if d != p[i] and not (leading and d == "0")])
            calls.insert(0, p[:i] + typo + p[i + 1 :])
        result = ""
        for expression in calls:
            action = self._call(expression)
            res = ep.step(action)
            messages += [{"role": "assistant", "content": action}, *res.messages]
            result = res.messages[0]["content"]
        messages.append({"role": "assistant", "content": result})
        return messages
