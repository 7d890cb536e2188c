"""Read a data source into a list of records (one ``dict`` of column -> value per row).

Sources and how the format is chosen when ``format`` is ``None`` (or ``"auto"``):

==============  ===============================================================================
format          source
==============  ===============================================================================
``jsonl``       a file ending ``.jsonl`` / ``.ndjson``: one JSON object a line (blank lines skipped)
``json``        a file ending ``.json``: a list of objects, an object holding one such list
                (``{"data": [...]}``), or JSON lines under a ``.json`` name
``csv``         a file ending ``.csv``: a header row; every value is a string
``parquet``     a file ending ``.parquet`` / ``.pq`` (read with pyarrow)
``disk``        a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
``datasets``    anything else ``datasets.load_dataset`` takes: a hub name (``"openai/gsm8k"`` with
                ``subset="main"``) or a local directory of data files
==============  ===============================================================================

``split`` only applies to ``disk`` and ``datasets`` sources; ``datasets`` is an optional
dependency (``pip install posttrain[datasets]``) imported only for those two formats.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Literal

Format = Literal["jsonl", "json", "csv", "parquet", "disk", "datasets"]
FORMATS: tuple[str, ...] = ("jsonl", "json", "csv", "parquet", "disk", "datasets")
EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
Record = dict[str, object]


class DataError(ValueError):
    """A data source cannot be read or mapped; the message names the source and what is wrong."""


def detect_format(source: str) -> Format:
    """The format of ``source`` from its extension or directory layout (see the module docstring).

    Raises:
        FileNotFoundError: ``source`` looks like a local path (a known extension, or starts with
            ``/``, ``./``, ``../`` or ``~``) but does not exist.

    """
    path = Path(source).expanduser()
    if path.is_dir():
        is_saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
        return "disk" if is_saved else "datasets"
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix not in EXTENSIONS:
            raise DataError(
                f"cannot tell the format of {source!r} from its extension {suffix!r}; "
                f"known extensions: {', '.join(EXTENSIONS)}; or set format to one of {', '.join(FORMATS)}"
            )
        return EXTENSIONS[suffix]
    if suffix in EXTENSIONS or source.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"data file {source!r} does not exist")
    return "datasets"  # a hub name such as "openai/gsm8k"


def read_records(
    source: str,
    *,
    format: str | None = None,  # noqa: A002 - the natural name in configs
    split: str | None = None,
    subset: str | None = None,
    limit: int | None = None,
) -> list[Record]:
    """Read ``source`` into records: ``[{column: value, ...}, ...]`` in source order.

    Args:
        source: a file, a directory, or a ``datasets`` hub name.
        format: one of :data:`FORMATS`; ``None`` or ``"auto"`` detects it (:func:`detect_format`).
        split: the split of a ``disk`` or ``datasets`` source (default ``"train"``, or the only
            split a saved ``DatasetDict`` has).
        subset: the configuration name of a ``datasets`` source (``load_dataset(path, subset)``).
        limit: keep only the first ``limit`` records.

    Raises:
        FileNotFoundError: a local path that does not exist.
        DataError: an unknown format, a malformed file, a split that the source does not have.
        ImportError: a ``disk``/``datasets`` source without the ``datasets`` package.

    """
    fmt = detect_format(source) if format in (None, "auto") else format
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {format!r} for {source!r}; choices: auto, {', '.join(FORMATS)}")
    if fmt in ("jsonl", "json", "csv", "parquet"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data file {source!r} does not exist")
        if split is not None or subset is not None:
            raise DataError(f"split/subset apply to datasets sources only, not to the {fmt} file {source!r}")
        records = _READERS[fmt](path)
    elif fmt == "disk":
        records = _read_disk(source, split)
    else:
        records = _read_hub(source, split, subset, limit)
    return records if limit is None else records[:limit]


def _read_jsonl(path: Path) -> list[Record]:
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            records.append(row)
    return records


def _read_json(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path)  # JSON lines under a .json name (common on the hub)
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of records or an object holding exactly one list")
        data = lists[0]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a list of JSON objects")
    return data


def _read_csv(path: Path) -> list[Record]:
    with path.open(encoding="utf-8", newline="") as f:
        return [dict(row) for row in csv.DictReader(f)]


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "parquet": _read_parquet}


def _import_datasets():  # noqa: ANN202 - the module, typed only when installed
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "reading Hugging Face datasets needs the `datasets` package: pip install posttrain[datasets]"
        ) from e
    return datasets


def _read_disk(source: str, split: str | None) -> list[Record]:
    datasets = _import_datasets()
    loaded = datasets.load_from_disk(str(Path(source).expanduser()))
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            split = "train" if "train" in splits or len(splits) != 1 else splits[0]
        if split not in splits:
            raise DataError(f"{source!r} has no split {split!r}; splits: {', '.join(splits)}")
        return loaded[split].to_list()
    if split is not None:
        raise DataError(f"{source!r} holds a single Dataset without splits; split {split!r} does not apply")
    return loaded.to_list()


def _read_hub(source: str, split: str | None, subset: str | None, limit: int | None) -> list[Record]:
    datasets = _import_datasets()
    try:
        loaded = datasets.load_dataset(source, subset, split=split or "train")
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        raise DataError(
            f"could not load {source!r} (subset {subset!r}, split {split or 'train'!r}) with "
            f"datasets.load_dataset: {type(e).__name__}: {e}"
        ) from e
    if limit is not None:
        loaded = loaded.select(range(min(limit, len(loaded))))
    return loaded.to_list()
