"""The isolation levels as commands: bubblewrap, ``unshare`` with the trusted launcher, and the rlimits
every level sets; the layout of the directories to hide and the interpreter's to bind back.
"""

from __future__ import annotations

import functools
import math
import os
import pwd
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.sandbox.child import _launch_cmd
from posttrain.sandbox.processes import _tasks_of

Isolation = Literal["auto", "bwrap", "unshare", "rlimits"]
LEVELS: tuple[str, ...] = ("bwrap", "unshare", "rlimits")
"""Isolation levels, strongest first."""


@dataclass(frozen=True)
class _Limits:
    wall_s: float
    cpu_s: float
    memory_mb: int
    fsize_mb: int
    disk_mb: int
    nproc: int
    max_output: int


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
