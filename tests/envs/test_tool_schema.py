"""Tools from typed Python functions: their JSON schemas, argument validation, running under a deadline
(posttrain/envs/tool_schema.py).
"""

from __future__ import annotations

import threading
import time
from typing import Literal

import pytest

from posttrain.envs.tool_schema import tool, validate_arguments


def lookup(city: str, year: int, unit: Literal["C", "F"] = "C", detail: bool | None = None,
           tags: list[str] | None = None, scale: float = 1.0) -> str:
    """Look up the mean temperature of a city.

    The table is fixed: a tool that cannot fail.

    Args:
        city: the city's name
        year (int): a year between 1900 and 2020
        unit: Celsius or Fahrenheit

    Returns:
        the temperature as text
    """
    return f"{city} {year} 12{unit}"


def test_schema_from_signature_annotations_and_docstring():
    t = tool(lookup)
    assert t.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the mean temperature of a city. The table is fixed: a tool that cannot fail.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city's name"},
                    "year": {"type": "integer", "description": "a year between 1900 and 2020"},
                    "unit": {"type": "string", "enum": ["C", "F"], "description": "Celsius or Fahrenheit"},
                    "detail": {"type": ["boolean", "null"]},
                    "tags": {"type": ["array", "null"], "items": {"type": "string"}},
                    "scale": {"type": "number"},
                },
                "required": ["city", "year"],  # the parameters without a default
                "additionalProperties": False,
            },
        },
    }


def test_decorator_forms_and_overrides():
    @tool
    def ping() -> str:
        """Say pong."""
        return "pong"

    @tool(name="sum2", description="Add.", timeout_s=0.5)
    def anything(a: int, b: int = 0) -> int:
        return a + b

    assert ping.name == "ping" and ping.parameters["required"] == [] and ping.run({}) == ("pong", "ok")
    assert (anything.name, anything.description, anything.timeout_s) == ("sum2", "Add.", 0.5)
    assert anything.parameters["required"] == ["a"]
    assert anything.run({"a": 2}) == ("2", "ok")


def _untyped(a, b: int) -> int:  # noqa: ANN001 - the point of the test
    return b


def _star(*args: int) -> int:
    return 0


def _opaque(x: complex) -> str:
    return ""


def _union(x: int | str) -> str:
    return ""


@pytest.mark.parametrize(("fn", "message"), [
    (_untyped, "parameter 'a': has no type annotation"),
    (_star, "parameter 'args': a tool takes named arguments only"),
    (_opaque, "parameter 'x': cannot describe type"),
    (_union, "only 'X | None' unions"),
])
def test_functions_that_cannot_be_described_are_refused_naming_the_parameter(fn, message):
    with pytest.raises(TypeError, match=message):
        tool(fn)


SCHEMA = tool(lookup).parameters


@pytest.mark.parametrize(("arguments", "error"), [
    ({"city": "Oslo", "year": 1990}, None),
    ({"city": "Oslo", "year": 1990.0, "unit": "F", "detail": None, "tags": ["a"], "scale": 2}, None),
    ([1, 2], "error: lookup: arguments must be a JSON object, got array"),
    ("Oslo", "error: lookup: arguments must be a JSON object, got string"),
    ({"city": "Oslo"}, "error: lookup: missing required argument(s) year"),
    ({}, "error: lookup: missing required argument(s) city, year"),
    ({"city": "Oslo", "year": 1990, "country": "NO"},
     "error: lookup: unknown argument(s) country; expected city, year, unit, detail, tags, scale"),
    ({"city": "Oslo", "year": "1990"}, "error: lookup: argument 'year' must be integer, got string \"1990\""),
    ({"city": "Oslo", "year": True}, "error: lookup: argument 'year' must be integer, got boolean true"),
    ({"city": "Oslo", "year": 1990.5}, "error: lookup: argument 'year' must be integer, got number 1990.5"),
    ({"city": 7, "year": 1990}, "error: lookup: argument 'city' must be string, got integer 7"),
    ({"city": "Oslo", "year": 1990, "unit": "K"}, "error: lookup: argument 'unit' must be one of [\"C\", \"F\"]"),
    ({"city": "Oslo", "year": 1990, "tags": ["a", 3]},
     "error: lookup: argument 'tags'[1] must be string, got integer 3"),
    ({"city": "Oslo", "year": 1990, "scale": float("nan")},
     "error: lookup: argument 'scale' must be number, got number NaN"),
    ({"city": None, "year": 1990}, "error: lookup: argument 'city' must be string, got null"),
])
def test_validation_names_the_first_problem_and_never_raises(arguments, error):
    assert validate_arguments(SCHEMA, arguments, tool="lookup") == error


def test_run_validates_then_calls_and_passes_integral_floats_as_int():
    @tool
    def kind(n: int) -> str:
        """The Python type the function received."""
        return type(n).__name__

    assert kind.run({"n": 3.0}) == ("int", "ok")
    assert kind.run({"n": "3"}) == ("error: kind: argument 'n' must be integer, got string \"3\"", "error")


def test_results_are_text_json_or_cut():
    @tool(max_chars=10)
    def echo(n: int) -> object:
        """Various results."""
        return {0: "x" * 50, 1: {"a": [1, 2]}, 2: {1, 2}, 3: "error: tool said no"}[n]

    assert echo.run({"n": 0}) == ("x" * 10 + "...[truncated]", "ok")
    assert echo.run({"n": 1}) == ('{"a": [1, ...[truncated]', "ok")  # JSON, cut after 10 characters
    assert echo.run({"n": 2}) == ("{1, 2}", "ok")  # a set is not JSON: its str()
    assert echo.run({"n": 3}) == ("error: too...[truncated]", "error")  # the "error:" convention


def test_a_raising_tool_is_an_error_observation():
    @tool
    def boom(x: int) -> int:
        """Fail."""
        raise ZeroDivisionError(f"no {x}")

    assert boom.run({"x": 4}) == ("error: boom raised ZeroDivisionError: no 4", "error")


def test_a_hanging_tool_times_out_and_is_abandoned():
    release = threading.Event()

    @tool(timeout_s=0.2)
    def hang(x: int) -> int:
        """Never answer (until the test lets it go)."""
        release.wait(30)
        return x

    t0 = time.monotonic()
    assert hang.run({"x": 1}) == ("error: hang timed out after 0.2s", "timeout")
    assert hang.run({"x": 1}, timeout_s=0.05) == ("error: hang timed out after 0.05s", "timeout")
    assert time.monotonic() - t0 < 2.0
    release.set()
