"""ArithmeticTask: formats, splits, alphabet, verification; and the task registry (make_task)."""

import itertools

import pytest

from posttrain.tasks import TASKS, ArithmeticTask, make_task, split_of, task_names

CONFIGS = [
    {"digits": d, "ops": ops, "reverse": rev, "steps": steps}
    for d, ops, rev, steps in itertools.product(range(1, 6), ["+", "*", "+*"], [True, False], [True, False])
]


def _value(text: str, reverse: bool) -> int:
    return int(text[::-1] if reverse else text)


# --- hand-computed formats ---------------------------------------------------------------------


def test_addition_reversed_hand_example():
    # 123 + 456 = 579; LSB-first: "321" + "654" -> "975"
    ex = ArithmeticTask(digits=3).make_example(123, "+", 456)
    assert (ex.prompt, ex.answer, ex.demonstration) == ("321+654=", "975", "975")
    assert dict(ex.fields) == {"a": 123, "op": "+", "b": 456, "result": 579}


def test_addition_steps_hand_example():
    # 58 + 67: column 0: 8+7+0 = 15 (write 5, carry 1); column 1: 5+6+1 = 12 (write 2, carry 1)
    # result 125 -> reversed "521"
    rev = ArithmeticTask(digits=2, steps=True).make_example(58, "+", 67)
    assert (rev.prompt, rev.demonstration, rev.answer) == ("85+76=", "15,12>521", "521")
    fwd = ArithmeticTask(digits=2, steps=True, reverse=False).make_example(58, "+", 67)
    assert (fwd.prompt, fwd.demonstration, fwd.answer) == ("58+67=", "15,12>125", "125")


def test_addition_steps_uneven_lengths():
    # 7 + 95: columns 7+5 = 12, 0+9+1 = 10 -> 102
    ex = ArithmeticTask(digits=2, min_digits=1, steps=True, reverse=False).make_example(7, "+", 95)
    assert ex.demonstration == "12,10>102"


def test_steps_share_keeps_the_scratchpad_in_that_share_of_the_problems():
    task = ArithmeticTask(digits=2, steps=True, steps_share=0.5)
    exs = task.examples("train", 2000, seed=0)
    with_pad = [ex for ex in exs if ">" in ex.demonstration]
    assert 0.45 < len(with_pad) / len(exs) < 0.55  # about half
    # a problem keeps its form, whichever order its operands come in; every demonstration verifies
    rev = task.make_example(67, "+", 58)
    assert task.make_example(58, "+", 67).demonstration in ("15,12>521", "521")
    assert (">" in rev.demonstration) == (">" in task.make_example(58, "+", 67).demonstration)
    assert all(task.verify(ex.demonstration, ex) == 1.0 for ex in exs)
    # the answer alone is 3 characters here, with its scratchpad 9: room for a length method to cut
    assert {len(ex.demonstration) for ex in exs if ">" not in ex.demonstration} <= {2, 3}
    assert ArithmeticTask(digits=2, steps=True, steps_share=0.0).make_example(58, "+", 67).demonstration == "521"
    assert ArithmeticTask(digits=2, steps=True, steps_share=1.0).make_example(58, "+", 67).demonstration == "15,12>521"
    with pytest.raises(ValueError, match="steps_share"):
        ArithmeticTask(digits=2, steps_share=1.5)
    with pytest.raises(ValueError, match="set steps=True"):
        ArithmeticTask(digits=2, steps_share=0.5)


def test_multiplication_steps_hand_example():
    # 12 * 34: partials 12*4 = 48 and 12*3*10 = 360; sum 408
    rev = ArithmeticTask(digits=2, ops="*", steps=True).make_example(12, "*", 34)
    assert (rev.prompt, rev.demonstration, rev.answer) == ("21*43=", "84,063>804", "804")
    fwd = ArithmeticTask(digits=2, ops="*", steps=True, reverse=False).make_example(12, "*", 34)
    assert (fwd.prompt, fwd.demonstration, fwd.answer) == ("12*34=", "48,360>408", "408")


