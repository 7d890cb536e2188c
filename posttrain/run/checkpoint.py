"""Atomic, verified checkpoints: the model in Hugging Face format plus the trainer state.

Layout of ``RUN/checkpoints/step_000050/``: ``model.safetensors`` + ``config.json`` (loadable by
``AutoModelForCausalLM.from_pretrained``), the tokenizer files, ``trainer_state.pt`` (optimizer,
scheduler, RNG states, data cursor, step, ...), ``critic/`` when PPO's critic is trained (its own
Hugging Face model; its optimizer is in ``trainer_state.pt``) and ``manifest.json`` (the size and
sha256 of every file; a manifest of older checkpoints holds the sha256 alone and still verifies).

A write never destroys the last good state: a checkpoint is written into ``step_000050.tmp-<pid>``,
verified against its manifest, and only then renamed into place (a checkpoint of the same step that
is already there is renamed aside first and removed only after the new one is in place); then
``RUN/checkpoints/latest`` is replaced atomically and, last, retention (``checkpoint.keep``) prunes
older checkpoints. A crash or a full disk at any point leaves the previous checkpoint intact.

Resume trusts nothing it has not verified: :func:`choose_resume_checkpoint` checks the candidate
against its manifest (sizes first, cheap, then sha256) before any file of it is loaded, falls back
to the newest intact checkpoint, names every rejected one with what is wrong, and writes that to
``RUN/resume.log``. It deletes no checkpoint: checkpoints newer than the one resumed from (damaged ones,
or ones ``--resume-from`` skipped) are moved into ``RUN/checkpoints/set_aside/`` so that the resumed run
neither prunes its own new checkpoints in their favour nor resumes from them later. What it does remove,
logged, is what a killed write left (``step_N.tmp-<pid>``, ``latest.tmp-<pid>``) when that cannot be a
write still running (:func:`remove_stale_writes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.durable import fsync_path, write_atomic

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
SET_ASIDE = "set_aside"  # RUN/checkpoints/set_aside/: checkpoints a resume stepped back from (never deleted)
RESUME_LOG = "resume.log"  # RUN/resume.log: every resume, what it verified and what it rejected
_NAME = re.compile(r"step_(\d+)(\.old-\d+)?")  # a checkpoint, or one renamed aside while its step is rewritten


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not verify."""


@dataclass(frozen=True)
class ResumeFrom:
    """``--resume-from STEP``: resume from the checkpoint of exactly this step (it must verify).

    Passed where a trainer takes ``resume`` (``True`` means the newest intact checkpoint); always
    truthy, so code that only asks "resuming?" treats step 0 like any other.
    """

    step: int


