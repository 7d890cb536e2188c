"""Run untrusted Python source in a sandbox: ``run_python(source) -> SandboxResult``.

Three isolation levels, strongest first (``"auto"`` picks the strongest that works here, found
by running a probe program once per process):

* ``"bwrap"`` -- bubblewrap: new user, pid, net, ipc, uts and cgroup namespaces; ``/`` bound
  read-only; fresh ``/proc`` and a fresh read-only ``/dev``; fresh tmpfs of ``disk_mb`` on
  ``/tmp`` (the cwd) and ``/dev/shm``, the only writable places; the caller's home and ``/root``
  hidden under empty read-only tmpfs (the interpreter's directories bound back read-only if they
  live there); uid/gid 65534 inside; ``--disable-userns``, ``--new-session``,
  ``--die-with-parent``.
* ``"unshare"`` -- util-linux ``unshare`` with mount, pid, net, ipc and uts namespaces (plus a
  user namespace with root mapped to the caller when the caller is not root) and a small trusted
  launcher (Python + ctypes) that, inside them, makes every mount read-only and nosuid in one
  ``mount_setattr(AT_RECURSIVE)`` call (Linux >= 5.12), mounts the same tmpfs ``/tmp`` as cwd,
  hides the home directories, then runs as pid 1 (reaping orphans) and starts the program with
  no capabilities: as a fresh unprivileged uid when the caller is root, else as the mapped user
  with an empty bounding set, ``SECBIT_NOROOT`` and ``no_new_privs``. Its root really is
  read-only (tested). It does not block creating further user namespaces (bwrap does); mounts
  copied into those stay locked read-only.
* ``"rlimits"`` -- the floor, and applied in every level: resource limits (``RLIMIT_CPU``,
  ``AS``, ``FSIZE``, ``NPROC``, ``NOFILE``, ``CORE=0``) set by the bootstrap before any untrusted
  code, a new session / process group, a scrubbed environment (``PATH``, ``LANG``, ``LC_ALL``,
  ``HOME``, ``TMPDIR``, ``PYTHONHASHSEED=0``, ...), cwd = a fresh temporary directory (removed
  afterwards). The filesystem, the network and (for a non-root caller) the caller's files and
  ``/proc/<pid>/environ`` are *not* isolated.

Identity. When the caller is root every level runs the program as a fresh, random, otherwise
unused uid/gid (>= 1.5e9; shown as 65534 inside bwrap): ``RLIMIT_NPROC`` then counts only this
program's processes (root ignores it), root-owned files are not writable, the program cannot
signal or ptrace the caller or other sandboxes, and at the rlimits level every process of that
uid is killed (by pidfd, never ``kill(-1)``) after the call, which catches ``setsid`` daemons
(under bwrap / unshare the pid namespace dies with its init, taking every process along). If
that uid cannot reach the interpreter (e.g. pyenv under ``/root``, mode 700), a private mount
namespace (``unshare --mount``, as root) first hides ``/root`` and the caller's home under tmpfs
and binds the interpreter's directories back read-only. A non-root caller keeps its uid: the
rlimits level then shares the caller's files, signals and ``/proc`` (``RLIMIT_NPROC`` is set to
the caller's current task count + ``nproc``), and a double-forked daemon that calls ``setsid``
can outlive the call; bwrap/unshare contain all of this with their pid namespace.

Containment (caller root; ``tests/sandbox/test_sandbox.py`` asserts every cell)::

    case                          bwrap  unshare  rlimits
    infinite loop (wall/CPU)      held   held     held
    fork bomb (RLIMIT_NPROC)      held   held     held
    memory bomb (RLIMIT_AS)       held   held     held
    huge output (capped read)     held   held     held
    write to repo / $HOME         held   held     held (uid has no write permission)
    write to host /tmp            held   held     NOT held (also /var/tmp, /dev/shm)
    read env secrets              held   held     held (scrubbed env; /proc environ is root's)
    network connection            held   held     NOT held (host network)
    kill the parent / kill -1     held   held     held (different uid)
    daemon outliving the call     held   held     held (kill by uid)

The interpreter is the caller's (``sys.executable`` resolved to the real binary) with
``-s -S -P``: no site-packages (stdlib only), no user site, no cwd on ``sys.path``; ``-E`` is not
used because the environment is built from scratch and ``PYTHONHASHSEED=0`` must take effect.
``exit``/``quit`` (normally added by ``site``) are provided. The source reaches the program
through an inherited file descriptor of an unlinked temporary file, never through the
sandbox's filesystem; it runs as ``__main__`` under the file name ``main.py``.

If the caller itself is killed mid-run (a reward-pool worker past its timeout), the sandbox
goes with it: bwrap's ``--die-with-parent``, and a parent-death signal (``setpriv --pdeathsig``
or the launcher's ``prctl``) on ``unshare`` and on the rlimits program. At the rlimits level only
the program itself is killed that way; processes it forked live on until their CPU limit (a
sleeping one indefinitely), and its work directory is swept by a later call in any process.

Return codes: a program killed by signal N reports ``-N`` at the rlimits level and ``128 + N``
under bwrap / unshare (their pid-1 convention); a sandbox killed at the wall deadline or on
output overflow reports ``-9``. ``timed_out`` is set when the wall deadline passed or the CPU
limit (``SIGXCPU``) killed the program.
"""