def test_answer_keeps_no_padding():
    # 50 + 50 = 100 -> reversed "001" (reverse of str(100)); 0 * 7 = 0 -> "0"
    assert ArithmeticTask(digits=2).make_example(50, "+", 50).answer == "001"
    assert ArithmeticTask(digits=1, ops="*").make_example(0, "*", 7).answer == "0"


# --- every config: correctness, alphabet, demonstrations verify ---------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_examples_are_correct_and_demonstrations_verify(cfg):
    task = ArithmeticTask(**cfg)
    examples = task.examples("train", 500, seed=0)
    assert len(examples) == 500
    seen = set()
    for ex in examples:
        a_text, op, b_text = ex.prompt[:-1].partition(ex.fields["op"])
        assert ex.prompt.endswith("=") and op in cfg["ops"]
        a, b = _value(a_text, cfg["reverse"]), _value(b_text, cfg["reverse"])
        assert (a, b) == (ex.fields["a"], ex.fields["b"])
        assert len(str(a)) == len(str(b)) == cfg["digits"]
        assert _value(ex.answer, cfg["reverse"]) == (a + b if op == "+" else a * b)
        assert ex.demonstration.endswith(ex.answer)
        assert (">" in ex.demonstration) == cfg["steps"]
        assert task.verify(ex.demonstration, ex) == 1.0
        assert task.extract(ex.demonstration) == ex.answer
        seen.update(ex.prompt + ex.demonstration)
    # The alphabet is exact: everything seen is in it, and everything in it is seen.
    assert task.alphabet == "".join(sorted(set(task.alphabet)))
    assert "".join(sorted(seen)) == task.alphabet


def test_alphabet_is_small():
    assert ArithmeticTask(ops="+").alphabet == "+0123456789="
    assert ArithmeticTask(ops="*+", steps=True).alphabet == "*+,0123456789=>"
    assert ArithmeticTask(digits=1, steps=True).alphabet == "+0123456789=>"


def test_min_digits_spans_lengths():
    task = ArithmeticTask(digits=4, min_digits=2)
    lengths = {len(str(ex.fields[k])) for ex in task.examples("train", 500, 0) for k in ("a", "b")}
    assert lengths == {2, 3, 4}


def test_wrong_answers_score_zero():
    task = ArithmeticTask(digits=3, ops="+*", steps=True)
    for ex in task.examples("test", 100, seed=1):
        wrong = str(ex.fields["result"] + 1)
        wrong = wrong[::-1]
        assert task.verify(wrong, ex) == 0.0
        assert task.verify(ex.answer + "0", ex) == 0.0
        assert task.verify("", ex) == 0.0
        assert task.verify(ex.demonstration.replace(">", ">1"), ex) == 0.0


# --- extract -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("", None),
        ("   \n", None),
        ("no digits here", None),
        ("975", "975"),
        ("  975 \n", "975"),
        ("975abc", "975"),  # not all digits: the last digit run
        ("the answer is 975.", "975"),
        ("12 then 975", "975"),
        ("4,6,7>467", "467"),
        ("4,6,7>467 and junk 3", "467"),  # after the marker: the first digit run
        ("4,6,7> 467", "467"),
        ("1>2>467", "467"),  # the last marker wins
        ("4,6,7>", None),
        ("4,6,7>x", None),
    ],
)
def test_extract(completion, expected):
    assert ArithmeticTask(steps=True).extract(completion) == expected


def test_verify_strips_whitespace():
    task = ArithmeticTask(digits=3)
    ex = task.make_example(123, "+", 456)
    assert task.verify("  975\n", ex) == 1.0
    assert task.verify("9 75", ex) == 0.0


# --- splits ------------------------------------------------------------------------------------


def test_deterministic_and_seed_dependent():
    task = ArithmeticTask(digits=3, ops="+*")
    for split in ("train", "test"):
        assert task.examples(split, 50, seed=3) == task.examples(split, 50, seed=3)
        assert task.examples(split, 50, seed=3) != task.examples(split, 50, seed=4)
        assert task.examples(split, 20, seed=3) == task.examples(split, 50, seed=3)[:20]
    assert task.examples("train", 20, 0) != task.examples("test", 20, 0)


def _key(ex):
    a, b = ex.fields["a"], ex.fields["b"]
    return (ex.fields["op"], min(a, b), max(a, b))