Resume = bool | ResumeFrom


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict:
    """Python, NumPy and torch global RNG states, and every CUDA device's when CUDA is in use (dropout
    on a GPU model, LoRA's for one, draws from the CUDA generator, not the CPU one).
    """
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured (the CUDA states where this machine has as many devices)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def _write_files(tmp: Path, step: int, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 trainer_state: dict, extra_models: dict[str, PreTrainedModel]) -> None:
    """Every file of a checkpoint into ``tmp``, the manifest last, each made durable."""
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name, extra in extra_models.items():
        extra.save_pretrained(tmp / name, safe_serialization=True)
    torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / TRAINER_STATE)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for p in (f for f in tmp.rglob("*") if f.is_file()):  # make the bytes durable before the rename
        fsync_path(p)


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trainer_state: dict,
    keep: int = 2,
    extra_models: dict[str, PreTrainedModel] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically, verify it, and only then prune to the newest ``keep``.

    ``extra_models`` (e.g. ``{"critic": value_model}``) are saved in Hugging Face format into
    subdirectories of that name; the manifest covers their files too. A checkpoint of the same
    step already in place (the final save after a periodic one) is renamed aside, not removed,
    until the new one has replaced it. Returns the checkpoint's path.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp-{os.getpid()}"
    aside = ckpt_root / f"step_{step:06d}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    placed = False  # the new checkpoint is in place (written and verified)
    try:
        _write_files(tmp, step, model, tokenizer, trainer_state, extra_models or {})
        verify_checkpoint(tmp)  # what was written reads back as written, before anything older is touched
        if final.exists():
            os.replace(final, aside)
        os.replace(tmp, final)
        placed = True
        fsync_path(ckpt_root)
        write_atomic(ckpt_root / "latest", lambda tmp: tmp.write_text(final.name))
    except BaseException as e:  # a full disk surfaces as OSError, SafetensorError, RuntimeError...
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not final.exists():
            os.replace(aside, final)  # the new one never arrived: the old one goes back
        elif aside.exists():
            shutil.rmtree(aside, ignore_errors=True)  # the new one is in place (verified); only `latest` failed
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt / SystemExit: cleaned up, propagate as is
        if placed and final.is_dir():
            raise CheckpointError(f"checkpoint {final} was written and verified, but {ckpt_root / 'latest'} could "
                                  f"not be updated ({e}); --resume takes {final.name}") from e
        prev = latest_checkpoint(ckpt_root)
        kept = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint for step {step} ({e}); {kept}") from e
    shutil.rmtree(aside, ignore_errors=True)
    _prune(ckpt_root, keep, step)
    return final


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory's name (``step_000050`` or one renamed aside), else None."""
    m = _NAME.fullmatch(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete-looking checkpoints under ``ckpt_root``, oldest step first (unverified).

    A directory renamed aside while its step was rewritten (``step_N.old-<pid>``) counts only when
    the crash left no ``step_N`` beside it; half-written ``.tmp-`` directories never count.
    """
    dirs = [p for p in ckpt_root.glob("step_*") if p.is_dir() and checkpoint_step(p) is not None]
    proper = {p.name for p in dirs if ".old-" not in p.name}
    found = [p for p in dirs if ".old-" not in p.name or p.name.split(".old-")[0] not in proper]
    return sorted(found, key=lambda p: (checkpoint_step(p), ".old-" in p.name))


def _prune(ckpt_root: Path, keep: int, step: int) -> None:
    """Remove all but the newest ``keep`` checkpoints up to ``step`` (the one just written and
    verified); a newer one, which only a resume that stepped back could leave, is not counted.
    """
    done = [p for p in list_checkpoints(ckpt_root) if checkpoint_step(p) <= step]
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint (per ``latest``, else the highest step), or None. Unverified:
    resuming goes through :func:`choose_resume_checkpoint`.
    """
    pointer = ckpt_root / "latest"
    if pointer.exists():
        p = ckpt_root / pointer.read_text().strip()
        if p.is_dir() and checkpoint_step(p) is not None:
            return p
    done = list_checkpoints(ckpt_root)
    return done[-1] if done else None


def _manifest_entries(path: Path) -> dict[str, tuple[int | None, str]]:
    """``manifest.json`` as ``{file: (size or None, sha256)}``; raises ValueError naming what is wrong."""
    manifest = json.loads((path / MANIFEST).read_text())
    if not isinstance(manifest, dict) or not manifest:
        raise ValueError("not a non-empty JSON object of files")
    entries = {}
    for name, entry in manifest.items():
        if isinstance(entry, str):  # older checkpoints: the checksum alone
            entries[name] = (None, entry)
        elif isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("size"), int):
            entries[name] = (entry["size"], entry["sha256"])
        else:
            raise ValueError(f"the entry of {name!r} is {entry!r}, not {{'size': int, 'sha256': str}}")
    if TRAINER_STATE not in entries:
        raise ValueError(f"{TRAINER_STATE} is not listed")
    return entries


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with checkpoint ``path`` measured against its manifest, or None when it verifies.

    Every listed file must be present with the listed size (checked for all files first: cheap, and
    it names a truncated file without reading gigabytes) and the listed sha256.
    """
    if not (path / MANIFEST).is_file():
        return f"{MANIFEST} is missing (an incomplete write?)"
    try:
        entries = _manifest_entries(path)
    except (ValueError, UnicodeDecodeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, (size, _) in entries.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing (listed in {MANIFEST})"
        if size is not None and (found := f.stat().st_size) != size:
            return f"{name} is {found} bytes, {MANIFEST} says {size} (truncated or cut short)"
    for name, (_, digest) in entries.items():
        if (found := _sha256(path / name)) != digest:
            return (f"{name} does not match its checksum in {MANIFEST} (sha256 {found[:16]}..., expected "
                    f"{digest[:16]}...: corrupted)")
    return None


_verified: dict[Path, tuple] = {}  # checkpoints verified by this process, with their files' (size, mtime, inode)


def _signature(path: Path) -> tuple:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return tuple((p.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino)
                 for p, st in ((p, p.stat()) for p in files))


def _check(path: Path, remember: bool) -> str | None:
    """:func:`checkpoint_problem`, skipped for a checkpoint this process verified whose files are unchanged."""
    key = path.resolve()
    if key in _verified and _verified[key] == _signature(path):
        return None
    problem = checkpoint_problem(path)
    if problem is None and remember:
        _verified[key] = _signature(path)
    return problem


def verify_checkpoint(path: Path, remember: bool = False) -> None:
    """Check every file against ``manifest.json``; raise :class:`CheckpointError` naming what is wrong.

    ``remember``: note that ``path`` verified, so that a second verification in this process (the
    trainer state read after a resume verified the checkpoint) hashes again only if a file changed
    (size, modification time or inode).
    """
    problem = _check(path, remember)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}")


def load_trainer_state(path: Path) -> dict:
    """Verify the checkpoint and return its trainer state (the model is loaded by the model loader)."""
    verify_checkpoint(path)
    return torch.load(path / TRAINER_STATE, weights_only=False)


def choose_resume_checkpoint(ckpt_root: Path, resume: Resume, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from, verified before anything of it loads; None when not resuming
    or when no checkpoint was written yet (the run starts from step 0).

    ``resume=True``: the newest checkpoint that verifies; each newer one that does not is named with
    what is wrong (``warn`` and ``RUN/resume.log``). ``ResumeFrom(step)``: that step's checkpoint,
    else a :class:`CheckpointError`. With checkpoints but none intact, the error lists each and why
    it was rejected. Checkpoints newer than the chosen one are moved to ``checkpoints/set_aside/``
    (nothing is deleted) and ``latest`` names the chosen one.
    """
    if not resume:
        return None
    remove_stale_writes(ckpt_root, warn)
    found = list_checkpoints(ckpt_root)
    if isinstance(resume, ResumeFrom):
        chosen, rejected = _pick_step(ckpt_root, found, resume.step), []
    elif not found:  # killed before its first checkpoint: nothing to distrust, the run starts over
        warn(f"--resume: {ckpt_root} holds no checkpoint yet; the run starts from step 0")
        _log_resume(ckpt_root, "no checkpoint found; starting from step 0")
        return None
    else:
        chosen, rejected = _pick_newest(ckpt_root, found)
    for path, problem in rejected:
        warn(f"checkpoint {path} is damaged, not resuming from it: {problem}")
    newer = [p for p in found if checkpoint_step(p) > checkpoint_step(chosen)]
    moved = [_set_aside(ckpt_root, p) for p in newer]
    if ".old-" in chosen.name:  # renamed aside by a rewrite that never completed: give it its name back
        proper = ckpt_root / f"step_{checkpoint_step(chosen):06d}"
        os.replace(chosen, proper)
        chosen = proper
    write_atomic(ckpt_root / "latest", lambda tmp: tmp.write_text(chosen.name))
    if moved:
        warn(f"resuming from {chosen}; the later checkpoints are kept, not used, in "
             f"{ckpt_root / SET_ASIDE}: {', '.join(p.name for p in moved)}")
    lines = [f"resumed from {chosen.name} (verified against its {MANIFEST})"]
    lines += [f"  rejected {p.name}: {why}" for p, why in rejected]
    lines += [f"  moved {p.name} -> {SET_ASIDE}/{q.name}" for p, q in zip(newer, moved, strict=True)]
    _log_resume(ckpt_root, "\n".join(lines))
    return chosen


