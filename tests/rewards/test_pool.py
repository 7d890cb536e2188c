"""The protected scoring path: worker processes, per-call timeouts, batch deadlines, crashes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from posttrain.rewards import REGISTRY, Call, RewardPool, score, score_batch
from posttrain.rewards.pool import run_in_process


def _echo(prompt, completion, *, scale=1.0, **_):
    return float(completion) * scale


def _misbehaves(prompt, completion, **_):
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "nan":
        return float("nan")
    if completion == "none":
        return None
    if completion == "str":
        return "1.0"
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    if completion == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    return 1.0


def _uses_alarm(prompt, completion, **_):
    # signal-based timeouts (math-verify's) only work on a process's main thread
    assert threading.current_thread() is threading.main_thread()
    signal.signal(signal.SIGALRM, lambda *a: None)
    signal.alarm(5)
    signal.alarm(0)
    return 1.0


@pytest.fixture(autouse=True)
def entries(monkeypatch):
    for name, fn in (("t_echo", _echo), ("t_misbehaves", _misbehaves), ("t_alarm", _uses_alarm)):
        monkeypatch.setitem(REGISTRY._entries, name, fn)


def calls(name, completions, **params):
    return [Call(name, params, "p", c, {}) for c in completions]


def test_results_come_back_in_order_across_workers():
    completions = [str(i) for i in range(200)]
    with RewardPool(2, chunks_per_worker=8) as pool:
        out = pool.run(calls("t_echo", completions, scale=2.0))
    assert [o.value for o in out] == [2.0 * i for i in range(200)]
    assert {o.status for o in out} == {"ok"}


@pytest.mark.parametrize("runner", ["pool", "in_process"])
def test_each_failure_is_classified_and_the_rest_is_scored(runner):
    completions = ["ok", "raise", "nan", "none", "str", "ok"]
    if runner == "pool":
        with RewardPool(2) as pool:
            out = pool.run(calls("t_misbehaves", completions))
    else:
        out = run_in_process(calls("t_misbehaves", completions))
    assert [o.status for o in out] == ["ok", "error", "nonfinite", "none", "error", "ok"]
    assert [o.value for o in out] == [1.0, None, None, None, None, 1.0]
    assert "ValueError: bad completion" in out[1].message
    assert "str" in out[4].message


def test_a_hanging_call_times_out_and_its_worker_is_replaced():
    completions = ["ok", "hang", "ok", "ok", "hang", "ok"]
    with RewardPool(2, call_timeout_s=0.5, deadline_s=None, chunks_per_worker=1) as pool:
        t0 = time.monotonic()
        out = pool.run(calls("t_misbehaves", completions))
        took = time.monotonic() - t0
        assert [o.status for o in out] == ["ok", "timeout", "ok", "ok", "timeout", "ok"]
        assert pool.replaced == 2
        # the two hangs sit in different chunks, on different workers, so they time out together
        assert took < 0.5 * 2 + 1.0
        # the replaced workers serve the next batch
        assert [o.value for o in pool.run(calls("t_echo", ["1", "2", "3"]))] == [1.0, 2.0, 3.0]


def test_the_batch_deadline_bounds_the_whole_batch():
    completions = ["hang"] * 6 + ["ok"] * 2
    with RewardPool(2, call_timeout_s=60, deadline_s=0.8) as pool:
        t0 = time.monotonic()
        out = pool.run(calls("t_misbehaves", completions))
        took = time.monotonic() - t0
    assert took < 0.8 + 0.7
    assert all(o.status == "timeout" for o in out[:6])
    assert all("deadline" in o.message for o in out[:6])


@pytest.mark.parametrize("how", ["crash", "segv"])
def test_a_call_that_kills_its_worker_is_scored_none_and_the_worker_replaced(how):
    completions = ["ok", how, "ok", "ok"]
    with RewardPool(1, call_timeout_s=10, chunks_per_worker=1) as pool:
        out = pool.run(calls("t_misbehaves", completions))
        assert [o.status for o in out] == ["ok", "crashed", "ok", "ok"]
        assert pool.replaced == 1
        assert "exit code" in out[1].message


def test_workers_run_calls_on_their_main_thread_so_signal_timeouts_work():
    with RewardPool(2) as pool:
        out = pool.run(calls("t_alarm", ["a", "b", "c"]))
    assert [o.status for o in out] == ["ok"] * 3, [o.message for o in out]


def test_score_batch_counts_by_status_and_keeps_failed_samples():
    report = score_batch(
        [("t_misbehaves", {}), ("t_echo", {"scale": 1.0})],
        ["p0", "p1"],
        ["raise", "nan"],
        [{}, {}],
    )
    assert report.names == ["t_misbehaves", "t_echo"]
    assert report.values[0] == [None, None]
    # t_misbehaves: "raise" raises, "nan" is NaN; t_echo: float("raise") raises, float("nan") is NaN
    assert report.errors == [1, 1]
    assert report.nonfinite == [1, 1]
    assert report.counts[1] == {"ok": 0, "none": 0, "error": 1, "nonfinite": 1, "timeout": 0, "crashed": 0}
    first = report.failures[0]
    assert first["reward"] == "t_misbehaves" and first["prompt"] == "p0" and first["completion"] == "raise"


def test_score_entry_point_takes_one_field_value_per_completion():
    def with_answer(prompt, completion, *, answer, **_):
        return float(completion == answer)

    REGISTRY._entries["t_answer"] = with_answer
    try:
        got = score("t_answer", ["p"] * 3, ["1", "2", "3"], answer=["1", "0", "3"], workers=2)
        assert got == [1.0, 0.0, 1.0]
        assert score("t_answer", ["p"], ["1"], answer=["1"], workers=0) == [1.0]
        with pytest.raises(ValueError, match="field 'answer' has 1 values for 3 completions"):
            score("t_answer", ["p"] * 3, ["1", "2", "3"], answer=["1"])
    finally:
        del REGISTRY._entries["t_answer"]
    with pytest.raises(KeyError, match="unknown reward 't_anser'. Did you mean 't_answer'|unknown reward"):
        score("t_anser", ["p"], ["1"])


def test_score_entry_point_survives_a_hang_within_its_timeout():
    t0 = time.monotonic()
    got = score("t_misbehaves", ["p"] * 3, ["ok", "hang", "ok"], workers=2, timeout_s=0.5)
    assert got == [1.0, None, 1.0]
    assert time.monotonic() - t0 < 3.0


def test_pool_rejects_bad_settings_and_use_after_close():
    with pytest.raises(ValueError, match="workers"):
        RewardPool(0)
    pool = RewardPool(1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(calls("t_echo", ["1"]))


def test_workers_die_with_a_trainer_killed_by_sigkill(tmp_path):
    # a trainer killed with SIGKILL cannot stop its workers; they must not linger as orphans
    import subprocess
    import sys

    code = (
        "import os, time\n"
        "from posttrain.rewards import RewardPool\n"
        "pool = RewardPool(2)\n"
        "print(' '.join(str(w.proc.pid) for w in pool._workers), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived their trainer"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, waiting to be reaped by init
    except FileNotFoundError:
        return False
