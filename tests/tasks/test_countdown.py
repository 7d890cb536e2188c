"""CountdownTask: generation, the safe expression parser, the rules verify() enforces, splits."""

import re
from fractions import Fraction

import pytest

from posttrain.tasks import CountdownTask, Example
from posttrain.tasks.countdown import ParseError, evaluate

CONFIGS = [
    {},
    {"num_numbers": 2, "max_number": 10, "max_target": 50},
    {"num_numbers": 4},
    {"num_numbers": 5, "max_number": 50, "max_target": 500},
]
PROMPT = re.compile(r"^(\d+(?:,\d+)*)>(\d+)=$")


def _example(numbers, target):
    nums = ",".join(map(str, numbers))
    return Example(f"{nums}>{target}=", "", "", {"numbers": tuple(numbers), "target": target})


# --- generation --------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_demonstrations_verify_and_match_prompt(cfg):
    task = CountdownTask(**cfg)
    for ex in task.examples("train", 500, seed=0):
        match = PROMPT.match(ex.prompt)
        assert match, ex.prompt
        numbers = tuple(int(x) for x in match.group(1).split(","))
        target = int(match.group(2))
        assert numbers == ex.fields["numbers"] and target == ex.fields["target"]
        assert len(numbers) == task.num_numbers and all(1 <= x <= task.max_number for x in numbers)
        assert 1 <= target <= task.max_target
        assert ex.demonstration == ex.answer
        assert task.verify(ex.demonstration, ex) == 1.0
        # The generator uses every number exactly once.
        _, used = evaluate(ex.answer)
        assert sorted(used) == sorted(numbers)


def test_alphabet_exact():
    task = CountdownTask()
    assert task.alphabet == "()*+,-/0123456789=>"
    seen = {c for ex in task.examples("train", 500, seed=0) for c in ex.prompt + ex.demonstration}
    assert "".join(sorted(seen)) == task.alphabet


def test_deterministic_and_seed_dependent():
    task = CountdownTask()
    for split in ("train", "test"):
        assert task.examples(split, 50, seed=7) == task.examples(split, 50, seed=7)
        assert task.examples(split, 50, seed=7) != task.examples(split, 50, seed=8)
        assert task.examples(split, 10, seed=7) == task.examples(split, 50, seed=7)[:10]


def test_train_test_disjoint():
    task = CountdownTask()

    def key(ex):
        return (tuple(sorted(ex.fields["numbers"])), ex.fields["target"])

    train = {key(ex) for ex in task.examples("train", 3000, seed=0)}
    test = {key(ex) for ex in task.examples("test", 1000, seed=0)}
    assert train and test and not train & test


def test_bad_arguments():
    for kwargs in ({"num_numbers": 1}, {"max_number": 0}, {"max_target": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            CountdownTask(**kwargs)


# --- parser ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value", "numbers"),
    [
        ("(7-3)*5+2", 22, [7, 3, 5, 2]),  # (4)*5+2 = 22
        ("2+3*4", 14, [2, 3, 4]),  # * binds tighter: 2+12
        ("8/2/2", 2, [8, 2, 2]),  # left-associative: (8/2)/2
        ("10-4-3", 3, [10, 4, 3]),  # (10-4)-3, not 10-(4-3) = 9
        ("3-7", -4, [3, 7]),  # negative results are fine
        (" ( 7 - 3 ) * 5 ", 20, [7, 3, 5]),  # spaces between tokens are skipped
        ("((12))", 12, [12]),
    ],
)
def test_evaluate(expression, value, numbers):
    assert evaluate(expression) == (Fraction(value), numbers)


@pytest.mark.parametrize(
    "expression",
    [
        "",
        "3+",
        "(3+4",
        "3+4)",
        "3++4",
        "-3+5",  # no unary minus
        "3 4",  # no spaces inside a number
        "03+4",  # no leading zeros
        "3.5+1",
        "2**3",
        "3/0",
        "4/(2-2)",
        "7/2",  # inexact division
        "1/2*4",  # inexact intermediate, though the value (2) is an integer
        "abs(3)",
        "\u0663+1",  # a non-ASCII digit
        "1+" * 200 + "1",  # too long
    ],
)
def test_evaluate_rejects(expression):
    with pytest.raises(ParseError):
        evaluate(expression)


def test_deep_parentheses_within_limit_do_not_recurse_out():
    assert evaluate("(" * 127 + "3" + ")" * 127)[0] == 3
    with pytest.raises(ParseError):
        evaluate("(" * 1000 + "3" + ")" * 1000)


# --- verify ------------------------------------------------------------------------------------


def test_verify_rules():
    task = CountdownTask()
    ex = _example([3, 5, 7], 22)
    assert task.verify("3*5+7", ex) == 1.0
    assert task.verify("7+3*5", ex) == 1.0  # any correct expression, not only the canonical one
    assert task.verify(" 3*5+7 \nexplanation", ex) == 1.0  # the first line only
    assert task.verify("3*5+7=22", ex) == 1.0  # a trailing "=..." is cut off
    assert task.verify("3*5+8", ex) == 0.0  # 8 is not given
    assert task.verify("3*5+7+0", ex) == 0.0  # nor is 0
    assert task.verify("5*5-3", ex) == 0.0  # 5 used twice (25-3 = 22)
    assert task.verify("3*5+6", ex) == 0.0
    assert task.verify("3*5+7)", ex) == 0.0  # parse error
    assert task.verify("", ex) == 0.0
    assert task.verify("hello", ex) == 0.0
    assert task.verify("\n3*5+7", ex) == 1.0  # leading blank lines are stripped


def test_verify_subsets_and_duplicates():
    task = CountdownTask()
    assert task.verify("3+5", _example([3, 5, 7], 8)) == 1.0  # a subset of >= 2 numbers is allowed
    assert task.verify("22", _example([22, 3, 5], 22)) == 0.0  # a single number is not
    assert task.verify("3*3+5", _example([3, 3, 5], 14)) == 1.0  # given twice, usable twice
    assert task.verify("3*3*3", _example([3, 3, 5], 27)) == 0.0  # but not three times


def test_verify_division_rules():
    task = CountdownTask()
    assert task.verify("4/2*1", _example([1, 2, 4], 2)) == 1.0
    assert task.verify("1/2*4", _example([1, 2, 4], 2)) == 0.0  # inexact intermediate: rejected
    assert task.verify("4/(2-2)", _example([2, 2, 4], 1)) == 0.0  # division by zero


def test_wrong_answers_score_zero():
    task = CountdownTask()
    for ex in task.examples("test", 200, seed=2):
        assert task.verify(f"({ex.answer})-1", ex) == 0.0  # target - 1
        assert task.verify(f"{ex.answer}*{ex.fields['numbers'][0]}", ex) == 0.0  # one number reused


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("", None),
        (" \n\n", None),
        ("=22", None),
        ("3*5+7", "3*5+7"),
        ("  3*5+7  \nmore text", "3*5+7"),
        ("3*5+7 = 22", "3*5+7"),
        ("garbage", "garbage"),  # extract returns text; verify() rejects it
    ],
)
def test_extract(completion, expected):
    assert CountdownTask().extract(completion) == expected
