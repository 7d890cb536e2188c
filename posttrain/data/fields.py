"""Field mapping: which column of a record feeds which part of an :class:`Example`.

A field map is ``{target: column}``, e.g. ``{"prompt": "question", "answer": "answer",
"tests": "test_list"}``. Targets ``prompt``, ``answer`` and ``demonstration`` fill the
:class:`~posttrain.tasks.base.Example` attributes of the same name; every other target (``tests``,
``hint``, ``level``, ...) goes into ``Example.fields`` under the target name, where reward
functions receive it as a keyword argument. A mapped column that a record lacks is an error naming
the target, the column, the source and the columns the record has.

``tests`` values are normalized by :func:`normalize_tests` to the shape the code reward takes: a
list of Python assert strings, or a list of ``{"input": ..., "output": ...}`` dicts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from posttrain.data.readers import DataError, Record

FieldMap = Mapping[str, str]
"""``{target: column}``; see the module docstring."""

EXAMPLE_TARGETS = ("prompt", "answer", "demonstration")


def merge_fields(
    required: FieldMap, optional: FieldMap, overrides: Mapping[str, str | None]
) -> tuple[dict[str, str], dict[str, str]]:
    """Merge a preset's default maps with the user's ``overrides``.

    An override ``target -> column`` replaces the default and becomes required (a column the user
    names must exist); ``target -> None`` unmaps the target. ``prompt`` cannot be unmapped.

    Returns:
        ``(required, optional)`` maps: required columns must exist; optional ones are read when present.

    """
    req, opt = dict(required), dict(optional)
    for target, column in overrides.items():
        req.pop(target, None)
        opt.pop(target, None)
        if column is not None:
            req[target] = column
        elif target == "prompt":
            raise DataError("fields.prompt cannot be null: every example needs a prompt")
    if "prompt" not in req:
        raise DataError("the field map needs a prompt column (fields.prompt = COLUMN)")
    return req, opt


def map_record(
    record: Record, required: FieldMap, optional: FieldMap, where: str, overridable: bool = True
) -> dict[str, object]:
    """Return ``{target: record[column]}`` for the mapped targets present in ``record``.

    Args:
        record: one row of the source.
        required: targets whose column must exist.
        optional: targets read only when their column exists.
        where: the source and row for messages, e.g. ``"train.jsonl row 3"``.
        overridable: mention ``fields.TARGET`` in the error (the column can be remapped).

    Raises:
        DataError: a required column is missing; the message names the target, the column, the
            source and the record's columns.

    """
    out: dict[str, object] = {}
    for target, column in required.items():
        if column not in record:
            fix = f"; map it with fields.{target} = COLUMN or unmap it with null" if overridable else ""
            raise DataError(
                f"{where}: field {target!r} is mapped to column {column!r}, which is missing; "
                f"columns: {', '.join(map(str, record)) or '(none)'}{fix}"
            )
        out[target] = record[column]
    for target, column in optional.items():
        if column in record and record[column] is not None:
            out[target] = record[column]
    return out


def as_text(value: object, target: str, where: str) -> str:
    """``value`` as a string: strings as they are, numbers and booleans written out, ``None`` as ``""``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | bool):
        return str(value)
    raise DataError(f"{where}: field {target!r} must be text, got {type(value).__name__}: {value!r:.80}")


def normalize_tests(value: object, where: str) -> list[object]:
    """Return tests as a list of assert strings or ``{"input", "output"}`` dicts.

    Accepts: such a list; a JSON string of one (CSV cells); one assert string; one
    ``{"input", "output"}`` dict; or the column form ``{"inputs": [...], "outputs": [...]}`` (APPS).

    Raises:
        DataError: anything else, or a dict test without ``input`` and ``output``.

    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = [value]  # e.g. an assert that starts with a list literal
        else:
            value = [value]
    if isinstance(value, Mapping):
        if "inputs" in value and "outputs" in value:
            pairs = zip(value["inputs"], value["outputs"], strict=True)  # type: ignore[call-overload]
            value = [{"input": i, "output": o} for i, o in pairs]
        else:
            value = [value]
    if not isinstance(value, list | tuple):
        raise DataError(f"{where}: tests must be a list of assert strings or input/output dicts, got {value!r:.80}")
    tests: list[object] = []
    for test in value:
        if isinstance(test, Mapping):
            if "input" not in test or "output" not in test:
                raise DataError(f"{where}: a dict test needs 'input' and 'output' keys, got {sorted(test)}")
            tests.append({"input": test["input"], "output": test["output"]})
        elif isinstance(test, str):
            tests.append(test)
        else:
            raise DataError(f"{where}: a test must be a string or an input/output dict, got {test!r:.80}")
    return tests
