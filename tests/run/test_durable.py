"""posttrain.durable: the one fsync and write-then-rename that checkpoints, recorded batches and logs share."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.durable import fsync_path, write_atomic


def test_write_atomic_replaces_the_file_and_returns_its_size(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    target.write_text("step_000010")
    size = write_atomic(target, lambda tmp: tmp.write_text("step_000020"))
    assert target.read_text() == "step_000020"
    assert size == len("step_000020")  # 11 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary left beside it


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    target.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("ne")  # a full disk part way through
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_fsync_path_takes_files_folders_and_missing_paths(tmp_path: Path) -> None:
    f = tmp_path / "metrics.jsonl"
    f.write_text("{}\n")
    fsync_path(f)
    fsync_path(tmp_path)
    fsync_path(tmp_path / "absent")  # nothing to do, no error
