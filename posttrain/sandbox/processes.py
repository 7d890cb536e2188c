"""The sandbox's processes from outside: reading them in ``/proc``, their output, killing them, and the
work directories they leave behind.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

_UID_BASE, _UID_SPAN = 1_500_000_000, 500_000_000  # a caller that is root runs each program as a fresh uid in here
_EXIT_GRACE_S = 0.1  # after the program exits, how long to wait for EOF from its leftovers
_WORKDIR_PREFIX = "posttrain-sandbox-"
_SWEEP_EVERY_S = 60.0
_last_sweep = -_SWEEP_EVERY_S


def _status(pid: str) -> dict[str, str]:
    """Fields of ``/proc/<pid>/status`` (empty if the process is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY)
    except OSError:
        return {}
    try:
        text = os.read(fd, 1 << 16).decode("utf-8", "replace")
    except OSError:
        return {}
    finally:
        os.close(fd)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _live_real_uid(pid: str) -> int | None:
    """The real uid of ``pid``, or ``None`` if it is gone or a zombie (already dead).

    Read from ``status``: the owner of ``/proc/<pid>`` would show root for a non-dumpable process.
    """
    fields = _status(pid)
    uids = fields.get("Uid", "").split()
    if not uids or fields.get("State", "").strip()[:1] in ("Z", "X"):
        return None
    return int(uids[0])


def _tasks_of(uid: int) -> int:
    """Tasks (threads) whose real uid is ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            fields = _status(pid)
            uids = fields.get("Uid", "").split()
            if uids and int(uids[0]) == uid:
                total += int(fields.get("Threads", "1"))
    return total


def _communicate(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr (each capped at ``cap`` bytes) until the program exits and its output
    ends, the deadline passes or a stream overflows.

    Returns ``(stdout, stderr, timed_out, truncated)``. Waits on a pidfd, so ``proc`` is never
    reaped here (its pid and pgid stay reserved for the kill that follows). A program that closes
    its streams early is still waited for; leftovers that keep them open after it exited get
    ``_EXIT_GRACE_S`` to finish writing.
    """
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    open_fds = set(bufs)
    timed_out = truncated = False
    exited_at: float | None = None
    pidfd = os.pidfd_open(proc.pid)  # readable once the process has exited (Linux >= 5.3)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            for fd in bufs:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            while not truncated:
                now = time.monotonic()
                if exited_at is not None and (not open_fds or now - exited_at > _EXIT_GRACE_S):
                    break
                if now >= deadline:
                    timed_out = exited_at is None
                    break
                wait = deadline - now if exited_at is None else min(deadline, exited_at + _EXIT_GRACE_S) - now
                for key, _ in sel.select(max(wait, 0.0)):
                    if key.fd == pidfd:
                        exited_at = now
                        sel.unregister(pidfd)
                        continue
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        open_fds.discard(key.fd)
                        continue
                    buf = bufs[key.fd]
                    room = cap - len(buf)
                    buf += data[:room]
                    truncated = truncated or len(data) > room
    finally:
        os.close(pidfd)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, truncated


def _kill_all(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """Kill the sandbox's process group (and every process of the fresh ``uid``), then reap.

    The group is signalled before ``proc`` is reaped, so its pgid cannot have been reused.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid, proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _kill_uid(uid: int, first_pid: int, rounds: int = 200) -> None:
    """SIGKILL every process whose real uid is ``uid`` (a fresh sandbox uid, never ours).

    Only pids allocated since ``first_pid`` (the sandbox's first process) can be the sandbox's,
    unless pids wrapped around meanwhile (then every process is checked). Each candidate is
    pinned with a pidfd before its uid is checked, so a recycled pid is never signalled. Repeats
    until a scan finds none (a fork bomb keeps forking while it is killed).
    """
    assert uid >= _UID_BASE, "refusing to kill processes of a uid that is not a sandbox uid"
    for _ in range(rounds):
        try:
            with open("/proc/sys/kernel/ns_last_pid") as f:
                wrapped = int(f.read()) < first_pid
        except (OSError, ValueError):
            wrapped = True
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or (int(entry) < first_pid and not wrapped) or _live_real_uid(entry) != uid:
                continue
            try:
                pidfd = os.pidfd_open(int(entry))
            except OSError:
                continue
            try:
                if _live_real_uid(entry) == uid:  # still the same process: pinned by the pidfd
                    found = True
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        if not found:
            return
        time.sleep(0.001)


def _sweep_stale_workdirs() -> None:
    """Remove work directories whose creating process died before it could (e.g. a reward-pool
    worker killed at its timeout). At most once every ``_SWEEP_EVERY_S`` per process.
    """
    global _last_sweep
    now = time.monotonic()
    if now - _last_sweep < _SWEEP_EVERY_S:
        return
    _last_sweep = now
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name[len(_WORKDIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(_WORKDIR_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # creator gone (a recycled pid only delays the sweep)
            _rmtree(os.path.join(tmp, name))
        except OSError:
            pass


def _rmtree(path: str) -> None:
    """Remove ``path`` even if the program made parts of it unreadable."""

    def fix(func: object, p: str, exc: object) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)  # onexc= needs Python 3.12
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
