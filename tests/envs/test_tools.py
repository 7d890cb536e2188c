"""Tool-call parsing, the calculator and the sandboxed Python tool (posttrain/envs/tools.py)."""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path

import pytest

from posttrain.envs.tools import (
    CALCULATOR_ERRORS,
    ERR_DIGITS,
    ERR_EMPTY,
    ERR_LARGE,
    ERR_ONLY,
    ERR_SYNTAX,
    ERR_TOO_LONG,
    ERR_ZERO,
    PARSE_ERRORS,
    TIMEOUT,
    Tool,
    ToolBox,
    calculator,
    calculator_tool,
    format_hermes,
    parse_compact,
    parse_hermes,
    sandbox_python_tool,
)
from posttrain.sandbox import best_isolation

ROOT = Path(__file__).resolve().parents[2]
CALC = {"calculator": calculator_tool()}
MUL = {"expression": "2*3"}
BOTH = {**CALC, "python": sandbox_python_tool(timeout_s=1.0)}


# --- calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("37*48", "1776"),  # 37*48 = 1480 + 296
        (" 1 + 2 ", "3"),
        ("(2+3)*-4", "-20"),
        ("+5", "5"),
        ("7/7", "1"),  # exact division: an integer
        ("10/4", "2.5"),
        ("1/8", "0.125"),
        ("1/3", "0.333333"),  # 6 places, half-even
        ("2/3", "0.666667"),
        ("-7/2", "-3.5"),
        ("1/3*3", "1"),  # exact rationals: no 0.999999
        ("-1/3000000", "0"),  # rounds to 0, never "-0"
        ("999999999999*999999999999", "999999999998000000000001"),  # two 12-digit operands: 24 digits
        ("(1+2)*(3+4)-5", "16"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("", ERR_EMPTY),
        ("   ", ERR_EMPTY),
        ("1+", ERR_SYNTAX),
        ("1\x00", ERR_SYNTAX),
        ("(1", ERR_SYNTAX),
        ("x", ERR_ONLY),  # names
        ("abs(3)", ERR_ONLY),  # calls
        ("__import__('os').system('id')", ERR_ONLY),
        ("(1).real", ERR_ONLY),  # attributes
        ("2**8", ERR_ONLY),  # power
        ("5//2", ERR_ONLY),
        ("5%2", ERR_ONLY),
        ("1.5*2", ERR_ONLY),  # floats
        ("1e3", ERR_ONLY),
        ("True+1", ERR_ONLY),  # a bool is not an integer here
        ("1j", ERR_ONLY),
        ("'a'*3", ERR_ONLY),
        ("[1]*3", ERR_ONLY),
        ("1<2", ERR_ONLY),
        ("1 if 1 else 2", ERR_ONLY),
        ("lambda: 1", ERR_ONLY),
        ("(y:=1)", ERR_ONLY),
        ("1234567890123*2", ERR_DIGITS),  # 13 digits
        ("-1234567890123", ERR_DIGITS),
        ("999999999999*999999999999*10", ERR_LARGE),  # 25 digits
        ("1/999999999999/999999999999/10", ERR_LARGE),  # denominator of 25 digits
        ("1/0", ERR_ZERO),
        ("1/(2-2)", ERR_ZERO),
        ("1" + "+1" * 50, ERR_TOO_LONG),  # 101 characters
    ],
)
def test_calculator_rejects(expression, error):
    assert calculator(expression) == error
    assert error in CALCULATOR_ERRORS


def test_calculator_cannot_burn_cpu():
    # the longest allowed expression of 12-digit products stops at the result cap at once
    worst = "*".join(["999999999999"] * 7)[:100]
    start = time.monotonic()
    for expression in (worst, "(" * 49 + "1" + ")" * 49, "-" * 99 + "1"):
        calculator(expression)
    assert time.monotonic() - start < 0.5
    assert calculator(worst) == ERR_LARGE
    assert calculator("-" * 99 + "1") == "-1"  # 99 unary minuses (odd)