from __future__ import annotations

import functools
import math
import os
import pwd
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any, Literal

Isolation = Literal["auto", "bwrap", "unshare", "rlimits"]
LEVELS: tuple[str, ...] = ("bwrap", "unshare", "rlimits")
"""Isolation levels, strongest first."""

_UID_BASE, _UID_SPAN = 1_500_000_000, 500_000_000
_PY_FLAGS = ("-s", "-S", "-P")
_EXIT_GRACE_S = 0.1  # after the program exits, how long to wait for EOF from its leftovers
_WORKDIR_PREFIX = "posttrain-sandbox-"
_SWEEP_EVERY_S = 60.0
_last_sweep = -_SWEEP_EVERY_S

# Runs first in the sandboxed interpreter (and nothing else before it): set the limits, read the
# source from the inherited fd, then execute it as __main__. Only builtin/C modules are imported.
_BOOT = r"""
def _boot(cfg):
    import os, sys, resource, builtins
    if cfg["ppid"] is not None and os.getppid() != cfg["ppid"]:
        os._exit(125)  # the caller died before our parent-death signal was set
    for name, soft, hard in cfg["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    chunks = []
    while True:
        b = os.read(cfg["fd"], 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(cfg["fd"])
    src = b"".join(chunks).decode("utf-8")
    builtins.exit = builtins.quit = sys.exit
    sys.argv = ["main.py"]
    # Run in the real __main__ namespace (pickle, multiprocessing and `import __main__` see it),
    # emptied of this bootstrap.
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if n not in ("__name__", "__builtins__", "__loader__", "__spec__")]:
        del main[name]
    main.update(__file__="main.py", __doc__=None, __package__=None)
    try:
        exec(compile(src, "main.py", "exec"), main)
    except (SystemExit, MemoryError):
        raise
    except BaseException as e:  # print it as python would for a main.py file (lines included)
        import linecache, traceback
        linecache.cache["main.py"] = (len(src), None, src.splitlines(True), "main.py")
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this frame
        sys.exit(1)
"""

