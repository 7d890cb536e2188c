"""``run_python`` and the isolation levels that work here: one sandboxed run from start to cleanup."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from posttrain.sandbox.child import _boot_cmd
from posttrain.sandbox.isolation import (
    LEVELS,
    Isolation,
    _bwrap_cmd,
    _clean_env,
    _die_with_parent,
    _drop,
    _expose_cmd,
    _layout,
    _Limits,
    _rlimits,
    _unshare_cmd,
)
from posttrain.sandbox.processes import (
    _UID_BASE,
    _UID_SPAN,
    _WORKDIR_PREFIX,
    _communicate,
    _kill_all,
    _rmtree,
    _sweep_stale_workdirs,
)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: the exit status (see the package docstring for signals).
        stdout: standard output, decoded as UTF-8 (invalid bytes replaced), at most
            ``max_output`` bytes.
        stderr: standard error, likewise.
        timed_out: the wall deadline passed or the CPU limit killed the program.
        output_truncated: a stream exceeded ``max_output`` bytes; the program was killed then.
        isolation: the level that ran it (``"bwrap"``, ``"unshare"`` or ``"rlimits"``).
        wall_s: seconds from start to the end of the cleanup.

    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    isolation: str
    wall_s: float

    @property
    def ok(self) -> bool:
        """Exit status 0, within the limits and with the whole output."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def run_python(
    source: str,
    *,
    stdin: str = "",
    wall_s: float = 5.0,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    fsize_mb: int = 16,
    disk_mb: int = 64,
    nproc: int = 64,
    max_output: int = 1 << 20,
    isolation: Isolation = "auto",
    python: str | None = None,
) -> SandboxResult:
    """Run ``source`` with ``stdin`` in a sandbox and return what it did.

    Args:
        source: Python source, run as ``__main__`` (file name ``main.py``).
        stdin: the program's standard input.
        wall_s: wall-clock limit; the whole sandbox is killed when it passes.
        cpu_s: CPU-seconds limit (``RLIMIT_CPU``, rounded up to whole seconds).
        memory_mb: address-space limit per process (``RLIMIT_AS``).
        fsize_mb: largest file the program may write (``RLIMIT_FSIZE``).
        disk_mb: size of the tmpfs ``/tmp`` under bwrap / unshare (and of bwrap's ``/dev/shm``).
        nproc: processes and threads the program may add (``RLIMIT_NPROC``).
        max_output: cap on each of stdout and stderr, in bytes; beyond it the program is killed
            and ``output_truncated`` is set.
        isolation: a level of :data:`LEVELS`, or ``"auto"`` for :func:`best_isolation`.
        python: the interpreter (default: the caller's, ``sys.executable``).

    Raises:
        ValueError: for an unknown or unavailable isolation level (the message lists the
            available ones) or non-positive limits.

    """
    if isolation == "auto":
        level = best_isolation()
    elif isolation in LEVELS:
        level = isolation
        if level not in available_isolation():
            raise ValueError(
                f"isolation {level!r} is not available here ({isolation_status()[level]}); "
                f"available: {', '.join(available_isolation())}"
            )
    else:
        raise ValueError(f"unknown isolation {isolation!r}; choices: auto, {', '.join(LEVELS)}")
    if min(wall_s, cpu_s, memory_mb, fsize_mb, disk_mb, nproc, max_output) <= 0:
        raise ValueError("wall_s, cpu_s, memory_mb, fsize_mb, disk_mb, nproc and max_output must be > 0")
    limits = _Limits(wall_s, cpu_s, memory_mb, fsize_mb, disk_mb, nproc, max_output)
    return _run(source, stdin, limits, level, python or sys.executable)


@functools.cache
def isolation_status() -> dict[str, str]:
    """For each level, ``"ok"`` or why it does not work here (a probe program is run once)."""
    return {level: _probe(level) for level in LEVELS}


def available_isolation() -> list[str]:
    """The isolation levels that work on this machine, strongest first."""
    return [level for level, status in isolation_status().items() if status == "ok"]


def best_isolation() -> str:
    """The strongest available level.

    Raises:
        RuntimeError: if no level works (the message gives each level's reason).

    """
    levels = available_isolation()
    if not levels:
        raise RuntimeError(f"no sandbox works here: {isolation_status()}")
    return levels[0]


