"""Fault tests: a training process killed (SIGKILL) in each phase of a step, a disk that fills at each
point of a checkpoint write, a killed write's leftovers, and metrics.jsonl lines a power loss could take.

The kills are real: a run of the tiny recipe is a subprocess whose recipe names a test-only plugin
(written into tmp_path). The plugin registers a reward (produce), an advantage estimator (prepare) and
a loss (learn) that call the built-in ones, and wraps the checkpoint writer; each sends SIGKILL to the
training process when ``FAULT="<phase>@<step>"`` names it, after writing ``FAULT_RUN/killed_in``, so a
test knows the kill came from there. The same recipe without ``FAULT`` is the uninterrupted reference.
Damaged checkpoints (weights, trainer state with the optimizer, manifest) are in test_resume_trust.py.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from safetensors.torch import load_file

import posttrain.run.checkpoint as ck
from posttrain.config import load_config
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.run.checkpoint import (
    CheckpointError,
    choose_resume_checkpoint,
    load_trainer_state,
    remove_stale_writes,
    save_checkpoint,
    verify_checkpoint,
)
from posttrain.train.rl import train

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"
STEPS = 6
TIMING = ("time/", "throughput/")

PLUGIN = '''
"""Test-only faults: SIGKILL of the training process in a chosen phase of a chosen step."""
import functools
import os
import signal
import threading
from dataclasses import asdict
from pathlib import Path

import posttrain
import posttrain.run.checkpoint as ck
from posttrain.algorithms import advantages, losses
from posttrain.rewards import REGISTRY as REWARDS

MAIN = int(os.environ.setdefault("FAULT_MAIN_PID", str(os.getpid())))  # reward workers inherit it


def _fault(phase, step):
    """SIGKILL the training process when FAULT names this phase and step (after writing where)."""
    if os.environ.get("FAULT") == f"{phase}@{step}":
        # written whole, then renamed into place: several reward workers may reach the fault at once (and go on
        # after the kill), and a reader must never see one of them halfway through rewriting the file
        done = Path(os.environ["FAULT_RUN"]) / "killed_in"
        tmp = done.with_name(f"killed_in.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(f"{phase}@{step}")
        os.replace(tmp, done)
        os.kill(MAIN, signal.SIGKILL)


def _step():
    """The step running now: one more than the lines of metrics.jsonl (written after each step)."""
    path = Path(os.environ.get("FAULT_RUN", "/nonexistent")) / "metrics.jsonl"
    return 1 + (len(path.read_text().splitlines()) if path.exists() else 0)


@posttrain.register_reward("fault_task")
def fault_task(prompt, completion, **fields):
    _fault("produce", _step())
    return REWARDS.get("task")(prompt, completion, **fields)


def _wrap(registry, name, phase):
    real = registry.get(name)

    @functools.wraps(real)
    def fn(*args, **kwargs):
        _fault(phase, _step())
        return real(*args, **kwargs)

    registry.register(f"fault_{name}", **asdict(registry.traits(name)))(fn)


_wrap(advantages.REGISTRY, "grpo", "prepare")
_wrap(losses.REGISTRY, "ppo_clip", "learn")
_real_write = ck._write_files


def _write_files(tmp, step, model, *args):
    if os.environ.get("FAULT") == f"checkpoint@{step}":
        model.save_pretrained(tmp, safe_serialization=True)  # the weights are written, the rest never is
    _fault("checkpoint", step)
    return _real_write(tmp, step, model, *args)


ck._write_files = _write_files
'''

RECIPE = f'''
plugins = ["faults.py"]
seed = 0
[model]
path = "tiny"
[model.tiny]
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 4
max_positions = 48
[task]
name = "arithmetic"
params = {{ digits = 2, ops = "+", reverse = true }}
[rollout]
group_size = 4
prompts_per_step = 2
max_new_tokens = 6
[algorithm]
advantage = "fault_grpo"
loss = "fault_ppo_clip"
[train]
steps = {STEPS}
lr = 1e-3
[[reward]]
name = "fault_task"
[eval]
prompts = 4
[checkpoint]
every = 1
keep = 2
[log]
progress = false
tensorboard = false
plot_groups = false
samples = 0
'''


def _recipe(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "faults.py").write_text(PLUGIN)
    (where / "recipe.toml").write_text(RECIPE)
    return where / "recipe.toml"


def _posttrain(run: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT")} | {"FAULT_RUN": str(run)}
    if fault:
        env["FAULT"] = fault
    cmd = [sys.executable, "-c", "import sys; from posttrain.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def strip(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return _recipe(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def reference(recipe) -> Path:
    """The same recipe, uninterrupted (the plugin loaded, no FAULT)."""
    run = recipe.parent / "reference"
    done = _posttrain(run, "train", str(recipe), "--out", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (run / "killed_in").exists()
    return run


def test_sigkill_in_each_phase_then_resume_is_the_uninterrupted_run(recipe, reference):
    run = recipe.parent / "faulted"
    # one run, killed four times, each time in another phase of another step, resumed after each
    plan = [("produce@2", [1]), ("prepare@3", [1, 2]), ("learn@4", [1, 2, 3]),
            ("checkpoint@5", [1, 2, 3, 4, 5])]  # step 5 was logged before its checkpoint write was killed
    for i, (fault, logged) in enumerate(plan):
        args = ("train", str(recipe), "--out", str(run)) if i == 0 else ("train", "--out", str(run), "--resume")
        died = _posttrain(run, *args, fault=fault)
        assert died.returncode == -signal.SIGKILL, (fault, died.returncode, died.stderr[-3000:])
        assert (run / "killed_in").read_text() == fault  # killed by the plugin, in that phase
        assert [r["step"] for r in rows(run)] == logged
        (run / "killed_in").unlink()
    stale = [p.name for p in (run / "checkpoints").glob("step_000005.tmp-*")]
    assert len(stale) == 1 and (run / "checkpoints" / stale[0] / "model.safetensors").is_file()
    done = _posttrain(run, "train", "--out", str(run), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    # the killed write's directory is gone, with a line saying why; step 5 re-ran from step 4's checkpoint
    assert f"removed {run / 'checkpoints' / stale[0]}" in done.stderr
    log = (run / "resume.log").read_text()
    assert f"removed {stale[0]}: an incomplete write (pid " in log and "resumed from step_000004" in log
    assert not list((run / "checkpoints").glob("*.tmp-*"))
    assert [r["step"] for r in rows(run)] == list(range(1, STEPS + 1))  # each step once
    assert strip(rows(run)) == strip(rows(reference))
    a = load_file(reference / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    b = load_file(run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    verify_checkpoint(run / "checkpoints" / f"step_{STEPS:06d}")


# --- a disk that fills at each point of a checkpoint write (the trainer state's is in test_resume_trust) ----


@pytest.fixture
def model_and_tok(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    return load_model(str(d)), load_tokenizer(str(d))


def _enospc_on_fsync(name: str):
    """``os.fsync`` failing with ENOSPC for file ``name`` of a step-2 write: where a filesystem with
    delayed allocation reports a full disk (the write itself succeeded)."""
    real = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.name == name and path.parent.name.startswith("step_000002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    return fsync


def _enospc_on_write_text(name: str):
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name.startswith(name):
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data, *args, **kwargs)

    return write_text


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to name an fd's file")
@pytest.mark.parametrize("where", ["weights", "tokenizer", "manifest", "latest"])
def test_a_full_disk_at_each_point_of_a_write_keeps_a_resumable_checkpoint(tmp_path, model_and_tok, monkeypatch,
                                                                           where):
    model, tok = model_and_tok
    root = tmp_path / "run" / "checkpoints"
    save_checkpoint(root, 1, model, tok, {"v": 1}, keep=1)
    if where == "weights":
        monkeypatch.setattr(ck.os, "fsync", _enospc_on_fsync("model.safetensors"))
    elif where == "tokenizer":
        monkeypatch.setattr(ck.os, "fsync", _enospc_on_fsync("tokenizer.json"))
    else:
        monkeypatch.setattr(Path, "write_text", _enospc_on_write_text({"manifest": "manifest.json",
                                                                       "latest": "latest.tmp-"}[where]))
    said = ("step_000002 was written and verified, but .*latest could not be updated .*No space left on device"
            ".*--resume takes step_000002" if where == "latest"
            else "step 2 .*No space left on device.*step_000001 is intact")
    with pytest.raises(CheckpointError, match=said):
        save_checkpoint(root, 2, model, tok, {"v": 2}, keep=1)
    monkeypatch.undo()
    # no half-written directory or pointer is left; when only the pointer failed, the new checkpoint is
    # complete and verified and nothing was pruned (keep=1 prunes after a complete write only)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["latest", "step_000001", *(["step_000002"] if where == "latest" else [])]
    assert (root / "latest").read_text() == "step_000001"
    chosen = choose_resume_checkpoint(root, True, lambda m: None)
    assert chosen.name == left[-1] and load_trainer_state(chosen)["v"] == int(chosen.name[-1])


# --- leftovers of a killed write ------------------------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_writes_that_cannot_be_running_are_removed(tmp_path, model_and_tok):
    model, tok = model_and_tok
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 2, model, tok, {"v": 2})
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        old_live = root / f"step_000001.tmp-{live.pid}"  # a recycled live pid, but older than step_000002
        old_live.mkdir()
        os.utime(old_live, (1, 1))
        dead = root / f"step_000003.tmp-{_dead_pid()}"
        mine = root / f"step_000003.tmp-{os.getpid()}"  # this process is resuming: it is not writing
        running = root / f"step_000003.tmp-{live.pid}"  # might be a write in progress: kept
        for d in (dead, mine, running):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"partial")
        pointer = root / f"latest.tmp-{_dead_pid()}"  # `latest` being replaced when the process died
        pointer.write_text("step_0")
        said: list[str] = []
        removed = remove_stale_writes(root, said.append)
        assert sorted(removed) == sorted([old_live.name, dead.name, mine.name, pointer.name])
        assert running.is_dir() and (root / "step_000002").is_dir()
        assert any("is not running" in s for s in said) and any("older than step_000002" in s for s in said)
        log = (tmp_path / "resume.log").read_text()
        assert all(f"removed {name}: an incomplete write" in log for name in removed)
        assert remove_stale_writes(root, said.append) == []
    finally:
        live.kill()
        live.wait()


# --- metrics.jsonl: durable before the checkpoint that counts its lines -------------------------------


def _cfg(out: Path, steps: int):
    return load_config(TINY, [f'out="{out}"', f"train.steps={steps}", "checkpoint.every=1",
                              "rollout.prompts_per_step=2", "log.progress=false", "log.tensorboard=false",
                              "log.plot_groups=false", "log.samples=0", "eval.prompts=4"])


def test_metrics_are_fsynced_before_each_checkpoint_and_lost_lines_are_named(tmp_path, monkeypatch):
    run = tmp_path / "run"
    events: list[tuple[str, int]] = []  # (what was fsynced, metrics.jsonl lines on disk then)
    weights: list[str] = []  # the checkpoints whose weights were written, in order
    real = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        lines = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
        events.append(("metrics" if path.name == "metrics.jsonl" else path.parent.name.split(".tmp-")[0], lines))
        if path.name == "model.safetensors":
            weights.append(events[-1][0])
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train(_cfg(run, 2), console=Console(quiet=True))
    monkeypatch.undo()
    for step in (1, 2):  # metrics.jsonl holding `step` lines is synced before the checkpoint of `step` is
        first_ckpt = next(i for i, (what, _) in enumerate(events) if what == f"step_{step:06d}")
        assert ("metrics", step) in events[:first_ckpt], events
    assert weights == ["step_000001", "step_000002"]  # the final checkpoint is the last step's, written once
    # a power loss took step 2's line (and left garbage bytes): the resume names the lost step and goes on
    text = (run / "metrics.jsonl").read_text().splitlines()[0] + "\n"
    (run / "metrics.jsonl").write_bytes(text.encode() + b"\xff\xfe\x00\x00garbage")
    out = io.StringIO()
    train(_cfg(run, 3), resume=True, console=Console(file=out, width=200))
    assert "holds no line for steps 2 (lost in a crash" in out.getvalue()
    assert [r["step"] for r in rows(run)] == [1, 3]


def test_side_logs_are_fsynced_with_metrics_before_each_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    synced: list[str] = []  # the file names fsynced, in order (checkpoint files by their directory)
    real = os.fsync

    def fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append(path.name if path.parent == run else path.parent.name.split(".tmp-")[0])
        return real(fd)

    cfg = _cfg(run, 1).model_copy(deep=True)
    cfg.log.samples, cfg.log.samples_every = 2, 1
    monkeypatch.setattr(os, "fsync", fsync)
    train(cfg, console=Console(quiet=True))
    monkeypatch.undo()
    first_ckpt = synced.index("step_000001")
    assert "samples.jsonl" in synced[:first_ckpt], synced  # written at step 1, durable before its checkpoint


def test_a_fresh_start_clears_a_killed_first_write_and_still_refuses_a_real_run(tmp_path, capsys):
    run = tmp_path / "run"
    left = run / "checkpoints" / f"step_000001.tmp-{_dead_pid()}"  # the first checkpoint write was killed
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"partial")
    train(_cfg(run, 1), console=Console(quiet=True))  # no run to continue: it starts, and says what it removed
    assert left.name in capsys.readouterr().err.replace("\n", "")
    assert not left.exists() and (run / "checkpoints" / "step_000001").is_dir()
    assert f"removed {left.name}: an incomplete write" in (run / "resume.log").read_text()
    with pytest.raises(Exception, match="already holds checkpoints"):  # a complete checkpoint: refused as before
        train(_cfg(run, 1), console=Console(quiet=True))


def test_a_trimmed_log_leaves_no_copy_of_a_killed_trim(tmp_path):
    from posttrain.reporting.sinks import keep_steps

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    stale = tmp_path / f"metrics.jsonl.tmp-{_dead_pid()}"  # a kill between writing the cut copy and its rename
    stale.write_text('{"step": 1}\n')
    keep_steps(log, 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
