"""Writes that survive a killed process and a power loss: fsync of a file or a folder, and write-then-rename.

A run trusts three kinds of files after a crash: checkpoints (``run/checkpoint.py``), recorded batches
(``run/record.py``) and the append-only logs (``reporting/sinks.py``). Each is made durable the same way:
its bytes are fsynced before it is renamed into place, and the folder holding a new name is fsynced after,
so that neither the bytes nor the rename is lost. These two helpers are that one way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make ``path`` durable: a file's bytes, or a folder's entries (a rename inside it). Nothing to do when
    it does not exist; a platform where a folder cannot be opened or synced is left as it is.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError:
        if Path(path).is_dir():  # e.g. Windows: a folder cannot be opened; its files are synced
            return
        raise
    try:
        if Path(path).is_dir():
            with contextlib.suppress(OSError):
                os.fsync(fd)
        else:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], None]) -> int:
    """``write(tmp)`` into ``path.tmp-<pid>``, fsync it, rename it over ``path``; returns the bytes written.
    A failure (a full disk, an exception in ``write``) leaves ``path`` as it was and no temporary beside it.
    """
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_path(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
