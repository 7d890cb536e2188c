"""Benchmark: ``math`` reward throughput, in process and in worker processes (not a test).

1,000 completions a run, 125 problems x 8 samples (one gold per group, as in training), each
with a ~400-character reasoning preamble and a final answer drawn from a realistic mix:

- problems: fractions (``\\frac{3}{7}``), LaTeX (``\\frac{\\sqrt{3}}{2}``, ``4\\pi``, intervals
  ``(1, 5]``) and plain integers (GSM8K style);
- answers: 55 % right in some surface form (``\\boxed{\\frac{3}{7}}``, ``\\boxed{3/7}``,
  ``The final answer is $...$``, ``#### 1,234``, ``x = ...``), 35 % wrong, 10 % no answer.

Sides, each scoring the same 1,000 completions with ``math_reward(prompt, completion, answer=gold)``:

- ``in-process``: a plain loop in this process (its main thread, so with the timer);
- ``mp.Pool fork x2``: a ``multiprocessing`` pool of 2 forked workers, started before the timed
  runs (``starmap``, chunks of 25); its start-up time is printed apart;
- ``rewards.score``: ``posttrain.rewards.score("math", ...)``, the protected pool entry point
  (timeouts, crash handling), when ``posttrain.rewards`` has it; it starts its own pool per call,
  so its figure includes the start-up.

Every run uses fresh completions (a new seed), so math-verify's own LaTeX parse cache is cold for
each side as it would be in training; the in-process side runs last in a round so that the pools
(forked from this process) never inherit its warm cache. All sides must give the same scores.

Run alone on the machine (2 cores: anything else running skews the figures):

    python bench/rewards.py              # 1 warm-up round, then 3 timed rounds
    python bench/rewards.py --runs 5 --n 2000
    python bench/rewards.py --smoke      # 16 completions, 1 timed round: checks it runs

Last line: ``inprocess_per_s=X pool2_per_s=Y score_per_s=Z`` (rewards per second, medians).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

import posttrain.rewards as rewards
from posttrain.rewards.math import math_reward

GROUP = 8
PREAMBLE = (
    "Let me work through this step by step. First I write down what is given and what is asked. "
    "Then I set up the equation: if we let n be the unknown, we have {a}n + {b} = {c}. Subtracting "
    "{b} from both sides gives {a}n = {d}, and dividing by {a} gives the value we need. Let me double "
    "check the arithmetic: {a} times the result plus {b} should be {c}, which holds. "
)


def _problem(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(gold, right surface forms, wrong answers) of one random problem."""
    kind = rng.choice(["fraction", "fraction", "sqrt", "pi", "interval", "integer", "integer"])
    if kind == "fraction":
        b = rng.randint(3, 19)
        a = rng.choice([k for k in range(1, b) if all(k % p or b % p for p in range(2, k + 1))] or [1])
        right = [rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}", rf"\dfrac{{{a}}}{{{b}}}", rf"\frac{{{2 * a}}}{{{2 * b}}}"]
        return rf"\frac{{{a}}}{{{b}}}", right, [rf"\frac{{{a + 1}}}{{{b}}}", f"{b}/{a}", f"{a / b:.2f}"]
    if kind == "sqrt":
        k, m = rng.choice([2, 3, 5, 6, 7]), rng.randint(2, 9)
        right = [rf"\frac{{\sqrt{{{k}}}}}{{{m}}}", rf"\sqrt{{{k}}}/{m}", rf"\frac{{\sqrt{k}}}{{{m}}}"]
        return rf"\frac{{\sqrt{{{k}}}}}{{{m}}}", right, [rf"\frac{{\sqrt{{{k + 1}}}}}{{{m}}}", rf"\sqrt{{{k}}}"]
    if kind == "pi":
        k = rng.randint(2, 12)
        return rf"{k}\pi", [rf"{k}\pi", rf"\pi \cdot {k}", rf"{k} \pi"], [rf"{k + 1}\pi", str(k)]
    if kind == "interval":
        lo, hi = rng.randint(-5, 3), rng.randint(4, 12)
        return f"({lo}, {hi}]", [f"({lo},{hi}]", f"({lo}, {hi}]"], [f"[{lo}, {hi}]", f"({lo}, {hi})"]
    n = rng.randint(10, 99_999)
    return str(n), [str(n), f"{n:,}", f"x = {n}"], [str(n + rng.randint(1, 9)), str(n * 10)]


