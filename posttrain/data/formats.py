r"""Format presets: a default field map, a transform to :class:`Example`, a verifier and an extractor.

=============  =======================================================  =============  ========
preset         columns (default field map)                              answer         verifier
=============  =======================================================  =============  ========
(none)         prompt, answer (demonstration = answer unless mapped)    ``answer``     ``math``
``gsm8k``      question, answer (reasoning, then ``#### N``)            N, no commas   ``math``
``math``       problem, solution (+ answer, level, type if present)     last \boxed{}  ``math``
``mbpp``       text, test_list, code (+ test_setup_code, test_imports)  the code       ``code``
``humaneval``  prompt, canonical_solution, test, entry_point            the code       ``code``
=============  =======================================================  =============  ========

Demonstrations (what SFT trains on):

* ``gsm8k``: the reasoning with the calculator annotations ``<<48/2=24>>`` removed, then
  ``The final answer is \boxed{N}.`` (the form the math reward and :func:`extract_math` read).
* ``math``: the reference solution, which already ends in ``\boxed{...}``.
* ``mbpp``: the reference code in a ```` ```python ```` block (``\r\n`` made ``\n``).
* ``humaneval``: the whole function, ``prompt + canonical_solution`` (the stub with its
  docstring, then the body), in a ```` ```python ```` block, so the block runs on its own. The body
  alone would not define the function the tests call.

Prompts: ``gsm8k`` and ``math`` use the question as it is. ``mbpp`` appends the first test
(``Your code should pass this test:\n<assert>``), which names the function to write. ``humaneval``
puts the stub in a code block after :data:`HUMANEVAL_INSTRUCTION`.

Tests (``Example.fields["tests"]``, the code reward's ``tests=``): ``mbpp`` keeps ``test_list``
with the setup code / imports prepended to each assert; ``humaneval`` has one test, the
``check(candidate)`` definition followed by ``check(entry_point)``.

A mapped ``hint`` column (``fields = {hint = "abstract_hint"}``) also becomes ``Example.hint``, the
text HINT's re-roll appends to the prompt (``rollout.hint_reroll``); it stays in ``Example.fields``
too. An empty or null cell means no hint for that example.

A prompt column may hold chat ``messages`` instead of text, and the ``tools`` and
``chat_template_kwargs`` columns configure the chat template (``posttrain.data.chat``).

A user field map overrides a preset's defaults target by target (see
:func:`posttrain.data.fields.merge_fields`): a GSM8K-like file whose question column is
``problem`` takes ``preset="gsm8k", fields={"prompt": "problem"}``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from posttrain.data.chat import DEFAULT_CHAT_COLUMNS, attach_chat, split_chat
from posttrain.data.fields import EXAMPLE_TARGETS, as_text, map_record, merge_fields, normalize_tests
from posttrain.data.readers import DataError, Record
from posttrain.rewards.code import extract_program
from posttrain.rewards.math import extract_answer, last_boxed
from posttrain.tasks.base import Example

HUMANEVAL_INSTRUCTION = "Complete the following Python function and return the whole function in a code block."
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def extract_math(completion: str) -> str | None:
    r"""The final answer of a math completion (the ``math`` reward's reading: the last
    ``\boxed{}``, else a final-answer marker, else math-verify's extraction when the text has LaTeX
    math, else the last number); ``None`` if there is none.
    """
    return extract_answer(completion)


def extract_code(completion: str) -> str | None:
    """The program in a code completion (the ``code`` reward's reading); ``None`` if it is empty."""
    return extract_program(completion).strip("\n").rstrip() or None


def fence(code: str) -> str:
    """``code`` in a ```` ```python ```` block."""
    return f"```python\n{code.strip(chr(10))}\n```"


def _extras(mapped: Mapping[str, object], where: str, skip: Sequence[str] = ()) -> dict[str, object]:
    """The non-Example targets, with ``tests`` normalized."""
    out = {k: v for k, v in mapped.items() if k not in EXAMPLE_TARGETS and k not in skip}
    if "tests" in out:
        out["tests"] = normalize_tests(out["tests"], where)
    return out


def build_generic(mapped: Mapping[str, object], where: str) -> Example:
    """Prompt, answer and demonstration as mapped (demonstration defaults to the answer)."""
    answer = as_text(mapped.get("answer"), "answer", where)
    demo = as_text(mapped["demonstration"], "demonstration", where) if "demonstration" in mapped else answer
    prompt = as_text(mapped["prompt"], "prompt", where)
    return Example(prompt=prompt, answer=answer, demonstration=demo, fields=_extras(mapped, where))


def build_gsm8k(mapped: Mapping[str, object], where: str) -> Example:
    """GSM8K: ``answer`` holds the reasoning, then ``#### N``; the answer is N without commas."""
    raw = as_text(mapped["answer"], "answer", where)
    if "####" not in raw:
        raise DataError(f"{where}: a gsm8k answer must end with '#### N', got {raw[-80:]!r}")
    reasoning, final = raw.rsplit("####", 1)
    answer = final.strip().replace(",", "")
    reasoning = _CALCULATOR.sub("", reasoning).strip()
    boxed = f"The final answer is \\boxed{{{answer}}}."
    return Example(
        prompt=as_text(mapped["prompt"], "prompt", where),
        answer=answer,
        demonstration=f"{reasoning}\n{boxed}" if reasoning else boxed,
        fields=_extras(mapped, where),
    )


def build_math(mapped: Mapping[str, object], where: str) -> Example:
    """Hendrycks MATH: the answer is an ``answer`` column if present, else the solution's last box."""
    solution = as_text(mapped["demonstration"], "demonstration", where)
    answer = as_text(mapped["answer"], "answer", where) if "answer" in mapped else last_boxed(solution)
    if answer is None:
        raise DataError(f"{where}: no \\boxed{{...}} answer in the solution {solution[-80:]!r}")
    return Example(
        prompt=as_text(mapped["prompt"], "prompt", where),
        answer=answer.strip(),
        demonstration=solution,
        fields=_extras(mapped, where),
    )


def build_mbpp(mapped: Mapping[str, object], where: str) -> Example:
    """MBPP: the task text plus its first test; tests get the setup code and imports prepended."""
    asserts = normalize_tests(mapped["tests"], where)
    if not asserts:
        raise DataError(f"{where}: an mbpp record needs at least one test")
    imports = mapped.get("test_imports") or []
    setup_parts = [*(imports if isinstance(imports, list) else [imports]), mapped.get("test_setup") or ""]
    setup = "\n".join(as_text(s, "test_setup", where) for s in setup_parts if s)
    tests = [f"{setup}\n{t}" if setup and isinstance(t, str) else t for t in asserts]
    code = as_text(mapped["demonstration"], "demonstration", where).replace("\r\n", "\n")
    first = asserts[0] if isinstance(asserts[0], str) else f"input {asserts[0]['input']!r}"  # type: ignore[index]
    text = as_text(mapped["prompt"], "prompt", where).strip()
    return Example(
        prompt=f"{text}\nYour code should pass this test:\n{first}",
        answer=code,
        demonstration=fence(code),
        fields={**_extras(mapped, where, skip=("test_imports", "test_setup")), "tests": tests},
    )


def build_humaneval(mapped: Mapping[str, object], where: str) -> Example:
    """HumanEval: the stub in a code block; one test, ``check`` then ``check(entry_point)``."""
    stub = as_text(mapped["prompt"], "prompt", where)
    entry = as_text(mapped["entry_point"], "entry_point", where)
    code = stub + as_text(mapped["demonstration"], "demonstration", where)
    test = as_text(mapped["test"], "test", where)
    return Example(
        prompt=f"{HUMANEVAL_INSTRUCTION}\n{fence(stub)}",
        answer=code,
        demonstration=fence(code),
        fields={**_extras(mapped, where, skip=("test",)), "tests": [f"{test}\ncheck({entry})"]},
    )


@dataclass(frozen=True)
class Preset:
    """A named source format: its columns, transform, default verifier and answer extractor."""

    name: str
    build: Callable[[Mapping[str, object], str], Example]
    required: Mapping[str, str]
    optional: Mapping[str, str] = field(default_factory=dict)
    verifier: str = "math"
    extract: Callable[[str], str | None] = extract_math


PRESETS: dict[str | None, Preset] = {
    None: Preset("dataset", build_generic, {"prompt": "prompt", "answer": "answer"}),
    "gsm8k": Preset("gsm8k", build_gsm8k, {"prompt": "question", "answer": "answer"}),
    "math": Preset(
        "math",
        build_math,
        {"prompt": "problem", "demonstration": "solution"},
        {"answer": "answer", "level": "level", "subject": "type"},
    ),
    "mbpp": Preset(
        "mbpp",
        build_mbpp,
        {"prompt": "text", "tests": "test_list", "demonstration": "code"},
        {"test_setup": "test_setup_code", "test_imports": "test_imports"},
        verifier="code",
        extract=extract_code,
    ),
    "humaneval": Preset(
        "humaneval",
        build_humaneval,
        {"prompt": "prompt", "demonstration": "canonical_solution", "test": "test", "entry_point": "entry_point"},
        verifier="code",
        extract=extract_code,
    ),
}


def get_preset(name: str | None) -> Preset:
    """The preset called ``name`` (``None``: the generic field map)."""
    if name not in PRESETS:
        choices = ", ".join(str(k) for k in PRESETS if k is not None)
        raise DataError(f"unknown data preset {name!r}; choices: {choices} (or none)")
    return PRESETS[name]


def records_to_examples(
    records: Sequence[Record],
    preset: str | None = None,
    fields: Mapping[str, str | None] | None = None,
    source: str = "",
) -> list[Example]:
    """Turn records into examples through ``preset`` with the field overrides ``fields``.

    Raises:
        DataError: a missing column (naming it, the source and the columns a record has) or a
            record the preset cannot read (naming the record's index).

    """
    p = get_preset(preset)
    required, optional = merge_fields(p.required, {**DEFAULT_CHAT_COLUMNS, **p.optional}, fields or {})
    out = []
    for i, record in enumerate(records):
        where = f"{source or 'data'} record {i}"
        row, chat = split_chat(map_record(record, required, optional, where), where)  # a messages prompt: data/chat.py
        ex = p.build(row, where)
        hint = as_text(row.get("hint"), "hint", where)
        out.append(attach_chat(replace(ex, hint=hint) if hint else ex, chat))
    return out
