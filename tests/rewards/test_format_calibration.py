"""Format reward and tag helpers; RLCR calibration reward with the catalog's worked numbers (L143)."""

import pytest

from posttrain.rewards.calibration import calibration_reward, parse_confidence
from posttrain.rewards.format import extract_tag, format_reward, has_tags
from posttrain.rewards.registry import REGISTRY

# ---------------------------------------------------------------------------------------------
# format


def test_extract_tag():
    assert extract_tag("<answer> 5 </answer>", "answer") == "5"
    assert extract_tag("<answer>1</answer> no, <answer>2\n</answer>", "answer") == "2"  # the last
    assert extract_tag("<answer>\nmulti\nline\n</answer>", "answer") == "multi\nline"
    assert extract_tag("<answer>unclosed", "answer") is None
    assert extract_tag("nothing", "answer") is None
    assert extract_tag("<answer></answer>", "answer") == ""


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>reason</think><answer>5</answer>", 1.0),
        ("<think>\nstep 1\nstep 2\n</think>\n<answer>\n5\n</answer>\n", 1.0),
        ("  <think></think> <answer>5</answer>", 1.0),
        ("<answer>5</answer>", 0.0),  # no think block
        ("<answer>5</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>5</answer> trailing text", 0.0),  # only whitespace outside
        ("preamble <think>x</think><answer>5</answer>", 0.0),
        ("<think>x</think><answer>5</answer><answer>6</answer>", 0.0),  # a second answer block
        ("<think>x<think>y</think><answer>5</answer>", 0.0),  # a nested tag
        ("<think>x</think><answer>5", 0.0),  # truncated
        ("", 0.0),
    ],
)
def test_format_default_r1(completion, expected):
    assert format_reward("q", completion) == expected


def test_format_pattern_is_a_full_match_with_dotall():
    pat = r"<think>.*?</think>\s*<answer>\d+</answer>"
    assert format_reward("q", "<think>a\nb</think>\n<answer>42</answer>", pattern=pat) == 1.0
    assert format_reward("q", "<think>a</think><answer>x</answer>", pattern=pat) == 0.0
    assert format_reward("q", "<think>a</think><answer>42</answer>!", pattern=pat) == 0.0  # full match


def test_format_tags():
    tags = ["answer", "analysis", "confidence"]
    good = "reasoning...</think> <answer>5</answer> <analysis>sure</analysis> <confidence>0.9</confidence>"
    assert format_reward("q", good, tags=tags) == 1.0  # text around the blocks is allowed
    assert format_reward("q", "<answer>5</answer><confidence>0.9</confidence>", tags=tags) == 0.0  # missing
    swapped = "<analysis>a</analysis><answer>5</answer><confidence>0.9</confidence>"
    assert format_reward("q", swapped, tags=tags) == 0.0  # order
    twice = "<answer>5</answer><answer>6</answer><analysis>a</analysis><confidence>1</confidence>"
    assert format_reward("q", twice, tags=tags) == 0.0  # each exactly once
    assert not has_tags("<a><b></a></b>", ["a", "b"])  # overlapping blocks
    assert not has_tags("</a><a>", ["a"])  # closed before opened
    assert has_tags("", [])


def test_format_bad_params():
    with pytest.raises(ValueError, match="not both"):
        format_reward("q", "x", pattern=".*", tags=["a"])
    with pytest.raises(TypeError, match="list of tag names"):
        format_reward("q", "x", tags="answer")


# ---------------------------------------------------------------------------------------------
# calibration


@pytest.mark.parametrize(
    ("text", "q"),
    [
        ("<confidence>0.8</confidence>", 0.8),
        ("<confidence> .8 </confidence>", 0.8),
        ("<confidence>1</confidence>", 1.0),
        ("<confidence>0</confidence>", 0.0),
        ("<confidence>80%</confidence>", 0.8),  # an explicit percent sign is accepted
        ("<confidence>100 %</confidence>", 1.0),
        ("<confidence>0.2</confidence> later <confidence>0.7</confidence>", 0.7),  # the last
        ("<confidence>80</confidence>", None),  # out of [0, 1]: rejected, not rescaled
        ("<confidence>150%</confidence>", None),
        ("<confidence>1.01</confidence>", None),
        ("<confidence>-0.1</confidence>", None),
        ("<confidence>nan</confidence>", None),
        ("<confidence>high</confidence>", None),
        ("<confidence>0.8 or 0.9</confidence>", None),
        ("<confidence></confidence>", None),
        ("confidence: 0.8", None),  # tags only
        ("", None),
    ],
)
def test_parse_confidence(text, q):
    got = parse_confidence(text)
    assert got == (pytest.approx(q) if q is not None else None)