@pytest.mark.parametrize("digits", [2, 3])
def test_train_test_disjoint(digits):
    task = ArithmeticTask(digits=digits, ops="+*")
    train = {_key(ex) for ex in task.examples("train", 3000, seed=0)}
    test = {_key(ex) for ex in task.examples("test", 1000, seed=0)}
    assert train and test and not train & test
    # Prompts too, in both operand orders (a+b and b+a are one problem).
    train_prompts = {ex.prompt for ex in task.examples("train", 3000, seed=0)}
    assert not train_prompts & {ex.prompt for ex in task.examples("test", 1000, seed=0)}
    for ex in task.examples("test", 200, seed=5):
        assert split_of(f"arithmetic:{_key(ex)[0]}:{_key(ex)[1]}:{_key(ex)[2]}") == "test"


def test_tiny_test_split_repeats():
    # 1-digit addition has 55 unordered problems, about 1 in 10 in test: n larger gives duplicates.
    task = ArithmeticTask(digits=1)
    test = task.examples("test", 200, seed=0)
    assert len(test) == 200 and len({ex.prompt for ex in test}) < 20


def test_about_one_in_ten_problems_is_test():
    keys = [f"arithmetic:+:{a}:{b}" for a in range(100) for b in range(a, 100)]
    share = sum(split_of(k) == "test" for k in keys) / len(keys)
    assert 0.08 < share < 0.12


def test_bad_arguments():
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="-")
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTask(digits=2, min_digits=3)
    with pytest.raises(ValueError, match="split"):
        ArithmeticTask().examples("valid", 1, 0)  # type: ignore[arg-type]


# --- registry ----------------------------------------------------------------------------------


def test_registry_names_and_make_task():
    assert task_names() == ["arithmetic", "countdown", "pycode", "reasoning_gym", "word_math"] == sorted(TASKS)
    task = make_task("arithmetic", digits=2, ops="+*")
    assert isinstance(task, ArithmeticTask) and task.name == "arithmetic"
    assert make_task("countdown").name == "countdown"


def test_make_task_unknown_name_lists_choices():
    with pytest.raises(ValueError, match=r"'arithmatic'.*arithmetic, countdown"):
        make_task("arithmatic")


def test_make_task_unknown_param_lists_accepted():
    with pytest.raises(ValueError, match=r"'digit'.*digits, ops, reverse, steps, min_digits"):
        make_task("arithmetic", digit=2)
    with pytest.raises(ValueError, match=r"'digits'.*num_numbers, max_number, max_target"):
        make_task("countdown", digits=2)


def test_boxed_answers_are_written_and_read_in_a_box():
    task = ArithmeticTask(digits=2, ops="+", reverse=False, steps=True, boxed=True)
    ex = task.make_example(58, "+", 67)
    # 8+7=15, 5+6+1=12 -> result 125
    assert ex.demonstration == "15,12>\\boxed{125}"
    assert set(ex.demonstration) <= set(task.alphabet)
    assert task.extract(ex.demonstration) == "125"
    assert task.verify(ex.demonstration, ex) == 1.0
    assert task.verify("15,12>125", ex) == 0.0  # no box: nothing to read
    assert task.verify("\\boxed{1}\\boxed{125}", ex) == 1.0  # the last box counts
    assert "boxed=True" in repr(task)


def test_hint_is_the_carries_or_the_result_length():
    # 58 + 67: column carries 1 (8+7=15), 1 (5+6+1=12): "11"; 12 + 34: no carries; 158 + 67: 1, 1, 0
    assert ArithmeticTask(digits=2).make_example(58, "+", 67).hint == "11"
    assert ArithmeticTask(digits=2).make_example(12, "+", 34).hint == "00"
    assert ArithmeticTask(digits=3).make_example(158, "+", 67).hint == "110"  # least-significant first
    assert ArithmeticTask(digits=3, reverse=False).make_example(158, "+", 67).hint == "011"  # as written
    assert ArithmeticTask(digits=2, ops="*").make_example(12, "*", 34).hint == "3"  # 408 has 3 digits
    task = ArithmeticTask(digits=3, ops="+*")
    assert all(ex.hint and set(ex.hint) <= set(task.alphabet) for ex in task.examples("train", 50, seed=0))
