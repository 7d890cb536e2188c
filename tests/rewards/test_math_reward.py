"""Math reward: answer extraction, math-verify equivalences (and its known limits), timeouts in
worker processes and threads."""

import multiprocessing as mp
import signal
import sys
import threading
import time

import pytest

from posttrain.rewards.math import (
    _call_with_time_limit,
    extract_answer,
    last_boxed,
    math_equal,
    math_reward,
    math_verdict,
)
from posttrain.rewards.registry import REGISTRY

# ---------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so x = \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"first \boxed{1}, finally \boxed{2}", "2"),  # the last box
        (r"\fbox{7}", "7"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
        (r"\boxed{\left\{ 1 \right.}", r"\left\{ 1 \right."),  # an unbalanced escaped brace either
        (r"\boxed{3} then a truncated \boxed{\frac{1", "3"),  # unclosed last box: the one before
        (r"\boxed 5", "5"),
        ("The final answer is $\\frac{1}{2}$. I hope it is correct.", r"\frac{1}{2}"),  # Minerva style
        ("Final answer: 12", "12"),
        ("Answer: 5 cm", "5 cm"),
        ("**Answer:** 42", "42"),
        ("The answer is 3.5.", "3.5"),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),  # GSM8K
        ("#### 1,000", "1,000"),
        ("Answer: 3\nWait, the answer is 4.", "4"),  # the last marker wins
        ("we get 3 and then -4.5.", "-4.5"),  # last number
        ("total 1,250 apples", "1,250"),
        ("ratio 3/4", "3/4"),
        ("", None),
        ("   ", None),
        ("no numbers here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_none_and_nested():
    assert last_boxed("nothing") is None
    assert last_boxed(r"\boxed{\frac{\sqrt{2}}{2}}") == r"\frac{\sqrt{2}}{2}"


# ---------------------------------------------------------------------------------------------
# equivalences (pred, gold): math-verify 0.8.0

EQUAL = [
    ("1/2", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac{1}{2}", "1/2"),
    (r"\frac{2}{4}", r"\frac12"),
    ("0.50", "0.5"),
    ("0.50", r"\frac12"),
    ("3.0", "3"),
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"1\frac{1}{2}", r"\frac32"),  # mixed number
    (r"2\pi", r"\pi*2"),
    ("x^2+2x+1", "(x+1)^2"),
    ("(1,2]", "(1, 2]"),
    (r"x \in (1,2]", "(1,2]"),
    (r"5 \text{ cm}", "5"),
    (r"5\text{cm}", "5"),
    ("0.5", r"\frac{1}{2}\text{ cm}"),
    (r"30^\circ", "30"),
    ("x=3", "3"),
    ("x = 3", "3"),
    ("3", "x=3"),
    (r"50\%", "0.5"),
    ("0.5", r"50\%"),
    (r"\{1,2\}", r"\{2,1\}"),
    ("{1,2}", "{2,1}"),
    ("2, 1", "1, 2"),
    ("1,000", "1000"),
    ("1000", "1,000"),
    ("1,000,000", "1000000"),
    ("12,000.5", "12000.5"),
    (r"\$1,000", "1000"),
    ("10^{3}", "1000"),
    ("0.333333", "1/3"),  # equal after rounding to 6 decimals
    (r"\infty", r"\infty"),
    (r"\text{(A)}", "A"),
    (r"\boxed{3}", "3"),  # delimited answers are taken as they are
    ("3", r"\boxed{3}"),
    (r"$\frac{1}{2}$", "0.5"),
]

NOT_EQUAL = [
    ("2", "3"),
    ("-3", "3"),
    ("(1,2)", "[1,2]"),
    ("[1,2]", "[1,2)"),
    (r"\{1,2\}", r"\{1,3\}"),
    ("x=4", "3"),
    ("y=3", "x=3"),
    ("A", "B"),
    ("1/3", "0.33"),  # 0.33 is not 1/3 at 6 decimals: honest, not lenient
    ("0.33", "1/3"),
    ("2/3", "0.667"),
    ("1,5", "1.5"),  # a comma is never a decimal point: {1, 5}
    ("", "3"),  # empty prediction
    ("   ", "3"),
]

# Where math-verify departs from what a grader would say; the tests pin today's behaviour so a
# change in math-verify shows up here.
KNOWN_LIMITS = [
    # lenient: a percentage equals both its fraction and its number (50% = 0.5 and 50% = 50)
    (r"50\%", "50", True),
    ("50%", "50", True),
    # lenient: "(1,2)" is ambiguous (open interval or pair) and matches the set {1, 2}
    (r"\{1,2\}", "(1,2)", True),
    # lenient: differences below float_rounding=6 decimals vanish
    (r"\frac{1}{2}", "0.5000001", True),
    # strict: e-notation is read as Euler's e (1 * e * 3), not 10^3
    ("1e3", "1000", False),
    # strict: pi against a 3- or 6-digit decimal is not equal
    ("3.14", r"\pi", False),
    (r"\pi", "3.14159", False),
    # strict: degrees are not converted to radians
    (r"30^{\circ}", r"\frac{\pi}{6}", False),
    # asymmetric: a relation as the prediction is not compared with an interval gold (allowed the
    # other way round: gold "1<x<=2", pred "(1,2]" is equal)
    (r"1<x\le 2", "(1,2]", False),
    ("(1,2]", r"1<x\le 2", True),
]


@pytest.mark.parametrize(("pred", "gold"), EQUAL)
def test_equal(pred, gold):
    assert math_equal(pred, gold), (pred, gold)


@pytest.mark.parametrize(("pred", "gold"), NOT_EQUAL)
def test_not_equal(pred, gold):
    assert not math_equal(pred, gold), (pred, gold)


@pytest.mark.parametrize(("pred", "gold", "judged"), KNOWN_LIMITS)
def test_known_math_verify_limits(pred, gold, judged):
    assert math_equal(pred, gold) is judged, (pred, gold)


def test_unparseable_gold_is_no_verdict():
    assert math_verdict("3", "") is None
    assert math_equal("3", "") is False


# ---------------------------------------------------------------------------------------------
# the registered reward


def test_registered():
    assert REGISTRY.get("math") is math_reward
    assert REGISTRY.params("math") == ["answer", "timeout_s"]


def test_math_reward():
    assert math_reward("q", r"... so \boxed{\dfrac{1}{2}}", answer="0.5") == 1.0
    assert math_reward("q", "The answer is 0.5.", answer=r"\frac12", task=None, example=None) == 1.0
    assert math_reward("q", "#### 1,000", answer=1000) == 1.0  # a numeric gold is str()-ed
    assert math_reward("q", r"\boxed{3}", answer="4") == 0.0
    assert math_reward("q", "I don't know", answer="4") == 0.0  # no answer at all
    assert math_reward("q", "", answer="4") == 0.0
    assert math_reward("q", r"\boxed{3}") is None  # no gold: cannot score
    assert math_reward("q", r"\boxed{3}", answer="") is None  # gold does not parse


# ---------------------------------------------------------------------------------------------
# timeouts: main thread, worker processes, threads

# 9^(9^(9^9)): sympy tries to evaluate it and would run for hours
HUGE = r"The answer is \boxed{9^{9^{9^{9}}}}"
PATHOLOGICAL = [r"9^{9^{9^{9}}}", r"10^{10^{10}}!", r"(x+1)^{10000}", "(1+" * 300 + "1" + ")" * 300]


@pytest.mark.parametrize("pred", PATHOLOGICAL, ids=["tower", "factorial", "poly", "nested"])
def test_pathological_input_stops_at_timeout(pred):
    t0 = time.monotonic()
    assert math_verdict(pred, "3", timeout_s=0.5) in (None, False)
    assert time.monotonic() - t0 < 2.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed


def test_reward_times_out_as_none():
    t0 = time.monotonic()
    assert math_reward("q", HUGE, answer="3", timeout_s=0.5) is None
    assert time.monotonic() - t0 < 2.0


def test_callers_timer_and_handler_are_restored():
    fired = []

    def handler(signum, frame):
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert math_equal("1/2", "0.5")
        assert math_verdict(r"9^{9^{9^{9}}}", "3", timeout_s=0.3) is None
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0
        assert signal.getsignal(signal.SIGALRM) is handler
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_in_worker_process_main_thread(method):
    with mp.get_context(method).Pool(1) as pool:
        call = pool.apply_async(math_reward, ("q", r"\boxed{\frac{\sqrt2}{2}}"), {"answer": r"\sqrt{2}/2"})
        assert call.get(timeout=120) == 1.0  # (spawn: the worker imports sympy first)
        assert pool.apply_async(math_reward, ("q", r"\boxed{2}"), {"answer": "3"}).get(timeout=60) == 0.0
        # the timer works in the worker: without it this call would not come back
        t0 = time.monotonic()
        call = pool.apply_async(math_reward, ("q", HUGE), {"answer": "3", "timeout_s": 0.5})
        assert call.get(timeout=60) is None
        assert time.monotonic() - t0 < 3.0


def test_in_thread():
    out, errors = [], []

    def work():
        try:
            out.append(math_reward("q", r"\boxed{\frac{1}{2}}", answer="0.5", timeout_s=5.0))
            out.append(math_reward("q", r"\boxed{2}", answer="3", timeout_s=5.0))
            out.append(math_equal("(1,2]", "(1, 2]", timeout_s=5.0))
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert errors == []
    assert out == [1.0, 0.0, True]  # correct scores, not a crash scored as 0


def test_timeout_landing_in_a_finalizer_is_not_reported_and_still_stops():
    # SymPy runs __del__ / weakref callbacks; a tick landing there cannot propagate and goes to
    # sys.unraisablehook. CI once failed when the next tick interrupted pytest's hook itself.
    # Timeline: 0-0.15 s ordinary work, then a finalizer spinning 0.15-0.30 s that the first tick
    # (0.2 s) lands in, then ordinary work again where a later tick (every 50 ms) must stop it.
    interrupted = []

    class Slow:
        def __del__(self):
            t = time.monotonic()
            try:
                while time.monotonic() - t < 0.15:
                    pass
            except BaseException as e:  # noqa: BLE001 - recorded, then re-raised as Python would
                interrupted.append(type(e).__name__)
                raise

    def spin(seconds):
        t = time.monotonic()
        while time.monotonic() - t < seconds:
            pass

    def work():
        spin(0.15)
        Slow()  # created and finalized at once: the finalizer spans the deadline
        spin(10.0)

    seen = []
    caller_hook = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        t0 = time.monotonic()
        done, result = _call_with_time_limit(work, 0.2)
        elapsed = time.monotonic() - t0
    finally:
        sys.unraisablehook = caller_hook
    assert interrupted and set(interrupted) == {"_Timeout"}  # a tick did land in the finalizer
    assert (done, result) == (False, None)
    assert elapsed < 1.0  # ~0.35 s: the first tick after the finalizer stopped the work
    assert seen == []  # our own interrupts were dropped, not reported
    assert sys.unraisablehook is caller_hook


def test_other_unraisable_errors_still_reach_the_callers_hook():
    class Broken:
        def __del__(self):
            raise ValueError("from a finalizer")

    seen = []
    caller_hook = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        done, _ = _call_with_time_limit(lambda: Broken() and None, 5.0)
    finally:
        sys.unraisablehook = caller_hook
    assert done
    assert [type(u.exc_value) for u in seen] == [ValueError]
