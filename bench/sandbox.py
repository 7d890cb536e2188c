"""Benchmark: the sandbox's cost per code execution at each isolation level (not a test).

Runs the trivial program ``pass`` ``--runs`` times through ``posttrain.sandbox.run_python``
at every available level, next to two peers with no sandbox at all:

* ``subprocess``: ``subprocess.run([sys.executable, "-c", "pass"])`` (the usual way to "run the
  code", site-packages and all);
* ``subprocess -sSP``: the same with the sandbox's interpreter flags ``-s -S -P`` (no site),
  so ``level - subprocess -sSP`` is what the isolation itself costs.

The levels and peers alternate run by run (A B C A B C ...) so that a change of background load
hits all alike. Prints min / median / p90 / max in milliseconds and the median overhead over
``subprocess -sSP``. When the caller is root and the interpreter lives where an unprivileged uid
cannot reach it (pyenv under ``/root``), the bwrap and rlimits levels add a launcher step (a
private mount namespace and a second interpreter start); the table says when.

Run alone on the machine (2 cores: anything else running skews the figures):

    python bench/sandbox.py             # 3 warm-up runs, then 50 timed runs per row
    python bench/sandbox.py --runs 200
    python bench/sandbox.py --python /usr/bin/python3   # an interpreter every uid can reach: no launcher
    python bench/sandbox.py --smoke     # 1 warm-up run, 3 timed runs per row: checks it runs

Last line: ``sandbox_ms_median`` per level, e.g. ``bwrap=45.1 unshare=60.2 rlimits=40.3 subprocess=20.0``.
"""

from __future__ import annotations

import argparse
import os
import platform
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

from posttrain import sandbox


def reachable_by_others(path: str) -> bool:
    """Whether a uid other than the owner can run ``path``: every directory above it searchable (o+x)
    and the file itself readable and executable by others (o+rx). The sandbox runs the code under a
    fresh uid, so an interpreter that fails this (pyenv under /root) needs its launcher step.
    """
    p = Path(path)
    if not all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents):
        return False
    mode = os.stat(p).st_mode
    return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="interpreter to sandbox (default: this one)")
    parser.add_argument("--smoke", action="store_true", help="1 warm-up run, 3 timed runs per row: checks it runs")
    args = parser.parse_args()
    if args.smoke:
        args.warmup, args.runs = 1, 3

    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {load} (anything else running skews these)")
    exe = os.path.realpath(args.python)
    print(f"python {exe}, euid {os.geteuid()}")
    status = sandbox.isolation_status()
    for level, why in status.items():
        print(f"  {level:8s} {why}")
    launcher = os.geteuid() == 0 and not reachable_by_others(exe)
    if launcher:
        print("  (root + interpreter unreachable by other uids: bwrap and rlimits start a launcher first)")

    levels = sandbox.available_isolation()
    fns = {lv: (lambda lv=lv: sandbox.run_python("pass", isolation=lv, python=exe)) for lv in levels}
    fns["subprocess"] = lambda: subprocess.run([args.python, "-c", "pass"], check=True)
    fns["subprocess -sSP"] = lambda: subprocess.run([exe, "-s", "-S", "-P", "-c", "pass"], check=True)

    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)

    base = statistics.median(times["subprocess -sSP"])
    header = f"{'':16s} {'min':>7s} {'median':>7s} {'p90':>7s} {'max':>7s}"
    print(f"\n{header}   overhead vs -sSP (median)   [ms, {args.runs} runs]")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:16s} {min(ts):7.1f} {med:7.1f} {p90(ts):7.1f} {max(ts):7.1f}   {med - base:+7.1f}")
    print(" ".join(f"{name.replace(' ', '')}={statistics.median(ts):.1f}" for name, ts in times.items()))


if __name__ == "__main__":
    main()
