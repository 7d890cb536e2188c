"""Field maps and presets (GSM8K, MATH, MBPP, HumanEval) on hand-written records."""

from __future__ import annotations

import pytest

from posttrain.data.fields import normalize_tests
from posttrain.data.formats import extract_code, extract_math, last_boxed, records_to_examples
from posttrain.data.readers import DataError

GSM8K = {
    "question": "Natalia sold clips to 48 friends in April, and then half as many in May. How many in all?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all she sold 48+24 = <<48+24=72>>72.\n#### 1,234",
}


def test_gsm8k_answer_after_hashes_without_commas():
    (ex,) = records_to_examples([GSM8K], "gsm8k")
    assert ex.prompt == GSM8K["question"]
    assert ex.answer == "1234"  # "#### 1,234": thousands comma removed
    # Calculator annotations go; the final answer is written as a box the math extractor reads.
    assert ex.demonstration == (
        "Natalia sold 48/2 = 24 clips in May.\nIn all she sold 48+24 = 72.\nThe final answer is \\boxed{1234}."
    )
    assert extract_math(ex.demonstration) == "1234"
    assert dict(ex.fields) == {}


def test_gsm8k_errors_name_the_record_and_accept_a_renamed_column():
    with pytest.raises(DataError, match=r"gsm.jsonl record 1: a gsm8k answer must end with '#### N'"):
        records_to_examples([GSM8K, {"question": "q", "answer": "no marker"}], "gsm8k", source="gsm.jsonl")
    (ex,) = records_to_examples([{"problem": "q?", "answer": "#### -7"}], "gsm8k", {"prompt": "problem"})
    assert (ex.prompt, ex.answer, ex.demonstration) == ("q?", "-7", "The final answer is \\boxed{-7}.")


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so $\boxed{\frac{1}{\sqrt{2}}}$.", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"\boxed{1} then \boxed{2}", "2"),  # the last box
        (r"$\boxed{\{1, 2\}}$", r"\{1, 2\}"),  # escaped braces do not count
        (r"\fbox{x^{2}}", "x^{2}"),
        (r"The answer is $\boxed 5$.", "5"),
        (r"\boxed{\frac{1}{2}", None),  # never closes
        ("no box here", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_math_preset_takes_the_last_box_and_optional_columns():
    record = {
        "problem": "Simplify $\\frac{2}{2\\sqrt{2}}$.",
        "solution": "We get $\\frac{1}{\\sqrt{2}}$, i.e. $\\boxed{\\frac{\\sqrt{2}}{2}}$.",
        "level": "Level 3",
        "type": "Algebra",
    }
    (ex,) = records_to_examples([record], "math")
    assert ex.answer == "\\frac{\\sqrt{2}}{2}"
    assert ex.demonstration == record["solution"]
    assert dict(ex.fields) == {"level": "Level 3", "subject": "Algebra"}
    # MATH-500 style: an explicit answer column wins over the box; missing optional columns are fine.
    (ex,) = records_to_examples([{"problem": "p", "solution": "\\boxed{0.5}", "answer": "\\frac12"}], "math")
    assert (ex.answer, dict(ex.fields)) == ("\\frac12", {})
    with pytest.raises(DataError, match="no \\\\boxed"):
        records_to_examples([{"problem": "p", "solution": "no box"}], "math")


MBPP = {
    "task_id": 2,
    "text": "Write a function to find the shared elements from the given two lists.",
    "code": "def similar_elements(a, b):\r\n    return tuple(sorted(set(a) & set(b)))",
    "test_list": [
        "assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
        "assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)",
    ],
    "test_setup_code": "",
    "challenge_test_list": [],
}


def test_mbpp_prompt_hints_the_function_and_tests_are_asserts():
    (ex,) = records_to_examples([MBPP], "mbpp")
    assert ex.prompt == MBPP["text"] + "\nYour code should pass this test:\n" + MBPP["test_list"][0]
    assert ex.fields["tests"] == MBPP["test_list"]
    code = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))"  # \r\n -> \n
    assert ex.answer == code
    assert ex.demonstration == f"```python\n{code}\n```"
    assert extract_code(ex.demonstration) == code
    scope: dict = {}
    exec(extract_code(ex.demonstration) + "\n" + "\n".join(ex.fields["tests"]), scope)  # the reference passes


def test_mbpp_setup_code_and_imports_are_prepended_to_each_test():
    record = {**MBPP, "test_setup_code": "K = 3", "test_imports": ["import math"]}
    record["test_list"] = ["assert math.floor(K + 0.5) == 3"]
    (ex,) = records_to_examples([record], "mbpp")
    assert ex.fields["tests"] == ["import math\nK = 3\nassert math.floor(K + 0.5) == 3"]
    assert ex.prompt.endswith("\nassert math.floor(K + 0.5) == 3")  # the hint shows the bare assert
    exec(ex.fields["tests"][0], {})


HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def test_humaneval_whole_function_demonstration_and_check_test():
    (ex,) = records_to_examples([HUMANEVAL], "humaneval")
    assert ex.fields["tests"] == [HUMANEVAL["test"] + "\ncheck(add)"]
    assert ex.fields["entry_point"] == "add"
    assert HUMANEVAL["prompt"] in ex.prompt and ex.prompt.startswith("Complete the following Python function")
    code = extract_code(ex.demonstration)
    assert code == (HUMANEVAL["prompt"] + HUMANEVAL["canonical_solution"]).strip("\n")
    exec(code + "\n" + ex.fields["tests"][0], {})  # runs on its own and passes


def test_generic_field_map_extra_fields_and_unmapping():
    records = [{"q": "2+2=", "a": 4, "h": "even", "t": '["assert f() == 4"]', "id": 9}]
    (ex,) = records_to_examples(records, None, {"prompt": "q", "answer": "a", "hint": "h", "tests": "t"})
    assert (ex.prompt, ex.answer, ex.demonstration) == ("2+2=", "4", "4")  # demonstration defaults to answer
    assert dict(ex.fields) == {"hint": "even", "tests": ["assert f() == 4"]}  # JSON cell parsed; id unmapped
    (ex,) = records_to_examples([{"prompt": "p", "sol": "s"}], None, {"answer": None, "demonstration": "sol"})
    assert (ex.answer, ex.demonstration) == ("", "s")


def test_missing_mapped_field_names_field_column_source_and_columns():
    with pytest.raises(DataError) as err:
        records_to_examples([{"question": "q", "solution": "s"}], None, {"prompt": "question"}, source="x.csv")
    msg = str(err.value)
    assert "x.csv record 0" in msg
    assert "field 'answer' is mapped to column 'answer', which is missing" in msg
    assert "columns: question, solution" in msg
    assert "fields.answer" in msg
    with pytest.raises(DataError, match="column 'test_list'.*columns: text, code"):
        records_to_examples([{"text": "t", "code": "c"}], "mbpp")
    with pytest.raises(DataError, match="prompt cannot be null"):
        records_to_examples([{"prompt": "p"}], None, {"prompt": None})
    with pytest.raises(DataError, match="unknown data preset 'gsm'.*gsm8k, math, mbpp, humaneval"):
        records_to_examples([], "gsm")
    with pytest.raises(DataError, match="field 'prompt' must be text, got dict"):
        records_to_examples([{"prompt": {"role": "user"}, "answer": "a"}])
    with pytest.raises(DataError, match="record 0: the messages need a final user turn with text content"):
        records_to_examples([{"prompt": [{"role": "user"}], "answer": "a"}])  # a list is chat messages (data/chat.py)


def test_normalize_tests_shapes():
    io = [{"input": "1\n", "output": "2\n"}]
    assert normalize_tests(io, "w") == io
    assert normalize_tests({"inputs": ["1\n", "3\n"], "outputs": ["2\n", "4\n"]}, "w") == [
        {"input": "1\n", "output": "2\n"},
        {"input": "3\n", "output": "4\n"},
    ]
    assert normalize_tests("assert f(1) == 2", "w") == ["assert f(1) == 2"]
    assert normalize_tests('[{"input": "a", "output": "b", "extra": 1}]', "w") == [{"input": "a", "output": "b"}]
    with pytest.raises(DataError, match="needs 'input' and 'output'"):
        normalize_tests([{"stdin": "1"}], "w")
    with pytest.raises(DataError, match="a test must be a string"):
        normalize_tests([3], "w")


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("so \\boxed{ 42 }", "42"),
        ("The answer is 1,234.", "1,234"),  # as written; math-verify judges 1,234 = 1234
        ("3 apples and 5 pears: 8", "8"),
        ("-2.5 degrees", "-2.5"),
        ("no number", None),
    ],
)
def test_extract_math(completion, answer):
    assert extract_math(completion) == answer


def test_extract_code_reads_like_the_code_reward():
    # the last python-tagged block wins over a later untagged one (the code reward's rule)
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```\ny = 2\n```") == "x = 1"
    assert extract_code("```\nx = 1\n```\n```\ny = 2\n```") == "y = 2"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1"
    assert extract_code("   \n") is None


def test_a_mapped_hint_column_becomes_example_hint():
    records = [{"q": "2+2=", "a": 4, "h": "even"}, {"q": "3+3=", "a": 6, "h": None}]
    with_hint, without = records_to_examples(records, None, {"prompt": "q", "answer": "a", "hint": "h"})
    assert with_hint.hint == "even" and with_hint.fields["hint"] == "even"  # HINT's re-roll reads Example.hint
    assert without.hint is None  # a null cell: no hint for that example
    assert records_to_examples([{"question": "q", "answer": "r\n#### 1"}], "gsm8k")[0].hint is None
