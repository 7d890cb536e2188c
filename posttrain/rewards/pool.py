"""Scoring that cannot hang the run: reward calls in worker processes, with timeouts.

A :class:`RewardPool` keeps ``workers`` processes. Each call (one reward function on one
completion) runs on a worker's main thread, so rewards that rely on signals (math-verify's
timeouts) work. The parent hands out chunks of calls, the worker streams back one result per call,
and the parent watches the clock:

- a call that runs longer than ``call_timeout_s`` is scored ``None`` with status ``"timeout"``;
  its worker is killed (SIGKILL) and replaced, and the rest of its chunk goes to the new worker;
- when the batch passes ``deadline_s``, every unfinished call is scored ``None`` (``"timeout"``)
  and the busy workers are replaced, so a step never waits longer than its deadline;
- a worker that dies (segfault, ``os._exit``, OOM kill) costs its current call (``"crashed"``)
  and is replaced;
- a call that raises is ``"error"`` with the exception's message; a result that is not a number is
  ``"error"``; NaN or infinity is ``"nonfinite"``; ``None`` from the function is ``"none"``.

Workers are started with the ``fork`` start method, so every reward registered in the parent
(including user functions registered at runtime before the pool starts) is known in the workers
by name; only names, parameters and the call's fields cross the pipe. Start the pool before
threads that hold locks (the trainer does it at setup).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

STATUSES = ("ok", "none", "error", "nonfinite", "timeout", "crashed")


@dataclass(frozen=True)
class Call:
    """One reward evaluation: registry ``name`` with ``params`` on one completion and its fields."""

    name: str
    params: Mapping[str, Any]
    prompt: str
    completion: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What one call produced: ``value`` is ``None`` unless ``status == "ok"``."""

    value: float | None
    status: str
    message: str = ""


def classify(value: object) -> Outcome:
    """Turn a reward function's return value into an :class:`Outcome`."""
    if value is None:
        return Outcome(None, "none")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return Outcome(None, "error", f"returned {type(value).__name__}, not a number")
    if not math.isfinite(float(value)):
        return Outcome(None, "nonfinite", f"returned {value}")
    return Outcome(float(value), "ok")


