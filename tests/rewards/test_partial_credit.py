"""`partial_answer`: digit-place credit for wrong answers, full credit only from the verifier."""

import pytest

from posttrain.rewards import score
from posttrain.rewards.partial_credit import answer_match, partial_answer
from posttrain.tasks import make_task


def test_answer_match_hand_examples():
    assert answer_match("579", "589", align="right") == pytest.approx(2 / 3)  # 5 and 9 in place
    assert answer_match("579", "579", align="left") == 1.0
    # "5790" vs "579": left-aligned 5,7,9 agree over the longer length 4 -> 3/4
    assert answer_match("5790", "579", align="left") == pytest.approx(3 / 4)
    # right-aligned: 0|9, 9|7, 7|5 disagree, 5 has no partner -> 0/4
    assert answer_match("5790", "579", align="right") == 0.0
    # "79" vs "579" right-aligned: 9=9, 7=7 -> 2/3; left-aligned: 7|5, 9|7 -> 0
    assert answer_match("79", "579", align="right") == pytest.approx(2 / 3)
    assert answer_match("79", "579", align="left") == 0.0
    assert answer_match("", "", align="left") == 0.0


def test_partial_answer_on_the_reversed_arithmetic_task():
    task = make_task("arithmetic", digits=3, ops="+", reverse=True)
    ex = task.make_example(163, "+", 706)  # 163 + 706 = 869, written least-significant first: "968"
    assert ex.answer == "968"
    kw = {"task": task, "example": ex}
    assert partial_answer("q", "968", **kw) == 1.0
    # "958": 9 and 8 in place of 3 (left-aligned, as the task writes units first) -> 0.5 * 2/3
    assert partial_answer("q", "958", **kw) == pytest.approx(1 / 3)
    # "9681": one extra digit -> 0.5 * 3/4; the verifier rejects it, so never 1
    assert partial_answer("q", "9681", **kw) == pytest.approx(0.375)
    assert partial_answer("q", "no digits", **kw) == 0.0
    # align overrides the task's order: right-aligned "058" vs "968": only the 8s line up -> 0.5 * 1/3
    assert partial_answer("q", "058", align="right", **kw) == pytest.approx(0.5 * 1 / 3)
    assert partial_answer("q", "958", weight=0.0, **kw) == 0.0  # weight 0: the binary verifier


def test_partial_answer_aligns_right_for_numbers_written_most_significant_first():
    task = make_task("arithmetic", digits=3, ops="+", reverse=False)
    ex = task.make_example(163, "+", 706)
    assert ex.answer == "869"
    # "69" is the answer missing its leading digit: 6 and 9 line up from the right -> 0.5 * 2/3
    assert partial_answer("q", "69", task=task, example=ex) == pytest.approx(1 / 3)


def test_a_wrong_answer_never_ties_a_correct_one():
    task = make_task("arithmetic", digits=3, ops="+", reverse=True)
    ex = task.make_example(999, "+", 999)  # 1998 -> "8991"
    best_wrong = max(partial_answer("q", c, task=task, example=ex) for c in ("8990", "89911", "899"))
    assert best_wrong < 1.0 and partial_answer("q", "8991", task=task, example=ex) == 1.0


@pytest.mark.parametrize("bad", [{"weight": 1.0}, {"weight": -0.1}, {"align": "middle"}])
def test_bad_parameters_are_errors(bad):
    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    ex = task.make_example(12, "+", 34)
    with pytest.raises(ValueError, match="partial_answer"):
        partial_answer("q", "64", task=task, example=ex, **bad)


def test_scored_through_the_registry_path():
    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    ex = task.make_example(12, "+", 34)  # 46 -> "64"
    # in 2 worker processes, as the loop scores; "60": 6 in place of 2 -> 0.5 * 1/2
    values = score("partial_answer", ["q", "q"], ["64", "60"], task=[task, task], example=[ex, ex])
    assert values == [1.0, 0.25]
