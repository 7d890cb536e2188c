r"""The ``task.dataset`` config section and :func:`load_task`, which turns it into a :class:`DatasetTask`.

.. code-block:: toml

    [task.dataset]
    path = "data/gsm8k_train.jsonl"      # or a save_to_disk directory, or "openai/gsm8k"
    test_path = "data/gsm8k_test.jsonl"
    preset = "gsm8k"
    system_prompt = "Reason step by step, then give the final answer as \\boxed{N}."

    [task.dataset.fields]                # override the preset's columns, or map a plain file
    prompt = "question"                  # text, or chat messages (data/chat.py: tools, chat_template_kwargs)
    hint = "hint"                        # extra targets become Example.fields (reward kwargs);
                                         # hint is also Example.hint (rollout.hint_reroll)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.data.chat import with_defaults
from posttrain.data.formats import get_preset, records_to_examples
from posttrain.data.readers import DataError, read_records
from posttrain.data.task import DatasetTask, split_by_hash
from posttrain.models.chat import RESERVED_TEMPLATE_KWARGS
from posttrain.tasks.base import Example

Scalar = int | float | str | bool


class DatasetSpec(BaseModel):
    """Where prompts come from and how their columns map to examples; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    path: str = Field(
        description="a data file (.jsonl, .json, .csv, .parquet), a directory written by "
        "Dataset.save_to_disk, a local data directory, or a Hugging Face hub dataset name"
    )
    subset: str | None = Field(None, description="the hub dataset's configuration, e.g. 'main' for openai/gsm8k")
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "disk", "datasets"] = Field(
        "auto", description="how to read path and test_path; auto: from the extension or directory layout"
    )
    preset: Literal["gsm8k", "math", "mbpp", "humaneval"] | None = Field(
        None, description="a known record format (columns, answer, demonstration, verifier); None: the field map"
    )
    split: str | None = Field(
        None, description="split of a save_to_disk / hub source for training (default 'train'); not for files"
    )
    test_path: str | None = Field(None, description="a separate source for the test split (same formats as path)")
    test_split: str | None = Field(
        None, description="split of path (or test_path) for the test split, e.g. 'test'; not for files"
    )
    fields: dict[str, str | None] = Field(
        {},
        description="target -> column, overriding the preset's: prompt, answer, demonstration, and any "
        "other target (tests, hint, ...) into Example.fields; a null column unmaps the target",
    )
    system_prompt: str | None = Field(
        None, description="system message put through the tokenizer's chat template (a messages row's own system "
        "message wins)"
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="OpenAI-style tool schemas given to the chat template (tools=) for every row; a row's own "
        "tools column replaces them"
    )
    chat_template_kwargs: dict[str, Scalar] = Field(
        {}, description="keyword arguments of the chat template for every row, e.g. {enable_thinking = false}; a "
        "row's own chat_template_kwargs column is merged over them"
    )
    test_fraction: float = Field(
        0.1, ge=0, lt=1, description="held-out fraction (by a stable hash of the prompt) when no test source is given"
    )
    verifier: str | None = Field(
        None, description="reward name that verify() calls; None: the preset's ('math', or 'code' for mbpp/humaneval)"
    )
    verifier_params: dict[str, Scalar | list[Scalar]] = Field({}, description="keyword parameters of the verifier")
    max_examples: int | None = Field(None, ge=1, description="read at most this many records from each source")
    train_prompts: str | None = Field(
        None,
        description="a JSONL file whose `prompt` values keep only those training examples (e.g. the top of "
        "`posttrain rank-prompts`, for 1-shot RLVR); the test split is unchanged",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Scalar]) -> dict[str, Scalar]:
        reserved = sorted(set(value) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"may not set {reserved}: posttrain sets them itself (tools: task.dataset.tools)")
        return value

    @property
    def has_test_source(self) -> bool:
        """Whether the test split is read from its own source (else it is held out by hash)."""
        return self.test_path is not None or self.test_split is not None


def load_task(spec: DatasetSpec) -> DatasetTask:
    """Read the sources of ``spec`` and build its task.

    With a test source, training prompts that also appear in the test source are dropped (counted
    in ``task.counts["train_overlap_dropped"]``). ``task.counts`` also holds the records read.

    Raises:
        FileNotFoundError: a missing file.
        posttrain.data.readers.DataError: an unreadable source or a missing mapped column.
        ImportError: a ``datasets`` source without the ``datasets`` package.

    """
    preset = get_preset(spec.preset)
    read = {"format": spec.format, "subset": spec.subset, "limit": spec.max_examples}
    chat = (spec.tools, spec.chat_template_kwargs)  # the data set's defaults (data/chat.py)
    examples = with_defaults(records_to_examples(
        read_records(spec.path, split=spec.split, **read), spec.preset, spec.fields, source=spec.path
    ), *chat)
    counts = {"records": len(examples)}
    if spec.has_test_source:
        test_source = spec.test_path or spec.path
        test = with_defaults(records_to_examples(
            read_records(test_source, split=spec.test_split, **read), spec.preset, spec.fields, source=test_source
        ), *chat)
        held_out = {ex.prompt for ex in test}
        train = [ex for ex in examples if ex.prompt not in held_out]
        counts |= {"test_records": len(test), "train_overlap_dropped": len(examples) - len(train)}
    else:
        train, test = split_by_hash(examples, spec.test_fraction)
    if spec.train_prompts is not None:
        train = keep_prompts(train, spec.train_prompts)
        counts["train_prompts_kept"] = len(train)
    task = DatasetTask(
        train,
        test,
        name=preset.name if spec.preset else Path(spec.path).stem or spec.path,
        verifier=spec.verifier or preset.verifier,
        verifier_params=spec.verifier_params,
        extract=preset.extract,
        system_prompt=spec.system_prompt,
    )
    task.counts.update(counts)
    return task


def keep_prompts(train: list[Example], path: str) -> list[Example]:
    """The training examples whose prompt is one of the ``prompt`` values of the JSONL file ``path``.

    Raises:
        FileNotFoundError: no such file.
        DataError: a line without a string ``prompt``, or no training example left (the file's
            prompts are all absent from the training split, e.g. held out as test prompts).

    """
    wanted: set[str] = set()
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        prompt = json.loads(line).get("prompt")
        if not isinstance(prompt, str):
            raise DataError(f"task.dataset.train_prompts: {path} line {i + 1} has no string 'prompt'")
        wanted.add(prompt)
    kept = [ex for ex in train if ex.prompt in wanted]
    if not kept:
        raise DataError(
            f"task.dataset.train_prompts: none of the {len(wanted)} prompts of {path} is a training example "
            f"of this dataset ({len(train)} training examples)"
        )
    return kept