def _completion(rng: random.Random, right: list[str], wrong: list[str]) -> str:
    a, b, c = rng.randint(2, 9), rng.randint(1, 50), rng.randint(60, 500)
    text = PREAMBLE.format(a=a, b=b, c=c, d=c - b)
    roll = rng.random()
    if roll < 0.10:  # no final answer (truncated / rambling); the last number in the preamble counts
        return text + "Hmm, wait, I am not sure about this approach anymore, let me reconsider"
    ans = rng.choice(right) if roll < 0.65 else rng.choice(wrong)
    ending = rng.choice(
        [
            rf"So the answer is $\boxed{{{ans}}}$.",
            f"The final answer is ${ans}$. I hope it is correct.",
            f"Therefore:\n#### {ans}",
            rf"\[ \boxed{{{ans}}} \]",
        ]
    )
    return text + ending


def make_batch(n: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` completions (``n / GROUP`` problems x ``GROUP`` samples) and their golds."""
    rng = random.Random(seed)
    completions, golds = [], []
    for _ in range(n // GROUP):
        gold, right, wrong = _problem(rng)
        for _ in range(GROUP):
            completions.append(_completion(rng, right, wrong))
            golds.append(gold)
    return completions, golds


def _score_one(completion: str, gold: str) -> float | None:
    return math_reward("", completion, answer=gold)


def machine_line() -> str:
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average n/a"
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {load} "
        "(anything else running skews these timings)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="completions a run (a multiple of 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="16 completions, 1 timed round: checks it runs")
    args = ap.parse_args()
    if args.smoke:
        args.n, args.runs = 16, 1
    print(machine_line())

    ctx = mp.get_context("fork")
    _score_one(r"\boxed{1}", "1")  # imports and math-verify's first-call set-up, before the fork
    t0 = time.perf_counter()
    pool = ctx.Pool(args.workers)
    pool.starmap(_score_one, [(r"\boxed{1}", "1")] * args.workers, chunksize=1)  # workers up
    pool_start_s = time.perf_counter() - t0

    sides: dict[str, Callable[[list[str], list[str]], list[float | None]]] = {
        f"mp.Pool fork x{args.workers}": lambda c, g: pool.starmap(_score_one, zip(c, g, strict=True), chunksize=25),
    }
    score = getattr(rewards, "score", None)
    if score is not None:
        sides[f"rewards.score (workers={args.workers})"] = lambda c, g: score(
            "math", [""] * len(c), c, answer=g, workers=args.workers
        )
    sides["in-process (sequential)"] = lambda c, g: [_score_one(ci, gi) for ci, gi in zip(c, g, strict=True)]

    times: dict[str, list[float]] = {name: [] for name in sides}
    for run in range(args.runs + 1):  # round 0 is the warm-up
        completions, golds = make_batch(args.n, seed=run)
        results = {}
        for name, fn in sides.items():
            t = time.perf_counter()
            results[name] = fn(completions, golds)
            if run:
                times[name].append(time.perf_counter() - t)
        first = next(iter(results.values()))
        for name, res in results.items():
            if res != first:
                diff = sum(a != b for a, b in zip(res, first, strict=True))
                print(f"WARNING: {name} disagrees with {next(iter(results))} on {diff} completions")
        if run == 1:
            right = sum(v == 1.0 for v in first)
            none = sum(v is None for v in first)
            print(f"{len(first)} completions: {right} scored 1.0, {len(first) - right - none} 0.0, {none} None")
    pool.close()
    pool.join()

    print(f"pool of {args.workers} forked workers started in {pool_start_s * 1e3:.0f} ms (not in its figures)")
    print(f"{'side':34} {'median s':>9} {'min s':>7} {'max s':>7} {'rewards/s':>10}")
    per_s = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        per_s[name] = args.n / med
        print(f"{name:34} {med:9.3f} {min(ts):7.3f} {max(ts):7.3f} {per_s[name]:10.0f}")
    names = list(times)
    inproc, pool2 = per_s[names[-1]], per_s[names[0]]
    score_s = f"{per_s[names[1]]:.0f}" if score is not None else "n/a"
    print(f"inprocess_per_s={inproc:.0f} pool2_per_s={pool2:.0f} score_per_s={score_s}")


if __name__ == "__main__":
    main()
