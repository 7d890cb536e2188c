r"""Math reward on LaTeX answers (issue 15): a completion whose answer is a ``$...$`` span is read by
math-verify's own extraction (LaTeX + expression configs), not as the last number inside the span."""

import signal
import threading
import time

import pytest

import posttrain.rewards.math as math_mod
from posttrain.rewards.math import extract_answer, math_reward

# (completion, gold, reward)
CASES = [
    (r"$\frac{6}{8}$", r"\frac{3}{4}", 1.0),  # read as 6/8, not as the last number 8
    (r"The answer is $\frac{1}{2}$.", "0.5", 1.0),
    (r"\boxed{42}", "42", 1.0),
    ("so 7 + 5 = 12", "12", 1.0),  # plain text: the last number, as before
    (r"$\frac{2}{3}$", r"\frac{3}{4}", 0.0),  # a wrong LaTeX answer
    (r"\(\frac{6}{8}\)", r"\frac{3}{4}", 1.0),
    (r"\[ \frac{6}{8} \]", r"\frac{3}{4}", 1.0),
    (r"$$\frac{6}{8}$$", r"\frac{3}{4}", 1.0),
    (r"so we get $x = \frac{6}{8}$", r"\frac{3}{4}", 1.0),
    (r"the roots are $\{1,2\}$", r"\{2,1\}", 1.0),  # not the last number 2 alone
    (r"so $\sqrt{16}$", "4", 1.0),  # not 16
    (r"We have $x = 2$ and $y = 3$, so the sum is 5.", "5", 1.0),  # a plain number after the LaTeX wins
    ("It costs $5 and $7, total 12", "12", 1.0),  # dollar signs as currency
]


@pytest.mark.parametrize(("completion", "gold", "reward"), CASES)
def test_latex_answer_reward(completion, gold, reward):
    assert math_reward("q", completion, answer=gold) == reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"$\frac{6}{8}$", r"\frac{6}{8}"),
        (r"so $\sqrt{16}$", r"\sqrt{16}"),
        (r"\(x=3\)", "x=3"),
        (r"Let $n$ be 5. Then $n+1 = 6$. I think 7.", "7"),  # the rightmost answer wins
        (r"first $a$, then $b^2$", "b^2"),
        # the rightmost span does not parse: math-verify reads nothing, so the last number
        (r"So $\frac{3}{4}$ and then $\frac{1}{$ oops", "1"),
        (r"price \$5 so 12", "12"),  # an escaped dollar is not math
        (r"\boxed{3} and $\frac{6}{8}$", "3"),  # a box still comes first
        ("Answer: 5 cm.\nCheck: $\\frac{10}{2}$", "5 cm"),  # a marker still comes first
    ],
)
def test_extract_latex_answer(text, expected):
    assert extract_answer(text) == expected


def test_extraction_is_inside_the_time_limit(monkeypatch):
    # a math-verify extraction that never returns: the reward stops at its limit like any hang
    def spin(text):
        while True:
            pass

    monkeypatch.setattr(math_mod, "_math_verify_answer", spin)
    t0 = time.monotonic()
    assert math_reward("q", r"$\frac{6}{8}$", answer=r"\frac34", timeout_s=0.3) is None
    assert time.monotonic() - t0 < 2.0
    # extract_answer on its own falls back to the hand-written reading
    t0 = time.monotonic()
    assert extract_answer(r"$\frac{6}{8}$", timeout_s=0.3) == "8"
    assert time.monotonic() - t0 < 2.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_latex_answer_in_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("q", r"$\frac{6}{8}$", answer=r"\frac{3}{4}")))
    t.start()
    t.join(60)
    assert out == [1.0]
