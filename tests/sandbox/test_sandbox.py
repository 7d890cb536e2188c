"""The sandbox: functional behaviour, and a hostile-program suite run at every available level.

Each hostile case must be contained and scored without harming the run or the machine. What
holds where, when the caller is root (the CI machine; every cell is asserted below)::

    case                          bwrap  unshare  rlimits
    infinite loop (wall/CPU)      held   held     held
    fork bomb (RLIMIT_NPROC)      held   held     held
    memory bomb (RLIMIT_AS)       held   held     held
    huge output (capped read)     held   held     held
    write to repo / $HOME         held   held     held (fresh uid has no write permission)
    write to host /tmp            held   held     NOT held (world-writable, as /var/tmp, /dev/shm)
    read env secrets              held   held     held
    network connection            held   held     NOT held (host network)
    kill the parent / kill -1     held   held     held (different uid)
    daemon outliving the call     held   held     held (all processes of the uid killed)

For a non-root caller the rlimits level keeps the caller's uid: writes to the caller's files,
``/proc/<pid>/environ``, signals to the caller and ``setsid`` daemons are not contained there, so
those cases are skipped for that combination (running them would harm the test run itself).
"""

from __future__ import annotations

import multiprocessing
import os
import pwd
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from posttrain import sandbox
from posttrain.sandbox import LEVELS, SandboxResult, available_isolation, best_isolation, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
NOT_HELD_AT_RLIMITS = {"host_tmp", "network"}
UNSAFE_AT_RLIMITS_NON_ROOT = {"write_repo_home", "secrets_proc", "kill_parent", "daemon"}


def level_params() -> list[object]:
    avail = set(available_isolation()) if sys.platform.startswith("linux") else set()
    return [
        pytest.param(lv, marks=pytest.mark.skipif(lv not in avail, reason=f"{lv} not available here"))
        for lv in LEVELS
    ]


def held(case: str, level: str) -> bool:
    """Whether ``case`` is contained at ``level`` (skips cases unsafe to run uncontained)."""
    if level != "rlimits":
        return True
    if not IS_ROOT and case in UNSAFE_AT_RLIMITS_NON_ROOT:
        pytest.skip(f"{case} is not contained at rlimits for a non-root caller (see the module docstring)")
    return case not in NOT_HELD_AT_RLIMITS


def pids_with(token: bytes) -> list[int]:
    """Live processes whose command line contains ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def run_watching(token: bytes, source: str, **kw: object) -> tuple[SandboxResult, list[int]]:
    """Run ``source`` in a thread; meanwhile count the processes carrying ``token`` every 20 ms."""
    box: dict[str, SandboxResult] = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", run_python(source, **kw)))
    thread.start()
    counts = []
    while thread.is_alive():
        counts.append(len(pids_with(token)))
        time.sleep(0.02)
    thread.join()
    return box["r"], counts


def gone_soon(token: bytes, within_s: float = 1.0) -> bool:
    deadline = time.monotonic() + within_s
    while pids_with(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def unique_memory_mb() -> int:
    """A memory limit nobody else uses: its byte count marks this run's command lines."""
    return 200 + secrets.randbelow(800)


# --- functional ----------------------------------------------------------------------------------


@pytest.mark.parametrize("level", level_params())
def test_stdout_stderr_returncode_stdin(level):
    src = "import sys\nline = input()\nprint('got', line[::-1])\nprint('err', file=sys.stderr)\nsys.exit(3)\n"
    res = run_python(src, stdin="abc\n", isolation=level)
    assert (res.returncode, res.stdout, res.stderr) == (3, "got cba\n", "err\n")
    assert res.isolation == level and not res.timed_out and not res.output_truncated and not res.ok


@pytest.mark.parametrize("level", level_params())
def test_environment_cwd_and_builtins(level):
    src = (
        "import os, sys\n"
        "open('f.txt', 'w').write('data')\n"
        "print(open('f.txt').read(), hash('abc'), sorted(sys.modules.get('site') and ['site'] or []))\n"
        "print(os.environ['PYTHONHASHSEED'], os.environ['HOME'] == os.getcwd())\n"
        "exit(0)\n"
    )
    first = run_python(src, isolation=level)
    second = run_python(src, isolation=level)
    assert first.ok, first.stderr
    assert first.stdout == second.stdout  # PYTHONHASHSEED=0: hashes are reproducible
    data, _, rest = first.stdout.partition(" ")
    assert data == "data" and rest.endswith("[]\n0 True\n")  # no site module, cwd writable and HOME
    main = (
        "import __main__, pickle\n"
        "def f():\n    return 41\n"
        "print(pickle.loads(pickle.dumps(f))() + 1, __main__.f is f, __file__, sorted(globals())[:2])\n"
    )
    assert run_python(main, isolation=level).stdout == "42 True main.py ['__builtins__', '__doc__']\n"