def _probe(level: str) -> str:
    """Run a trivial program at ``level``; ``"ok"`` or the reason it failed."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "needs Linux"
    tool = {"bwrap": "bwrap", "unshare": "unshare"}.get(level)
    if tool and shutil.which(tool) is None:
        return f"{tool} not found on PATH"
    try:
        res = _run("print(6 * 7)", "", _Limits(20.0, 10.0, 512, 1, 8, 16, 1 << 16), level, sys.executable)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return f"probe failed: {type(e).__name__}: {e}"
    if res.returncode != 0 or res.stdout != "42\n":
        return f"probe failed: exit {res.returncode}, stderr {res.stderr.strip()[-300:]!r}"
    return "ok"


def _run(source: str, stdin: str, lim: _Limits, level: str, python: str) -> SandboxResult:
    start = time.monotonic()
    exe = os.path.realpath(python)
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if os.geteuid() == 0 else None
    hide, expose, reachable = _layout(exe)
    # Root dropping to a fresh uid that cannot reach the interpreter: a private mount namespace
    # hides the home directories and binds the interpreter back (the launcher's "expose" step).
    needs_expose = uid is not None and not reachable
    work: str | None = None
    src_file, in_file = _sealed_file(source.encode("utf-8")), _sealed_file(stdin.encode("utf-8"))
    try:
        # At the rlimits level the program's parent is the caller (setpriv and the launcher exec).
        ppid = os.getpid() if level == "rlimits" and _die_with_parent() else None
        boot = {"fd": src_file.fileno(), "rlimits": _rlimits(lim, level, uid), "ppid": ppid}
        py_cmd = _boot_cmd(exe, boot)
        env = _clean_env()
        cwd: str | None = None
        # Drop to the fresh uid with setpriv (which also sets the parent-death signal) rather
        # than Popen(user=...): that makes Python fork() the caller instead of vfork(), which
        # costs ~100 ms with torch loaded. Popen(user=...) is only the fallback without setpriv.
        drop, popen_user = _drop(uid)
        if level == "rlimits":
            _sweep_stale_workdirs()
            work = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
            if uid is not None:
                os.chown(work, uid, uid)
            env |= {"HOME": work, "TMPDIR": work}
            cwd = work
            cmd = _expose_cmd(exe, uid, hide, expose, work, py_cmd) if needs_expose else [*drop, *py_cmd]
        elif level == "bwrap":
            env |= {"HOME": "/tmp", "TMPDIR": "/tmp"}
            cmd = _bwrap_cmd(lim, hide, expose, py_cmd)
            cmd = _expose_cmd(exe, uid, hide, expose, "/", cmd) if needs_expose else [*drop, *cmd]
        elif level == "unshare":  # unshare runs as the caller; its launcher drops privileges
            env |= {"HOME": "/tmp", "TMPDIR": "/tmp"}
            cmd = [*_die_with_parent(), *_unshare_cmd(exe, lim, uid, hide, expose, py_cmd)]
        else:
            raise ValueError(f"unknown isolation {level!r}")
        if needs_expose or level == "unshare":
            popen_user = {}
        proc = subprocess.Popen(
            cmd,
            stdin=in_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            pass_fds=(src_file.fileno(),),
            start_new_session=True,
            **popen_user,
        )
        try:
            out, err, timed_out, truncated = _communicate(proc, start + lim.wall_s, lim.max_output)
        finally:
            # Under bwrap / unshare every process lives in the pid namespace, which dies with
            # its init; at the rlimits level a fresh uid's setsid'd daemons are hunted down.
            _kill_all(proc, uid if level == "rlimits" else None)
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            timed_out = True
        return SandboxResult(
            returncode=rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out,
            output_truncated=truncated,
            isolation=level,
            wall_s=time.monotonic() - start,
        )
    finally:
        src_file.close()
        in_file.close()
        if work is not None:
            _rmtree(work)


def _sealed_file(data: bytes) -> IO[bytes]:
    """An unlinked temporary file holding ``data``, positioned at 0 (inherited as an fd)."""
    f = tempfile.TemporaryFile()
    f.write(data)
    f.flush()
    f.seek(0)
    return f