_TMP = re.compile(r"(step_\d+|latest)\.tmp-(\d+)")  # a write in progress, or one a crash cut short


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _stale_reason(path: Path, pid: int, newest: Path | None) -> str | None:
    """Why ``path`` (``step_N.tmp-<pid>``/``latest.tmp-<pid>``) cannot be a write in progress, or None when it
    might be one. This process has not written yet (it is resuming), so its own pid on a directory is a
    recycled pid (a container restarts with the same pids); a dead pid cannot write; a pid that lives but
    belongs to another process (recycled again) is trusted to be stale only when the directory is older
    than the newest complete checkpoint and not of a later step (a run writes its steps in order).
    """
    if pid == os.getpid():
        return f"pid {pid} is this process, which has not written anything yet"
    if not _pid_alive(pid):
        return f"pid {pid} is not running"
    if newest is not None:
        step = checkpoint_step(Path(path.name.split(".tmp-")[0]))
        if (step is None or step <= checkpoint_step(newest)) and path.stat().st_mtime < newest.stat().st_mtime:
            return f"older than {newest.name}, the newest complete checkpoint"
    return None


def remove_stale_writes(ckpt_root: Path, warn: Callable[[str], None]) -> list[str]:
    """Remove ``step_N.tmp-<pid>`` directories (and ``latest.tmp-<pid>`` files) that a killed write left
    behind, each with a line in ``warn`` and ``RUN/resume.log``; returns their names. A write that might
    still be running (its pid lives and nothing says it is old: :func:`_stale_reason`) is left alone.
    They never count as checkpoints, but a partial copy of a model each fills the disk the next write needs.
    """
    if not ckpt_root.is_dir():
        return []
    done = list_checkpoints(ckpt_root)
    newest = done[-1] if done else None
    removed = []
    for path in sorted(ckpt_root.iterdir()):
        m = _TMP.fullmatch(path.name)
        if m is None or (why := _stale_reason(path, int(m.group(2)), newest)) is None:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
        warn(f"removed {path}, left by a checkpoint write that never completed ({why})")
        _log_resume(ckpt_root, f"removed {path.name}: an incomplete write ({why})")
    return removed