# The trusted launcher of the unshare level (and of the root-only "expose" step): runs as root
# or as the namespace's root, sets up mounts, drops every privilege, then execs ``argv``.
_LAUNCH = r"""
import ctypes, os
def _launch(cfg, argv):
    libc = ctypes.CDLL(None, use_errno=True)
    def ok(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, what + ": " + os.strerror(err))
    def mount(src, dst, fstype, flags, data):
        ok(libc.mount(src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                      data and data.encode()), "mount " + dst)
    def readonly(path):  # mount_setattr(AT_FDCWD, path, AT_RECURSIVE, {RDONLY|NOSUID})
        attr = (ctypes.c_uint64 * 4)(0x3, 0, 0, 0)
        ok(libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), path.encode(), ctypes.c_uint(0x8000),
                        attr, ctypes.c_size_t(32)), "mount_setattr " + path)
    def prctl(op, arg):
        ok(libc.prctl(ctypes.c_int(op), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), "prctl %d" % op)
    def drop():
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            prctl(24, cap)  # PR_CAPBSET_DROP
        uid = cfg["uid"]
        if uid is not None:  # real root: become the fresh uid (clears every capability)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        else:  # root of our user namespace: no capabilities now or after any exec
            prctl(28, 0xC3)  # PR_SET_SECUREBITS: NOROOT, NO_CAP_AMBIENT_RAISE (+ locks)
            hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
            ok(libc.capset(hdr, (ctypes.c_uint32 * 6)()), "capset")
        prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
        if not cfg["init"]:  # die with the caller (the uid change above cleared any earlier setting)
            prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
            if os.getppid() != cfg["ppid"]:  # the caller died before that
                os._exit(125)
    try:
        keep = [(os.open(p, os.O_PATH | os.O_CLOEXEC), p) for p in cfg["expose"]]
        if cfg["readonly"]:
            readonly("/")
            mount("tmpfs", "/tmp", "tmpfs", 6, cfg["tmpfs"])  # MS_NOSUID | MS_NODEV
        for h in cfg["hide"]:
            mount("tmpfs", h, "tmpfs", 6, "size=1m,nr_inodes=1024,mode=755")
        for fd, p in keep:
            os.makedirs(p, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, p, None, 0x1000 | 0x4000, None)  # MS_BIND | MS_REC
            os.close(fd)
        for h in cfg["hide"]:
            readonly(h)
    except BaseException as e:
        os.write(2, ("sandbox launcher: %s\n" % e).encode())
        os._exit(125)
    if cfg["init"]:  # stay as pid 1 (trusted, privileged): reap orphans, leave with the program
        pid = os.fork()
        if pid:
            while True:
                p, status = os.wait()
                if p == pid:
                    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    try:
        drop()
        os.chdir(cfg["cwd"])
        os.execv(argv[0], argv)
    except BaseException as e:
        os.write(2, ("sandbox launcher: %s\n" % e).encode())
        os._exit(125)
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        returncode: the exit status (see the module docstring for signals).
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


# --- implementation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Limits:
    wall_s: float
    cpu_s: float
    memory_mb: int
    fsize_mb: int
    disk_mb: int
    nproc: int
    max_output: int


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
        py_cmd = [exe, *_PY_FLAGS, "-c", f"{_BOOT}\n_boot({boot!r})\n"]
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


def _rlimits(lim: _Limits, level: str, uid: int | None) -> list[tuple[str, int, int]]:
    cpu = max(1, math.ceil(lim.cpu_s))
    nproc = lim.nproc
    if uid is None and level == "rlimits":
        # RLIMIT_NPROC counts every task of the real uid; without a fresh uid or a user
        # namespace that includes the caller's own processes and threads.
        nproc += _tasks_of(os.getuid())
    mb = 1 << 20
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        ("RLIMIT_AS", lim.memory_mb * mb, lim.memory_mb * mb),
        ("RLIMIT_FSIZE", lim.fsize_mb * mb, lim.fsize_mb * mb),
        ("RLIMIT_NPROC", nproc, nproc),
        ("RLIMIT_NOFILE", 256, 256),
        ("RLIMIT_CORE", 0, 0),
    ]


def _drop(uid: int | None) -> tuple[list[str], dict[str, Any]]:
    """``(command prefix, Popen keyword arguments)`` that run a command as ``uid`` (unchanged if
    ``None``), with no privileges, dying with the caller.
    """
    if uid is None or not _die_with_parent():
        popen_user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        return _die_with_parent(), popen_user
    setpriv = _die_with_parent()[0]
    ids = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--bounding-set", "-all"]
    return [setpriv, *ids, "--no-new-privs", "--pdeathsig", "KILL", "--"], {}


@functools.cache
def _die_with_parent() -> list[str]:
    """Command prefix that SIGKILLs the command when the caller dies (e.g. a reward-pool worker
    killed at its timeout); bwrap has ``--die-with-parent`` and the launcher sets it itself.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _clean_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def _bwrap_cmd(lim: _Limits, hide: list[str], expose: list[str], py_cmd: list[str]) -> list[str]:
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534"]
    cmd += ["--disable-userns", "--die-with-parent", "--new-session"]
    cmd += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    # Every writable tmpfs has a size: an unbounded one could fill the machine's memory.
    for writable in ("/tmp", "/dev/shm"):
        cmd += ["--perms", "1777", "--size", str(lim.disk_mb << 20), "--tmpfs", writable]
    for h in hide:
        cmd += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", h]
    for p in expose:
        cmd += ["--ro-bind", p, p]
    for ro in [*hide, "/dev"]:  # bwrap makes these tmpfs owned by (and writable for) the sandbox uid
        cmd += ["--remount-ro", ro]
    return [*cmd, "--chdir", "/tmp", "--", *py_cmd]


