r"""WordMathTask: formats, determinism, disjoint splits, the verifier and the `math` reward on it."""

import pytest

from posttrain.config import load_config
from posttrain.rewards.math import math_reward
from posttrain.tasks import TASKS, WordMathTask, make_task, split_of
from posttrain.tasks.word_math import INSTRUCTION, TEMPLATES


def _key(ex):
    f = ex.fields
    a, b = (min(f["a"], f["b"]), max(f["a"], f["b"])) if f["op"] in "+*" else (f["a"], f["b"])
    return f"word_math:{f['op']}:{a}:{b}"


def test_registered_and_built_by_name():
    assert TASKS["word_math"] is WordMathTask
    task = make_task("word_math", ops="+", max_number=20)
    assert (task.ops, task.max_number) == ("+", 20)
    assert load_config(None, ["task.name=word_math"]).task.name == "word_math"


def test_plain_hand_example():
    ex = WordMathTask().make_example(47, "+", 38)
    assert ex.prompt == "What is 47 + 38? Give the final answer in \\boxed{}."
    assert ex.answer == "85"
    assert ex.demonstration == "47 + 38 = 85. The answer is \\boxed{85}."
    assert dict(ex.fields) == {"a": 47, "op": "+", "b": 38, "result": 85}


def test_word_hand_examples():
    task = WordMathTask()
    sub = task.make_example(47, "-", 38, TEMPLATES["-"][0], "Ana")
    assert sub.prompt == (
        "Ana has 47 apples and gives 38 of them to a friend. How many apples does Ana have left? " + INSTRUCTION
    )
    assert (sub.answer, sub.demonstration) == ("9", "47 - 38 = 9. The answer is \\boxed{9}.")
    mul = task.make_example(7, "*", 8, TEMPLATES["*"][1])
    assert mul.prompt.startswith("A garden has 7 rows with 8 flowers in each row.")
    assert (mul.answer, mul.demonstration) == ("56", "7 × 8 = 56. The answer is \\boxed{56}.")


def test_deterministic_per_seed_and_prefix_stable():
    task = WordMathTask()
    a, b = task.examples("train", 50, seed=3), task.examples("train", 50, seed=3)
    assert a == b
    assert task.examples("train", 20, seed=3) == a[:20]
    assert task.examples("train", 50, seed=4) != a


def test_splits_are_disjoint_and_keyed_by_the_arithmetic():
    task = WordMathTask()
    train = task.examples("train", 2000, seed=0)
    test = task.examples("test", 300, seed=0)
    assert all(split_of(_key(ex)) == "train" for ex in train)
    assert all(split_of(_key(ex)) == "test" for ex in test)
    assert not {_key(ex) for ex in train} & {_key(ex) for ex in test}
    # the same problem phrased two ways stays in one split: 38 + 47 and 47 + 38 share a key
    assert _key(task.make_example(38, "+", 47)) == _key(task.make_example(47, "+", 38))


def test_mix_of_operators_and_styles_within_ranges():
    task = WordMathTask(max_number=50, max_factor=9)
    examples = task.examples("train", 600, seed=1)
    assert {ex.fields["op"] for ex in examples} == {"+", "-", "*"}
    plain = sum(ex.prompt.startswith("What is") for ex in examples)
    assert 200 < plain < 400  # plain_share = 0.5
    for ex in examples:
        f = ex.fields
        assert ex.prompt.endswith(INSTRUCTION)
        if f["op"] == "*":
            assert 2 <= f["a"] <= 9 and 2 <= f["b"] <= 9
        else:
            assert 1 <= f["a"] <= 50 and 1 <= f["b"] <= 50
        assert f["result"] >= 0 and str(f["result"]) == ex.answer
    only_word = WordMathTask(ops="-", plain_share=0.0).examples("train", 50, seed=0)
    assert not any(ex.prompt.startswith("What is") for ex in only_word)


def test_alphabet_covers_every_prompt_and_demonstration():
    task = WordMathTask()
    for ex in task.examples("train", 500, seed=0) + task.examples("test", 100, seed=0):
        assert set(ex.prompt + ex.demonstration) <= set(task.alphabet)


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("47 + 38 = 85. The answer is \\boxed{85}.", 1.0),
        ("\\boxed{85}", 1.0),
        ("\\boxed{85 \\text{ apples}}", 1.0),
        ("The total is \\boxed{85.0}", 1.0),
        ("47 + 38 = 85", 1.0),  # no box: the last number
        ("85", 1.0),
        ("\\boxed{84}", 0.0),
        ("\\boxed{85} no wait \\boxed{84}", 0.0),  # the last box counts
        ("47 + 38 = 84", 0.0),
        ("I think it is 85 or maybe 86", 0.0),
        ("\\boxed{}", 0.0),
        ("", 0.0),
        ("no idea", 0.0),
    ],
)
def test_verifier(completion, score):
    task = WordMathTask()
    assert task.verify(completion, task.make_example(47, "+", 38)) == score


def test_verifier_reads_thousands_and_negatives():
    task = WordMathTask(max_number=999)
    assert task.verify("\\boxed{1,085}", task.make_example(999, "+", 86)) == 1.0
    assert task.extract("it is -3") == "-3"


def test_math_reward_scores_demonstrations_one_and_wrong_answers_zero():
    task = WordMathTask()
    for ex in task.examples("test", 30, seed=0):
        assert math_reward(ex.prompt, ex.demonstration, answer=ex.answer) == 1.0
        assert task.verify(ex.demonstration, ex) == 1.0
        wrong = ex.demonstration.replace(f"\\boxed{{{ex.answer}}}", f"\\boxed{{{int(ex.answer) + 1}}}")
        assert math_reward(ex.prompt, wrong, answer=ex.answer) == 0.0
        assert task.verify(wrong, ex) == 0.0


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"ops": "/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"max_number": 1}, "max_number"),
        ({"max_factor": 2}, "max_factor"),
        ({"plain_share": 1.5}, "plain_share"),
    ],
)
def test_bad_params(params, match):
    with pytest.raises(ValueError, match=match):
        WordMathTask(**params)
