"""Readers: every format on a fixture the test writes, format detection and the error messages."""

from __future__ import annotations

import json
import sys

import pytest

from posttrain.data.readers import DataError, detect_format, read_records

ROWS = [
    {"question": "What is 2+3?", "answer": "5"},
    {"question": "What is 10*4?", "answer": "40"},
    {"question": 'Say, "hi"\nthen stop', "answer": "hi"},  # comma, quotes, newline survive CSV
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    """The same three rows in every file format."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {"jsonl": write_jsonl(tmp_path / "rows.jsonl", ROWS)}
    out["json"] = tmp_path / "rows.json"
    out["json"].write_text(json.dumps(ROWS))
    out["csv"] = tmp_path / "rows.csv"
    with out["csv"].open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    out["parquet"] = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), out["parquet"])
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_file_format_reads_the_same_rows(files, fmt):
    path = files[fmt]
    assert detect_format(str(path)) == fmt
    assert read_records(str(path)) == ROWS
    assert read_records(str(path), format=fmt, limit=2) == ROWS[:2]


def test_json_variants(tmp_path):
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 1, "data": ROWS}))
    assert read_records(str(wrapped)) == ROWS
    lines = write_jsonl(tmp_path / "lines.json", ROWS)  # JSON lines under a .json name
    assert read_records(str(lines)) == ROWS
    # Blank lines in JSONL are skipped.
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert read_records(str(spaced)) == ROWS[:2]


def test_csv_values_are_strings(tmp_path):
    path = tmp_path / "n.csv"
    path.write_text("prompt,answer\n1+1,2\n")
    assert read_records(str(path)) == [{"prompt": "1+1", "answer": "2"}]


def test_missing_file_unknown_format_and_bad_lines(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError):
        read_records("./not/here")
    weird = tmp_path / "rows.txt"
    weird.write_text("x")
    with pytest.raises(DataError, match=r"extension '\.txt'.*\.jsonl"):
        read_records(str(weird))
    with pytest.raises(DataError, match="unknown data format 'xml'.*jsonl, json, csv, parquet, disk, datasets"):
        read_records(str(weird), format="xml")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(str(bad))
    scalar = tmp_path / "scalar.jsonl"
    scalar.write_text("[1, 2]\n")
    with pytest.raises(DataError, match="expected a JSON object, got list"):
        read_records(str(scalar))
    with pytest.raises(DataError, match="split/subset apply to datasets sources only"):
        read_records(str(weird), format="csv", split="test")


def test_save_to_disk_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(single))
    assert detect_format(str(single)) == "disk"
    assert read_records(str(single)) == ROWS
    with pytest.raises(DataError, match="single Dataset without splits"):
        read_records(str(single), split="test")

    both = tmp_path / "both"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    ).save_to_disk(str(both))
    assert read_records(str(both)) == ROWS[:2]  # default split: train
    assert read_records(str(both), split="test") == ROWS[2:]
    with pytest.raises(DataError, match="no split 'validation'; splits: train, test"):
        read_records(str(both), split="validation")


def test_load_dataset_on_a_local_data_directory(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = tmp_path / "mydata"
    data.mkdir()
    write_jsonl(data / "train.jsonl", ROWS[:2])
    write_jsonl(data / "test.jsonl", ROWS[2:])
    assert detect_format(str(data)) == "datasets"
    assert read_records(str(data)) == ROWS[:2]
    assert read_records(str(data), split="test") == ROWS[2:]
    assert read_records(str(data), limit=1) == ROWS[:1]


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text("{}")
    with pytest.raises(ImportError, match=r"pip install posttrain\[datasets\]"):
        read_records(str(tmp_path / "d"))