def run_call(call: Call) -> Outcome:
    """Run one call in this process; exceptions become ``"error"`` outcomes."""
    from posttrain.rewards.registry import REGISTRY

    try:
        fn = REGISTRY.get(call.name)
        value = fn(call.prompt, call.completion, **call.params, **call.fields)
    except Exception as e:  # noqa: BLE001 - any failure of user code is scored None
        return Outcome(None, "error", f"{type(e).__name__}: {e}")
    return classify(value)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the trainer dies (even by SIGKILL), so no worker is
    orphaned; elsewhere, workers notice at their next receive (the pipe closes).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _worker_main(conn: Connection, parent_end: Connection, parent_pid: int) -> None:
    """Worker loop: receive ``[(index, Call), ...]`` chunks, send ``(index, Outcome)`` per call."""
    parent_end.close()  # the fork copied the trainer's end; only the trainer may hold it
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, call in chunk:
            outcome = run_call(call)
            try:
                conn.send((index, outcome))
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable message; report, don't die
                conn.send((index, Outcome(None, "error", f"could not send the result: {e}")))


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext) -> None:
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, parent, os.getpid()), daemon=True, name="posttrain-reward"
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self.pending: deque[int] = deque()  # indices sent and not answered, in order
        self.since = 0.0  # when the current call (pending[0]) started

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Worker processes that score reward calls with a per-call timeout and a per-batch deadline.

    Args:
        workers: number of worker processes (at least 1).
        call_timeout_s: longest one call may run before it is scored ``None`` and its worker replaced.
        deadline_s: default longest a whole :meth:`run` may take (``None``: no batch deadline).
        chunks_per_worker: calls are sent in about ``workers * chunks_per_worker`` chunks per batch
            (fewer round trips than one call per message, still balanced across workers).

    Use as a context manager or call :meth:`close`; counters ``replaced`` (workers killed or lost)
    accumulate over the pool's life.

    """

    def __init__(
        self,
        workers: int = 2,
        *,
        call_timeout_s: float = 10.0,
        deadline_s: float | None = 60.0,
        chunks_per_worker: int = 4,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.call_timeout_s = call_timeout_s
        self.deadline_s = deadline_s
        self.chunks_per_worker = chunks_per_worker
        self._ctx = mp.get_context("fork")
        self._workers = [_Worker(self._ctx) for _ in range(workers)]
        self.replaced = 0
        self._lock = threading.Lock()  # one batch at a time (an async run's producer and its evaluation share it)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.proc.join(timeout=1)
            w.kill()
        self._workers = []

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx)
        self.replaced += 1

    def run(self, calls: Sequence[Call], *, deadline_s: float | None = ...) -> list[Outcome]:  # type: ignore[assignment]
        """Score ``calls``; returns one :class:`Outcome` per call, in order, within the deadline.
        Callers in several threads take turns.
        """
        with self._lock:
            return self._run(calls, deadline_s)

    def _run(self, calls: Sequence[Call], deadline_s: float | None) -> list[Outcome]:
        if not self._workers:
            raise RuntimeError("the reward pool is closed")
        deadline_s = self.deadline_s if deadline_s is ... else deadline_s
        t_end = time.monotonic() + deadline_s if deadline_s is not None else math.inf
        n = len(calls)
        out: list[Outcome | None] = [None] * n
        size = max(1, math.ceil(n / (len(self._workers) * self.chunks_per_worker)))
        todo: deque[list[int]] = deque(list(range(s, min(s + size, n))) for s in range(0, n, size))

        def dispatch(i: int, indices: list[int]) -> None:
            w = self._workers[i]
            try:
                w.conn.send([(j, calls[j]) for j in indices])
            except Exception as e:  # noqa: BLE001 - unpicklable fields: every call of the chunk fails
                for j in indices:
                    out[j] = Outcome(None, "error", f"could not send the call to a worker: {e}")
                return
            w.pending.extend(indices)
            w.since = time.monotonic()

        def fail_current(i: int, status: str, message: str) -> None:
            """Score the worker's current call, replace the worker, requeue the rest of its chunk."""
            w = self._workers[i]
            j = w.pending.popleft()
            out[j] = Outcome(None, status, message)
            rest = list(w.pending)
            self._replace(i)
            if rest:
                todo.appendleft(rest)

        while True:
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if not w.pending and todo:
                    dispatch(i, todo.popleft())
            if all(o is not None for o in out):
                break
            if now >= t_end:
                for i, w in enumerate(self._workers):
                    if w.pending:
                        self._replace(i)
                for j in range(n):
                    if out[j] is None:
                        out[j] = Outcome(None, "timeout", f"batch deadline of {deadline_s:g} s passed")
                break
            busy = [w for w in self._workers if w.pending]
            next_timeout = min((w.since + self.call_timeout_s for w in busy), default=now + 1.0)
            ready = wait([w.conn for w in busy], timeout=max(0.0, min(next_timeout, t_end) - now))
            for i, w in enumerate(self._workers):
                if not w.pending:
                    continue
                if w.conn in ready:
                    try:
                        while w.pending and w.conn.poll():
                            j, outcome = w.conn.recv()
                            w.pending.popleft()
                            out[j] = outcome
                            w.since = time.monotonic()
                    except (EOFError, OSError):
                        code = w.proc.exitcode if not w.proc.is_alive() else None
                        w.proc.join(timeout=1)
                        code = w.proc.exitcode if code is None else code
                        fail_current(i, "crashed", f"the worker died (exit code {code}) during this call")
                        continue
                if w.pending and time.monotonic() - w.since > self.call_timeout_s:
                    fail_current(i, "timeout", f"call exceeded {self.call_timeout_s:g} s")
        return [o if o is not None else Outcome(None, "timeout") for o in out]


def run_in_process(calls: Sequence[Call]) -> list[Outcome]:
    """Score ``calls`` one by one in this process: no timeouts (``scoring.workers = 0``)."""
    return [run_call(c) for c in calls]
