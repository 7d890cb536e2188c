"""Resume verifies before it trusts, and a checkpoint write never destroys the last good state.

The first half works on checkpoints of a tiny model written by ``save_checkpoint``; the second half
damages the newest checkpoint of a real tiny GRPO run (or fills the "disk" while it is written) and
checks that the resumed run's remaining steps equal an uninterrupted run's.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import posttrain.run.checkpoint as ck
from posttrain.cli import main
from posttrain.config import load_config
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.run.checkpoint import (
    CheckpointError,
    ResumeFrom,
    choose_resume_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)
from posttrain.train.rl import train

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"
TIMING = ("time/", "throughput/")


# --- damage, one way per part of a checkpoint -----------------------------------------------------------


def _flip(path: Path) -> None:
    """Overwrite 4 bytes in the middle: same size, other content (bit rot, a bad copy)."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\x00\x01\x02\x03")


def weights_truncated(ckpt: Path) -> str:
    f = ckpt / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)  # a disk that filled, a copy cut short
    return "model.safetensors is"


def weights_corrupted(ckpt: Path) -> str:
    _flip(ckpt / "model.safetensors")
    return "model.safetensors does not match its checksum"


def trainer_state_corrupted(ckpt: Path) -> str:  # the optimizer, scheduler, RNG and loop state live here
    _flip(ckpt / "trainer_state.pt")
    return "trainer_state.pt does not match its checksum"


def manifest_missing(ckpt: Path) -> str:
    (ckpt / "manifest.json").unlink()
    return "manifest.json is missing"


def manifest_garbled(ckpt: Path) -> str:
    (ckpt / "manifest.json").write_text('{"model.safetensors": {"size": 12')
    return "manifest.json is unreadable"


def file_missing(ckpt: Path) -> str:
    (ckpt / "tokenizer.json").unlink()
    return "tokenizer.json is missing"


DAMAGE = [weights_truncated, weights_corrupted, trainer_state_corrupted, manifest_missing, manifest_garbled,
          file_missing]


def files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --- checkpoints of a tiny model ------------------------------------------------------------------------