@pytest.mark.parametrize("level", level_params())
def test_errors_and_large_source(level):
    bad = run_python("def f(:\n", isolation=level)
    assert bad.returncode == 1 and "SyntaxError" in bad.stderr
    boom = run_python("x = 1\nraise ValueError('nope')\n", isolation=level)
    assert boom.returncode == 1 and "ValueError: nope" in boom.stderr and 'File "main.py", line 2' in boom.stderr
    big = "\n".join(f"v{i} = {i}" for i in range(14000)) + "\nprint(v13999)\n"  # ~150 KB of source
    assert len(big) > 1 << 17  # more than one pipe buffer / argv string could carry
    assert run_python(big, isolation=level).stdout == "13999\n"
    binary = run_python("import sys; sys.stdout.buffer.write(b'\\xff\\xfeok')", isolation=level)
    assert binary.stdout == "\ufffd\ufffdok"


@pytest.mark.parametrize("level", level_params())
def test_closing_the_streams_early_does_not_end_the_run(level):
    src = "import os, time\nprint('bye', flush=True)\nos.close(1)\nos.close(2)\ntime.sleep(0.3)\nos._exit(7)\n"
    res = run_python(src, isolation=level)
    assert (res.returncode, res.stdout, res.timed_out) == (7, "bye\n", False) and res.wall_s >= 0.3


@pytest.mark.parametrize("level", level_params())
def test_wall_timeout(level):
    t0 = time.monotonic()
    res = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)\n", wall_s=0.7, isolation=level)
    assert res.timed_out and res.returncode != 0 and res.stdout == "start\n"
    assert 0.7 <= res.wall_s < 4 and time.monotonic() - t0 < 5


def test_temp_dirs_are_removed():
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("posttrain-sandbox-")}
    for level in available_isolation():
        run_python("import os\nos.makedirs('a/b')\nopen('a/b/c', 'w').write('x')\nos.chmod('a', 0)\n", isolation=level)
        run_python("import time\ntime.sleep(30)\n", wall_s=0.3, isolation=level)
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("posttrain-sandbox-")}
    assert after <= before


def test_auto_and_bad_arguments():
    assert run_python("print(1)").isolation == best_isolation() == available_isolation()[0]
    with pytest.raises(ValueError, match="unknown isolation"):
        run_python("pass", isolation="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be > 0"):
        run_python("pass", wall_s=0)


# --- hostile programs ----------------------------------------------------------------------------


@pytest.mark.parametrize("level", level_params())
def test_infinite_loop_hits_cpu_limit(level):
    res = run_python("while True:\n    pass\n", cpu_s=1, wall_s=20, isolation=level)
    # killed by RLIMIT_CPU (SIGXCPU) after ~1 CPU-second, long before the wall deadline
    assert res.timed_out and res.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU), res
    assert res.wall_s < 10


@pytest.mark.parametrize("level", level_params())
def test_fork_bomb_is_bounded_and_cleaned_up(level):
    mb = unique_memory_mb()
    token = str(mb << 20).encode()
    src = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res, counts = run_watching(token, src, wall_s=1.0, cpu_s=1, nproc=16, memory_mb=mb, isolation=level)
    assert res.returncode != 0 and res.wall_s < 6
    assert max(counts) > 1  # the bomb did fork (so the watcher sees its processes) ...
    assert max(counts) <= 16 + 3  # ... but never beyond RLIMIT_NPROC (+ launcher / bwrap / init)
    assert gone_soon(token)


@pytest.mark.parametrize("level", level_params())
def test_memory_bomb_fails(level):
    res = run_python("x = bytearray(8 << 30)\n", memory_mb=256, isolation=level)
    assert res.returncode == 1 and "MemoryError" in res.stderr
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    res = run_python(grow, memory_mb=256, isolation=level)
    assert res.returncode == 1 and "MemoryError" in res.stderr and not res.timed_out


@pytest.mark.parametrize("level", level_params())
def test_huge_output_is_truncated(level):
    src = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n    sys.stderr.write('y' * 4096)\n"
    res = run_python(src, max_output=100_000, wall_s=20, isolation=level)
    assert res.output_truncated and not res.timed_out and res.returncode != 0
    assert len(res.stdout) <= 100_000 and len(res.stderr) <= 100_000
    assert res.wall_s < 6  # killed as soon as the cap was reached, not at the wall deadline