def _launch_cmd(exe: str, cfg: dict[str, object], argv: list[str]) -> list[str]:
    return [exe, *_PY_FLAGS, "-c", f"{_LAUNCH}\n_launch({cfg!r}, {argv!r})\n"]


def _expose_cmd(exe: str, uid: int | None, hide: list[str], expose: list[str], cwd: str, argv: list[str]) -> list[str]:
    """As root: a private mount namespace that hides ``hide`` and binds ``expose`` back, then
    drop to ``uid`` and exec ``argv``.
    """
    cfg = {"readonly": False, "tmpfs": "", "hide": hide, "expose": expose, "uid": uid, "init": False, "cwd": cwd}
    cfg["ppid"] = os.getpid()
    return ["unshare", "--mount", "--propagation", "private", "--", *_launch_cmd(exe, cfg, argv)]


def _unshare_cmd(
    exe: str, lim: _Limits, uid: int | None, hide: list[str], expose: list[str], py_cmd: list[str]
) -> list[str]:
    cfg = {
        "readonly": True,
        "tmpfs": f"size={lim.disk_mb << 20},nr_inodes=4096,mode=1777",
        "hide": hide,
        "expose": expose,
        "uid": uid,
        "init": True,
        "cwd": "/tmp",
    }
    cmd = ["unshare"]
    if uid is None:
        cmd += ["--user", "--map-root-user"]
    cmd += ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    return [*cmd, "--propagation", "private", "--", *_launch_cmd(exe, cfg, py_cmd)]


@functools.cache
def _layout(exe: str) -> tuple[list[str], list[str], bool]:
    """``(hide, expose, reachable)``: directories to hide, interpreter directories under them to
    bind back, and whether an unrelated uid can reach every interpreter path.
    """
    paths = _interpreter_paths(exe)
    hide = _hide_dirs()
    expose = sorted(p for p in paths if any(_is_under(p, h) for h in hide))
    return hide, expose, all(_reachable_by_others(p) for p in [exe, *paths])


def _interpreter_paths(exe: str) -> list[str]:
    """Directories the interpreter needs: its binary's directory and its prefixes."""
    if exe == os.path.realpath(sys.executable):
        dirs = {os.path.dirname(exe), os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    else:
        dirs = {os.path.dirname(exe), os.path.dirname(os.path.dirname(exe))}
    # Keep only outermost directories (a bind of the parent covers the child).
    return sorted(d for d in dirs if not any(o != d and _is_under(d, o) for o in dirs))


@functools.cache
def _hide_dirs() -> list[str]:
    """The caller's home and ``/root``, where credentials live."""
    homes = {"/root", os.path.realpath(pwd.getpwuid(os.geteuid()).pw_dir)}
    return sorted(h for h in homes if h != "/" and os.path.isdir(h))


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _reachable_by_others(path: str) -> bool:
    """Whether an unrelated uid can reach ``path``: ``o+x`` on every directory on the way, and
    ``o+r`` (``o+rx`` for a directory) on the path itself.
    """
    path = os.path.realpath(path)
    parts = path.strip("/").split("/")
    try:
        for i in range(len(parts)):
            if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001:
                return False
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return bool(mode & 0o004) and (not os.path.isdir(path) or bool(mode & 0o001))


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