@pytest.fixture
def model_and_tok(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    return load_model(str(d)), load_tokenizer(str(d))


@pytest.fixture
def three(tmp_path, model_and_tok):
    """RUN/checkpoints with intact checkpoints of steps 1, 2 and 3 (each trainer state {"v": step})."""
    model, tok = model_and_tok
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(root, step, model, tok, {"v": step}, keep=3)
    return root


def test_manifest_records_size_and_checksum_and_old_manifests_still_verify(three):
    ckpt = three / "step_000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    weights = manifest["model.safetensors"]
    assert weights["size"] == (ckpt / "model.safetensors").stat().st_size and len(weights["sha256"]) == 64
    # a manifest written before sizes were recorded: {file: sha256}
    (ckpt / "manifest.json").write_text(json.dumps({k: v["sha256"] for k, v in manifest.items()}))
    verify_checkpoint(ckpt)
    weights_truncated(ckpt)  # without a recorded size the checksum still catches it
    with pytest.raises(CheckpointError, match="model.safetensors does not match its checksum"):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_to_the_newest_intact_checkpoint_and_deletes_nothing(three, damage):
    before = files(three / "step_000003")
    expected = damage(three / "step_000003")
    damaged = files(three / "step_000003")
    warnings: list[str] = []
    chosen = choose_resume_checkpoint(three, True, warnings.append)
    assert chosen == three / "step_000002"
    assert load_trainer_state(chosen)["v"] == 2
    assert any("step_000003" in w and expected in w for w in warnings), warnings
    log = (three.parent / "resume.log").read_text()
    assert "resumed from step_000002" in log and f"rejected step_000003: {expected}" in log
    # nothing deleted: the damaged checkpoint is kept, as it was, out of the way of the resumed run
    assert files(three / "set_aside" / "step_000003") == damaged != before
    assert not (three / "step_000003").exists()
    assert latest_checkpoint(three) == chosen and (three / "latest").read_text() == "step_000002"


def test_no_intact_checkpoint_is_an_error_that_lists_each_and_why(three):
    weights_truncated(three / "step_000003")
    manifest_missing(three / "step_000002")
    file_missing(three / "step_000001")
    with pytest.raises(CheckpointError) as err:
        choose_resume_checkpoint(three, True, lambda m: None)
    text = str(err.value)
    assert "none of the 3 checkpoints" in text
    for name, why in [("step_000003", "model.safetensors is"), ("step_000002", "manifest.json is missing"),
                      ("step_000001", "tokenizer.json is missing")]:
        assert f"{name}: {why}" in text
    assert sorted(p.name for p in three.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


def test_resume_from_picks_that_step_or_says_why_not(three):
    assert bool(ResumeFrom(0))  # step 0 is still "resuming"
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 5 \(checkpoints of steps: 1, 2, 3\)"):
        choose_resume_checkpoint(three, ResumeFrom(5), lambda m: None)
    trainer_state_corrupted(three / "step_000001")
    with pytest.raises(CheckpointError, match="step_000001 does not verify: trainer_state.pt does not match"):
        choose_resume_checkpoint(three, ResumeFrom(1), lambda m: None)
    assert sorted(p.name for p in three.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    # an intact older step: the newer checkpoint is set aside (kept), so the run neither prunes its new
    # checkpoints in its favour nor resumes from it later
    warnings: list[str] = []
    assert choose_resume_checkpoint(three, ResumeFrom(2), warnings.append) == three / "step_000002"
    assert (three / "set_aside" / "step_000003" / "trainer_state.pt").exists()
    assert latest_checkpoint(three).name == "step_000002" and any("set_aside" in w for w in warnings)


def test_resume_verifies_once_and_again_only_when_a_file_changed(three, monkeypatch):
    hashed: list[str] = []
    real = ck._sha256
    monkeypatch.setattr(ck, "_sha256", lambda p: hashed.append(p.name) or real(p))
    chosen = choose_resume_checkpoint(three, True, lambda m: None)
    assert "model.safetensors" in hashed
    hashed.clear()
    load_trainer_state(chosen)  # what a trainer reads right after: no second pass over the weights
    assert hashed == []
    weights_truncated(chosen)
    with pytest.raises(CheckpointError, match="model.safetensors is"):
        load_trainer_state(chosen)


def test_a_failed_rewrite_of_the_same_step_keeps_the_old_one(tmp_path, model_and_tok, monkeypatch):
    # the final save after a periodic one rewrites that step: the old copy must survive a failure at
    # the moment the new one is renamed into place (it used to be removed before that rename)
    model, tok = model_and_tok
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, tok, {"v": "old"})
    real = os.replace

    def failing_replace(src, dst):
        if ".tmp-" in Path(src).name and Path(dst).name == "step_000001":
            raise OSError(errno.EIO, "injected: rename failed")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match="step_000001 is intact"):
        save_checkpoint(root, 1, model, tok, {"v": "new"})
    monkeypatch.undo()
    assert load_trainer_state(root / "step_000001")["v"] == "old"
    assert [p.name for p in root.iterdir() if p.name != "latest"] == ["step_000001"]  # no .tmp / .old left
    save_checkpoint(root, 1, model, tok, {"v": "new"})
    assert load_trainer_state(root / "step_000001")["v"] == "new"
    assert [p.name for p in root.iterdir() if p.name != "latest"] == ["step_000001"]


def test_a_crash_between_the_renames_of_a_rewrite_leaves_a_resumable_copy(three):
    # killed after the old step_000003 was renamed aside and before the new one took its place
    os.replace(three / "step_000003", three / "step_000003.old-4242")
    chosen = choose_resume_checkpoint(three, True, lambda m: None)
    assert chosen == three / "step_000003" and load_trainer_state(chosen)["v"] == 3


def test_retention_prunes_only_after_the_new_checkpoint_verified(tmp_path, model_and_tok, monkeypatch):
    model, tok = model_and_tok
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, tok, {"v": 1}, keep=1)
    real = ck._write_files

    def writes_short(tmp, *args):  # the writer reports success but the weights on disk are cut short
        real(tmp, *args)
        weights_truncated(tmp)

    monkeypatch.setattr(ck, "_write_files", writes_short)
    with pytest.raises(CheckpointError, match=r"model.safetensors is \d+ bytes, manifest.json says \d+ \(truncated"):
        save_checkpoint(root, 2, model, tok, {"v": 2}, keep=1)
    monkeypatch.undo()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001"]  # keep=1 did not prune it
    assert latest_checkpoint(root).name == "step_000001" and load_trainer_state(root / "step_000001")["v"] == 1


