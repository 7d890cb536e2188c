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

Modules: ``run`` (``run_python``, the levels that work here, one run from start to cleanup), ``isolation``
(each level's command, the limits, the directories hidden and bound back), ``child`` (the bootstrap and
the launcher, source text run in the child), ``processes`` (reading, killing and sweeping up after the
program) and ``programs`` (a completion's program against tests: the ``code`` reward's core). This package
re-exports the public names.
"""

from __future__ import annotations

from posttrain.sandbox.isolation import LEVELS, Isolation
from posttrain.sandbox.run import SandboxResult, available_isolation, best_isolation, isolation_status, run_python

__all__ = ["LEVELS", "Isolation", "SandboxResult", "available_isolation", "best_isolation", "isolation_status",
           "run_python"]
