"""The code the sandbox runs in its child processes, and the commands that start it.

``_BOOT`` and ``_LAUNCH`` are source text: each is passed to a fresh interpreter with ``-c`` followed by a
call with its configuration as a literal (``repr``), so they import only builtin and C modules and read
nothing of posttrain.
"""

from __future__ import annotations

_PY_FLAGS = ("-s", "-S", "-P")  # no user site, no site-packages, no cwd on sys.path (see the package docstring)

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


def _boot_cmd(exe: str, boot: dict[str, object]) -> list[str]:
    """The sandboxed interpreter's command: ``_BOOT`` run with ``boot`` (limits, the source's fd, the caller's pid)."""
    return [exe, *_PY_FLAGS, "-c", f"{_BOOT}\n_boot({boot!r})\n"]


def _launch_cmd(exe: str, cfg: dict[str, object], argv: list[str]) -> list[str]:
    return [exe, *_PY_FLAGS, "-c", f"{_LAUNCH}\n_launch({cfg!r}, {argv!r})\n"]