# --- parsers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tools", "status", "name", "arguments"),
    [
        ("=37*48", CALC, "ok", "calculator", {"expression": "37*48"}),
        ("  = 37*48 \n", CALC, "ok", "calculator", {"expression": "37*48"}),
        ("=", CALC, "bad_args", "calculator", {}),
        ("=  ", CALC, "bad_args", "calculator", {}),
        ("1776", CALC, "no_call", None, {}),
        ("", CALC, "no_call", None, {}),
        ("!python print(1)", BOTH, "ok", "python", {"code": "print(1)"}),
        ("!python\nx = 1\nprint(x)", BOTH, "ok", "python", {"code": "x = 1\nprint(x)"}),
        ("!python", BOTH, "bad_args", "python", {}),
        ("!python print(1)", CALC, "unknown_tool", "python", {}),  # not enabled here
        ("!search cats", BOTH, "unknown_tool", "search", {}),
        ("!pythonx 1", BOTH, "unknown_tool", "pythonx", {}),
        ("!", BOTH, "unknown_tool", None, {}),
        ("!1", BOTH, "unknown_tool", None, {}),
        ("=1+1", {"python": BOTH["python"]}, "unknown_tool", "calculator", {}),
    ],
)
def test_parse_compact(text, tools, status, name, arguments):
    call = parse_compact(text, tools)
    assert (call.status, call.name, dict(call.arguments)) == (status, name, arguments)


def _hermes(obj: object) -> str:
    return f"<tool_call>{json.dumps(obj)}</tool_call>"


@pytest.mark.parametrize(
    ("text", "status", "name", "arguments"),
    [
        (_hermes({"name": "calculator", "arguments": MUL}), "ok", "calculator", MUL),
        ("let me compute\n" + _hermes({"name": "calculator", "arguments": MUL}) + "\n", "ok", "calculator", MUL),
        # the OpenAI wire format: arguments as a JSON string
        (_hermes({"name": "calculator", "arguments": json.dumps(MUL)}), "ok", "calculator", MUL),
        # unclosed at the end of the turn (vLLM's hermes parser accepts it)
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}', "ok", "calculator",
         {"expression": "1+1"}),
        # one call per turn: the second is ignored
        (_hermes({"name": "calculator", "arguments": {"expression": "1"}})
         + _hermes({"name": "python", "arguments": {"code": "x"}}), "ok", "calculator", {"expression": "1"}),
        ("6", "no_call", None, {}),
        ('{"name": "calculator", "arguments": {"expression": "1"}}', "no_call", None, {}),  # no tags
        ("<tool_call>{not json}</tool_call>", "invalid_json", None, {}),
        ("<tool_call></tool_call>", "invalid_json", None, {}),
        ("<tool_call>[1, 2]</tool_call>", "invalid_json", None, {}),
        (_hermes({"arguments": {"expression": "1"}}), "invalid_json", None, {}),  # no name
        (_hermes({"name": 3, "arguments": {}}), "invalid_json", None, {}),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "invalid_json", None, {}),  # deep nesting
        (_hermes({"name": "search", "arguments": {"q": "x"}}), "unknown_tool", "search", {}),
        (_hermes({"name": "calculator", "arguments": "{oops"}), "bad_args", "calculator", {}),
        (_hermes({"name": "calculator", "arguments": ["2*3"]}), "bad_args", "calculator", {}),
        (_hermes({"name": "calculator", "arguments": {}}), "bad_args", "calculator", {}),  # missing
        (_hermes({"name": "calculator", "arguments": {"expression": "1", "x": "2"}}), "bad_args", "calculator", {}),
        (_hermes({"name": "calculator", "arguments": {"expression": 5}}), "bad_args", "calculator", {}),  # not str
        (_hermes({"name": "calculator"}), "bad_args", "calculator", {}),  # no arguments at all
    ],
)
def test_parse_hermes(text, status, name, arguments):
    call = parse_hermes(text, BOTH)
    assert (call.status, call.name, dict(call.arguments)) == (status, name, arguments)


def test_format_hermes_round_trips():
    text = format_hermes("calculator", {"expression": "37*48"})
    assert text == '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
    call = parse_hermes(text, CALC)
    assert (call.status, call.name, dict(call.arguments)) == ("ok", "calculator", {"expression": "37*48"})


# --- tool box --------------------------------------------------------------------------------