def _pick_newest(ckpt_root: Path, found: list[Path]) -> tuple[Path, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and the newer ones that did not with why."""
    rejected: list[tuple[Path, str]] = []
    for path in reversed(found):
        problem = _check(path, remember=True)
        if problem is None:
            return path, rejected
        rejected.append((path, problem))
    lines = "\n".join(f"  {p.name}: {why}" for p, why in rejected)
    _log_resume(ckpt_root, f"no intact checkpoint; nothing resumed\n{lines}")
    raise CheckpointError(
        f"--resume: none of the {len(found)} checkpoints in {ckpt_root} verifies against its {MANIFEST}:\n"
        f"{lines}\nNothing was deleted. Start a new run (another --out), or repair a checkpoint and resume."
    )


def _pick_step(ckpt_root: Path, found: list[Path], step: int) -> Path:
    """``--resume-from step``: that checkpoint, verified, or an error naming what there is."""
    steps = ", ".join(str(checkpoint_step(p)) for p in found) or "no checkpoint at all"
    match = [p for p in found if checkpoint_step(p) == step]
    if not match:
        raise CheckpointError(f"--resume-from {step}: {ckpt_root} holds no checkpoint of step {step} "
                              f"(checkpoints of steps: {steps})")
    problem = _check(match[0], remember=True)
    if problem is not None:
        _log_resume(ckpt_root, f"--resume-from {step}: {match[0].name} rejected: {problem}")
        raise CheckpointError(f"--resume-from {step}: checkpoint {match[0]} does not verify: {problem} "
                              f"(checkpoints of steps: {steps}; --resume takes the newest intact one)")
    return match[0]


def _set_aside(ckpt_root: Path, path: Path) -> Path:
    """Move ``path`` into ``checkpoints/set_aside/`` under a name not taken yet; returns where."""
    dest_dir = ckpt_root / SET_ASIDE
    dest_dir.mkdir(exist_ok=True)
    dest, n = dest_dir / path.name, 1
    while dest.exists():
        dest, n = dest_dir / f"{path.name}-{n}", n + 1
    os.replace(path, dest)
    return dest


def _log_resume(ckpt_root: Path, text: str) -> None:
    """Append a timestamped entry to ``RUN/resume.log`` (the run directory holds ``checkpoints/``)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with (ckpt_root.parent / RESUME_LOG).open("a") as f:
        f.write(f"{stamp} {text}\n")