def _rlcr(answer: str, q: str) -> str:
    """A completion in RLCR's math layout (tabc)."""
    return (
        f"<think>work</think>\n<answer>{answer}</answer>\n<analysis>checked twice</analysis>\n"
        f"<confidence>{q}</confidence>"
    )


# catalog L143, (c, q) -> paper R / code R with a valid format:
#   paper: R = c - (q - c)^2           code: R = 0.5*1 + 0.5*c + 0.5*(1 - (c - q)^2)
#   (1, 0.8): 1 - 0.04  = 0.96         0.5 + 0.5 + 0.5*0.96 = 1.48
#   (0, 0.8): 0 - 0.64  = -0.64        0.5 + 0   + 0.5*0.36 = 0.68
#   (1, 0.3): 1 - 0.49  = 0.51         0.5 + 0.5 + 0.5*0.51 = 1.255
#   (0, 0.1): 0 - 0.01  = -0.01        0.5 + 0   + 0.5*0.99 = 0.995
CATALOG = [(1, 0.8, 0.96, 1.48), (0, 0.8, -0.64, 0.68), (1, 0.3, 0.51, 1.255), (0, 0.1, -0.01, 0.995)]


@pytest.mark.parametrize(("c", "q", "paper", "code"), CATALOG)
def test_catalog_numbers(c, q, paper, code):
    completion = _rlcr(r"\frac{1}{2}" if c else "3", str(q))  # gold 0.5: right, or wrong
    assert calibration_reward("p", completion, answer="0.5") == pytest.approx(paper)
    assert calibration_reward("p", completion, answer="0.5", form="code") == pytest.approx(code)


def test_correctness_sources():
    # a \boxed{} inside the answer tag; no answer tag at all (paper form: extract_answer)
    assert calibration_reward("p", _rlcr(r"so \boxed{2}", "1"), answer="2") == pytest.approx(1.0)
    assert calibration_reward("p", r"I think \boxed{2}. <confidence>0.5</confidence>", answer="2") == 0.75
    # code form needs the tag layout: no answer tag fails the format (RLCR's code: R = 0)
    assert calibration_reward("p", r"\boxed{2} <confidence>0.5</confidence>", answer="2", form="code") == 0.0
    # nothing that looks like an answer: wrong, confidence still scored (0 - 0.3^2)
    assert calibration_reward("p", "no idea <confidence>0.3</confidence>", answer="2") == pytest.approx(-0.09)
    assert calibration_reward("p", _rlcr("2", "0.5")) is None  # no gold


@pytest.mark.parametrize("form", ["paper", "code"])
def test_on_parse_failure(form):
    no_conf = "<think>w</think><answer>2</answer><analysis>a</analysis>"
    bad_conf = _rlcr("2", "80")  # out of range
    for completion in (no_conf, bad_conf):
        # zero_confidence: paper R = c - (0 - c)^2 = 1 - 1 = 0; code: format, accuracy, brier all 0
        assert calibration_reward("p", completion, answer="2", form=form) == 0.0
        assert calibration_reward("p", completion, answer="2", form=form, on_parse_failure="none") is None
        assert calibration_reward("p", completion, answer="2", form=form, on_parse_failure="penalty") == -1.0
        got = calibration_reward("p", completion, answer="2", form=form, on_parse_failure="penalty", penalty=-2)
        assert got == -2.0


def test_zero_confidence_never_beats_stating_q():
    # paper form: omitting q scores 0; a correct answer with any q scores >= 0, a wrong one at q = 0 scores 0
    omitted = calibration_reward("p", "<answer>2</answer>", answer="2")
    for q in (0.0, 0.3, 0.7, 1.0):
        assert calibration_reward("p", _rlcr("2", str(q)), answer="2") >= omitted
    assert calibration_reward("p", _rlcr("3", "0"), answer="2") == omitted == 0.0


def test_code_form_format_tags_param():
    completion = "<answer>2</answer><confidence>0.9</confidence>"  # no analysis block
    assert calibration_reward("p", completion, answer="2", form="code") == 0.0
    # 0.5 + 0.5 + 0.5 * (1 - 0.01) = 1.495
    got = calibration_reward("p", completion, answer="2", form="code", format_tags=["answer", "confidence"])
    assert got == pytest.approx(1.495)


def test_bad_params_and_registry():
    with pytest.raises(ValueError, match="form"):
        calibration_reward("p", "x", answer="1", form="brier")
    with pytest.raises(ValueError, match="on_parse_failure"):
        calibration_reward("p", "x", answer="1", on_parse_failure="skip")
    assert REGISTRY.get("calibration") is calibration_reward
    assert REGISTRY.get("format") is format_reward