def test_toolbox_counts_calls_errors_and_observations():
    box = ToolBox(CALC, "compact")
    assert box.execute(box.parse("=37*48")) == ("1776", "ok")
    assert box.execute(box.parse("=1/0")) == (ERR_ZERO, "error")
    assert box.execute(box.parse("=")) == (PARSE_ERRORS["bad_args"], "bad_args")
    assert box.execute(box.parse("!python 1")) == (PARSE_ERRORS["unknown_tool"], "unknown_tool")
    assert (box.calls, box.errors, box.timeouts) == (4, 3, 0)
    assert ToolBox.info("ok") == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
    assert ToolBox.info("bad_args") == {"tool_calls": 1.0, "tool_errors": 1.0, "tool_timeouts": 0.0}
    assert ToolBox.info("timeout") == {"tool_calls": 1.0, "tool_errors": 1.0, "tool_timeouts": 1.0}
    hermes = ToolBox(CALC, "hermes")
    assert hermes.execute(hermes.parse("<tool_call>{]</tool_call>")) == (PARSE_ERRORS["invalid_json"], "invalid_json")
    with pytest.raises(ValueError, match="choices: compact, hermes"):
        ToolBox(CALC, "xml")  # type: ignore[arg-type]


def test_toolbox_turns_a_crashing_tool_into_an_observation():
    def crash(expression: str) -> tuple[str, str]:
        raise ZeroDivisionError

    box = ToolBox({"calculator": Tool("calculator", ("expression",), crash)}, "compact")
    assert box.execute(box.parse("=1")) == ("error: ZeroDivisionError", "error")
    assert box.errors == 1


# --- python tool: normal and hostile code -----------------------------------------------------

needs_isolation = pytest.mark.skipif(
    best_isolation() == "rlimits", reason="the rlimits sandbox shares the host network and /tmp"
)


def _python(code: str) -> tuple[str, str, float, ToolBox]:
    box = ToolBox(BOTH, "compact")
    start = time.monotonic()
    text, status = box.execute(box.parse("!python " + code))
    return text, status, time.monotonic() - start, box


def test_python_tool_output_and_exception():
    text, status, _, _ = _python("print(sum(range(5)))")
    assert (text, status) == ("10\n", "ok")
    text, status, _, box = _python("print('before')\n1/0")
    assert status == "error"
    assert "ZeroDivisionError" in text and text.startswith("error:")
    assert (box.errors, box.timeouts) == (1, 0)


def test_python_tool_infinite_loop_times_out():
    text, status, elapsed, box = _python("while True:\n    pass")
    assert status == "timeout" and text.startswith(TIMEOUT)
    assert (box.calls, box.errors, box.timeouts) == (1, 1, 1)
    assert elapsed < 4


def test_python_tool_sleep_times_out():
    text, status, elapsed, _ = _python("import time\ntime.sleep(60)")
    assert status == "timeout" and elapsed < 4


def test_python_tool_fork_bomb():
    text, status, elapsed, _ = _python("import os\nwhile True:\n    os.fork()")
    assert status in ("error", "timeout") and text.startswith("error")
    assert elapsed < 5


def test_python_tool_memory_bomb():
    text, status, elapsed, _ = _python("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))")
    assert status in ("error", "timeout") and text.startswith("error")
    assert "MemoryError" in text or status == "timeout"
    assert elapsed < 5


def test_python_tool_huge_output_is_capped():
    text, status, elapsed, _ = _python("while True:\n    print('x' * 10000)")
    assert status == "error" and text.endswith("error: output limit exceeded")
    assert len(text) < 1100  # max_chars 1000 + the markers
    assert elapsed < 4


@needs_isolation
def test_python_tool_has_no_network():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        text, status, _, _ = _python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert status == "error" and "Error" in text


@needs_isolation
def test_python_tool_cannot_write_outside_tmp():
    target = ROOT / f"tool_pwned_{secrets.token_hex(4)}"
    try:
        text, status, _, _ = _python(f"open({str(target)!r}, 'w').write('x')")
        assert status == "error" and "Error" in text
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    # /tmp inside the sandbox is its own scratch space
    text, status, _, _ = _python("open('/tmp/scratch', 'w').write('x')\nprint(open('/tmp/scratch').read())")
    assert (text, status) == ("x\n", "ok")