def test_a_full_disk_while_writing_the_trainer_state_keeps_the_previous_checkpoint(tmp_path, model_and_tok,
                                                                                   monkeypatch):
    model, tok = model_and_tok
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, tok, {"v": 1}, keep=1)
    monkeypatch.setattr(ck.torch, "save", _fills_disk(ck.torch.save, "step_000002"))
    with pytest.raises(CheckpointError, match="No space left on device.*step_000001 is intact"):
        save_checkpoint(root, 2, model, tok, {"v": 2}, keep=1)
    monkeypatch.undo()
    assert [p.name for p in root.iterdir() if p.name != "latest"] == ["step_000001"]
    assert load_trainer_state(root / "step_000001")["v"] == 1
    load_model(str(root / "step_000001"))


def _fills_disk(real_save, step_dir: str):
    """``torch.save`` that, for the trainer state of ``step_dir``, writes part of the file and then
    fails as a full disk does (ENOSPC); every other call saves normally.
    """

    def save(obj, f, *args, **kwargs):
        path = Path(f) if isinstance(f, str | os.PathLike) else None
        if path is not None and path.name == "trainer_state.pt" and path.parent.name.startswith(step_dir):
            path.write_bytes(b"\x80\x02" + b"\x00" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, f, *args, **kwargs)

    return save


# --- a real tiny run ----------------------------------------------------------------------------------


def _cfg(out: Path):
    return load_config(TINY, [f'out="{out}"', "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
                              "rollout.prompts_per_step=4", "log.progress=false", "log.tensorboard=false",
                              "log.plot_groups=false", "log.samples=0", "eval.prompts=8"])


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def strip(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(_cfg(run), console=Console(quiet=True))
    return run


def _same_run(run: Path, reference: Path) -> None:
    """Every step once, each equal to the uninterrupted run's, and the same final weights."""
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5, 6]
    assert strip(rows(run)) == strip(rows(reference))
    a = load_file(reference / "checkpoints" / "step_000006" / "model.safetensors")
    b = load_file(run / "checkpoints" / "step_000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    verify_checkpoint(run / "checkpoints" / "step_000006")


@pytest.mark.parametrize("damage", [weights_truncated, trainer_state_corrupted, manifest_missing, manifest_garbled,
                                    file_missing])
def test_damaged_newest_checkpoint_resumes_from_the_previous_one_as_an_uninterrupted_run(
        reference, tmp_path, damage, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    expected = damage(run / "checkpoints" / "step_000006")
    train(_cfg(run), resume=True, console=Console(quiet=True))
    assert expected in capsys.readouterr().err  # the warning names the file and what is wrong
    assert "resumed from step_000004" in (run / "resume.log").read_text()
    _same_run(run, reference)
    assert (run / "checkpoints" / "set_aside" / "step_000006").is_dir()  # the damaged one is kept


def test_a_disk_that_fills_during_a_checkpoint_write_loses_nothing(reference, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(ck.torch, "save", _fills_disk(ck.torch.save, "step_000004"))
    with pytest.raises(CheckpointError, match="step 4 .*No space left on device.*step_000002 is intact"):
        train(_cfg(run), console=Console(quiet=True))
    monkeypatch.undo()
    root = run / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name != "latest"] == ["step_000002"]  # no half-written dir
    load_trainer_state(root / "step_000002")
    load_model(str(root / "step_000002"))
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]  # step 4 was logged before its checkpoint failed
    # the user's next command, as the CLI runs it: the saved config, --resume
    assert main(["train", "--out", str(run), "--resume"]) == 0
    _same_run(run, reference)  # steps 3 and 4 re-run once each: no step twice in metrics.jsonl


def test_cli_resume_from_a_step(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    assert main(["train", "--out", str(run), "--resume-from", "3"]) == 2
    assert "no checkpoint of step 3 (checkpoints of steps: 2, 4, 6)" in capsys.readouterr().out
    assert main(["train", "--out", str(run), "--resume-from", "4"]) == 0
    assert (run / "checkpoints" / "set_aside" / "step_000006").is_dir()
    _same_run(run, reference)