@pytest.mark.parametrize("level", level_params())
def test_writes_outside_the_sandbox(level):
    name = f"sandbox_pwned_{secrets.token_hex(4)}"
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    repo_home = [ROOT / name, home / name]
    host_tmp = Path(tempfile.gettempdir()) / name
    contained = held("write_repo_home", level)
    src = (
        f"for p in {[str(p) for p in [*repo_home, host_tmp]]!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('DENIED', p, type(e).__name__)\n"
    )
    try:
        res = run_python(src, isolation=level)
        assert res.ok, res.stderr
        for p in repo_home:
            assert p.exists() != contained, (p, res.stdout)
        assert host_tmp.exists() != held("host_tmp", level), res.stdout
    finally:
        for p in [*repo_home, host_tmp]:
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("level", level_params())
def test_environment_secrets_are_not_visible(level, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("POSTTRAIN_SANDBOX_TEST_SECRET", secret)
    targets = [os.getpid(), 1]
    assert held("secrets_proc", level)  # (skips at rlimits for a non-root caller: same uid)
    src = (
        "import os\n"
        "print(dict(os.environ))\n"
        f"for pid in {targets!r} + [os.getppid()]:\n"
        "    try:\n"
        "        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(pid, 'DENIED', type(e).__name__)\n"
    )
    res = run_python(src, isolation=level)
    assert res.ok, res.stderr
    assert secret not in res.stdout + res.stderr
    assert "POSTTRAIN_SANDBOX_TEST_SECRET" not in res.stdout


@pytest.mark.parametrize("level", level_params())
def test_network_connection(level):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        src = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('FAILED', type(e).__name__)\n"
        )
        res = run_python(src, isolation=level)
        assert res.ok, res.stderr
        assert res.stdout.startswith("FAILED") == held("network", level), res.stdout


@pytest.mark.parametrize("level", level_params())
def test_cannot_kill_the_parent(level):
    held("kill_parent", level)  # skips at rlimits for a non-root caller: it would kill this test
    me = os.getpid()
    src = (
        "import os, signal\n"
        f"for target in (os.getppid(), {me}, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('SENT', target)\n"
        "    except OSError as e:\n"
        "        print('DENIED', target, type(e).__name__)\n"
        "print('alive')\n"
    )
    res = run_python(src, isolation=level)
    assert res.stdout.endswith("alive\n"), (res.stdout, res.stderr)
    assert f"SENT {me}\n" not in res.stdout  # and this process is still here to check


@pytest.mark.parametrize("level", level_params())
def test_daemon_does_not_outlive_the_call(level):
    contained = held("daemon", level)
    token = f"{30 + secrets.randbelow(1000)}.{secrets.randbelow(10**6):06d}"  # sleep's argument
    src = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n"
        f"        os.execv('/bin/sleep', ['sleep', {token!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "print('parent done')\n"
    )
    res, counts = run_watching(f"sleep\0{token}".encode(), src, wall_s=5, isolation=level)
    try:
        assert res.ok and res.stdout == "parent done\n", res.stderr
        assert max(counts) == 1  # the daemon ran while the program did (the watcher can see it)
        assert gone_soon(f"sleep\0{token}".encode()) == contained
    finally:
        for pid in pids_with(f"sleep\0{token}".encode()):
            os.kill(pid, 9)


def _run_then_hang(source: str, memory_mb: int, level: str, report: object) -> None:  # a "reward worker"
    try:
        res = run_python(source, wall_s=60, memory_mb=memory_mb, isolation=level)
        report.send(f"run_python returned early: {res}")  # type: ignore[attr-defined]
    except BaseException as exc:  # noqa: BLE001 - the test reports whatever stopped the worker
        report.send(f"run_python raised {exc!r}")  # type: ignore[attr-defined]


@pytest.mark.parametrize("level", level_params())
def test_sandbox_dies_with_its_caller(level, monkeypatch):
    # The reward pool SIGKILLs a worker whose call runs too long: the sandbox must go with it.
    mb = unique_memory_mb()
    token = str(mb << 20).encode()
    # spawn, not fork: this test process may hold other libraries' threads (wandb's, TensorBoard's)
    # by now, and a forked child can deadlock on a lock one of them held
    ctx = multiprocessing.get_context("spawn")
    report, sink = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_run_then_hang, args=("import time\ntime.sleep(60)\n", mb, level, sink), daemon=True)
    t0 = time.monotonic()
    worker.start()
    try:
        # a loaded 2-core machine can take long to start a spawned interpreter: wait while the
        # worker lives, and say what stopped it if it ends before its sandbox shows up
        while not pids_with(token) and worker.is_alive() and time.monotonic() < t0 + 120:
            time.sleep(0.02)
        why = report.recv() if report.poll(1) else f"worker alive={worker.is_alive()} exitcode={worker.exitcode}"
        assert pids_with(token), f"the sandboxed program never started after {time.monotonic() - t0:.0f} s: {why}"
        time.sleep(0.3)  # let it get past its start-up (the kill comes seconds in, in the pool)
        os.kill(worker.pid, 9)
        worker.join()
        assert gone_soon(token, within_s=2)
        if level == "rlimits":  # the dead worker's work directory is swept by the next call
            left = Path(tempfile.gettempdir()) / f"posttrain-sandbox-{worker.pid}-"
            assert any(str(p).startswith(str(left)) for p in Path(tempfile.gettempdir()).iterdir())
            monkeypatch.setattr(sandbox.processes, "_last_sweep", -1e9)  # the sweep runs once a minute
            run_python("pass", isolation="rlimits")
            assert not any(str(p).startswith(str(left)) for p in Path(tempfile.gettempdir()).iterdir())
    finally:
        for pid in pids_with(token):
            os.kill(pid, 9)
