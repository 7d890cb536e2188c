r"""Prompts from data: JSONL / JSON / CSV / Parquet files, ``datasets`` directories or hub names.

``load_task(DatasetSpec(path="gsm8k.jsonl", preset="gsm8k"))`` reads the records
(:mod:`~posttrain.data.readers`), maps their columns to :class:`~posttrain.tasks.base.Example`\ s
(:mod:`~posttrain.data.fields`, :mod:`~posttrain.data.formats`: GSM8K, MATH, MBPP, HumanEval) and
returns a :class:`DatasetTask` (:mod:`~posttrain.data.task`) that the trainer uses like a built-in
task: ``examples(split, n, seed)``, ``extract``, ``verify``, ``alphabet``.
"""

from __future__ import annotations

from posttrain.data.fields import FieldMap, normalize_tests
from posttrain.data.formats import PRESETS, Preset, extract_code, extract_math, last_boxed, records_to_examples
from posttrain.data.readers import FORMATS, DataError, detect_format, read_records
from posttrain.data.spec import DatasetSpec, load_task
from posttrain.data.task import DatasetTask, filter_by_length, split_by_hash

__all__ = [
    "FORMATS",
    "PRESETS",
    "DataError",
    "DatasetSpec",
    "DatasetTask",
    "FieldMap",
    "Preset",
    "detect_format",
    "extract_code",
    "extract_math",
    "filter_by_length",
    "last_boxed",
    "load_task",
    "normalize_tests",
    "read_records",
    "records_to_examples",
    "split_by_hash",
]
