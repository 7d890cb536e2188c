"""Atomic, verified checkpoints: the model in Hugging Face format plus the trainer state.

Layout of ``RUN/checkpoints/step_000050/``: ``model.safetensors`` + ``config.json`` (loadable by
``AutoModelForCausalLM.from_pretrained``), the tokenizer files, ``trainer_state.pt`` (optimizer,
scheduler, RNG states, data cursor, step, ...), ``critic/`` when PPO's critic is trained (its own
Hugging Face model; its optimizer is in ``trainer_state.pt``) and ``manifest.json`` (sha256 of every file).
A checkpoint is written into ``step_000050.tmp-<pid>`` and renamed into place only when complete,
then ``RUN/checkpoints/latest`` is replaced atomically; a crash or a full disk at any point leaves
the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not verify."""


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trainer_state: dict,
    keep: int = 2,
    extra_models: dict[str, PreTrainedModel] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and prune to the newest ``keep``. Returns its path.

    ``extra_models`` (e.g. ``{"critic": value_model}``) are saved in Hugging Face format into
    subdirectories of that name; the manifest covers their files too.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, extra in (extra_models or {}).items():
            extra.save_pretrained(tmp / name, safe_serialization=True)
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
        manifest = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for p in (f for f in tmp.rglob("*") if f.is_file()):  # make the bytes durable before the rename
            with p.open("rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(ckpt_root / "latest", final.name)
    except BaseException as e:  # a full disk surfaces as OSError, SafetensorError, RuntimeError...
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt / SystemExit: cleaned up, propagate as is
        prev = latest_checkpoint(ckpt_root)
        kept = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint for step {step} ({e}); {kept}") from e
    _prune(ckpt_root, keep)
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and ".tmp" not in p.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint (per ``latest``, else the highest step), or None."""
    pointer = ckpt_root / "latest"
    if pointer.exists():
        p = ckpt_root / pointer.read_text().strip()
        if p.is_dir():
            return p
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and ".tmp" not in p.name)
    return done[-1] if done else None


def verify_checkpoint(path: Path) -> None:
    """Check every file against ``manifest.json``; raise :class:`CheckpointError` on a mismatch."""
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {path} has no manifest.json (incomplete write?)")
    manifest = json.loads(manifest_path.read_text())
    for name, digest in manifest.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (corrupted)")


def load_trainer_state(path: Path) -> dict:
    """Verify the checkpoint and return its trainer state (the model is loaded by the model loader)."""
    verify_checkpoint(path)
    return torch.load(path / "trainer_state.pt", weights_only=False)
