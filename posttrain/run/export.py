"""``posttrain export RUN --gguf out.gguf``: a run's checkpoint as one GGUF file (llama.cpp's format).

``RUN`` is a run directory (its latest checkpoint, per ``checkpoints/latest``), one checkpoint
(``RUN/checkpoints/step_N``), a Hugging Face model directory, or anything ``model.path`` takes
(a ``.gguf`` file, an alias). A checkpoint is verified against its ``manifest.json`` before it is
read: a damaged one would export garbage that loads without error. A LoRA run's checkpoint holds
the adapter alone; ``--merge-lora`` folds it into its base (W + (alpha / r) B A, as
``posttrain.models.load.load_merged`` does) and exports the merged model; without it the command
refuses, since GGUF holds whole models. The file format lives in :mod:`posttrain.models.gguf_export`.

This module's top level imports nothing heavy: ``posttrain --help`` builds its parser
(:func:`add_export_parser`); torch, transformers and gguf load with the command.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from posttrain.models.gguf_export import GGUFType

# --type's choices: posttrain.models.gguf_export.GGUF_TYPES (not imported here: it loads torch)
TYPES = ("f32", "f16", "bf16", "q8_0")


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export`` subcommand's arguments."""
    x = sub.add_parser("export", help="write a run's checkpoint (LLaMA family) as a GGUF file for llama.cpp")
    x.add_argument("run", help="a run directory (its latest checkpoint), a checkpoint, a model directory or .gguf")
    x.add_argument("--gguf", required=True, metavar="OUT", help="the .gguf file to write")
    x.add_argument("--type", dest="gguf_type", choices=TYPES, default="f16",
                   help="weight type: f32, f16 (default), bf16, or q8_0 (int8 blocks of 32 with an fp16 scale)")
    x.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run: fold the adapter into its base model and export the merged model")
    x.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    return ", ".join(names[:20]) + (f" (+{len(names) - 20} more)" if len(names) > 20 else "") or "nothing"


def export_source(run: str) -> str:
    """The model ``run`` names: a model or checkpoint directory itself, a run directory's latest
    checkpoint, a ``.gguf`` file or an alias (no hub id: a mistyped run directory would be looked up
    on the hub).

    Raises:
        GGUFExportError: a path that does not exist; a directory with neither a model nor a checkpoint,
            listing what it holds.
        ModelLoadError: a file that is no ``.gguf`` (from :func:`resolve_source`).

    """
    from posttrain.models.gguf_export import GGUFExportError
    from posttrain.models.load import ALIASES, resolve_source
    from posttrain.models.lora import is_adapter_dir
    from posttrain.run.checkpoint import latest_checkpoint

    p = Path(run).expanduser()
    if not p.exists() and run not in ALIASES:  # (resolve_source would take "runs/x" for a hub id)
        raise GGUFExportError(f"RUN={run!r} does not exist; give a run directory, a checkpoint, a model directory, "
                              f"a .gguf file or an alias ({', '.join(sorted(ALIASES))})")
    if not p.is_dir():
        resolve_source(run, key="RUN")
        return run
    if (p / "config.json").is_file() or is_adapter_dir(p):
        return str(p)
    root = p / "checkpoints"
    ckpt = latest_checkpoint(root) if root.is_dir() else None
    if ckpt is not None:
        return str(ckpt)
    where = f"; {root} holds {_listing(root)}" if root.is_dir() else ""
    raise GGUFExportError(
        f"RUN={run!r} holds no checkpoint to export: expected a run directory with checkpoints/step_N/, a "
        f"checkpoint or a model directory (config.json or adapter_config.json); found {_listing(p)}{where}"
    )


def export_run(run: str, out: str | Path, *, kind: GGUFType = "f16", merge_lora: bool = False, force: bool = False,
               console: Console | None = None) -> Path:
    """Export the model of ``run`` (see :func:`export_source`) to the GGUF file ``out``. Every check that
    needs no model (the gguf package, ``out``, the source, LoRA without ``merge_lora``) runs before any
    model loads.
    """
    from rich.console import Console

    from posttrain.models.gguf_export import GGUFExportError, check_gguf, write_gguf
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.models.lora import is_adapter_dir
    from posttrain.run.checkpoint import MANIFEST, verify_checkpoint

    console = console or Console(quiet=True)
    check_gguf()
    out = Path(out)
    if out.exists() and not force:
        raise GGUFExportError(f"{out} exists; pass --force to overwrite it")
    source = export_source(run)
    adapter = is_adapter_dir(source)
    if adapter and not merge_lora:
        raise GGUFExportError(
            f"{source} is a LoRA adapter checkpoint (adapter_config.json, no base weights); a GGUF file holds a whole "
            "model: pass --merge-lora to fold the adapter into its base model and export the merged model"
        )
    if merge_lora and not adapter:
        console.print(f"--merge-lora: {source} holds no LoRA adapter; exporting it as it is")
    if (Path(source) / MANIFEST).is_file():
        verify_checkpoint(Path(source))
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(source, key="RUN")
    model = load_model(source, "float32", "cpu", key="RUN").eval()
    path = write_gguf(model, tokenizer, out, kind=kind, name=_name(source), force=force)
    size = path.stat().st_size / 2**20
    console.print(f"wrote {path} ({kind}, {size:.1f} MiB) from {source} in {time.perf_counter() - t0:.1f} s")
    return path


def _name(source: str) -> str:
    """``general.name``: the run and checkpoint it came from (``runs/x/checkpoints/step_000050``: ``x step_000050``)."""
    p = Path(source)
    if p.parent.name == "checkpoints":
        return f"{p.parent.parent.name} {p.name}"
    return p.stem if p.suffix == ".gguf" else p.name or source


def cli_export(args: argparse.Namespace, console: Console) -> int:
    """``posttrain export``: the body of the command."""
    export_run(args.run, args.gguf, kind=args.gguf_type, merge_lora=args.merge_lora, force=args.force,
               console=console)
    return 0
