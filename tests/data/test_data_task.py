"""DatasetTask and load_task: splits, deterministic order, length filtering, verification."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from posttrain.algorithms.registry import UnknownNameError
from posttrain.data import DatasetSpec, DatasetTask, filter_by_length, load_task
from posttrain.models.load import encode_chat
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rewards import REGISTRY
from posttrain.tasks.base import Example


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def gsm_rows(n, start=0):
    return [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"}
        for i in range(start, start + n)
    ]


@pytest.fixture
def gsm_task(tmp_path):
    return load_task(DatasetSpec(path=write_jsonl(tmp_path / "gsm.jsonl", gsm_rows(200)), preset="gsm8k"))


def test_hash_split_is_disjoint_and_complete(gsm_task, tmp_path):
    train, test = gsm_task.pools["train"], gsm_task.pools["test"]
    assert len(train) + len(test) == 200 == gsm_task.counts["records"]
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    assert 5 <= len(test) <= 40  # test_fraction 0.1 of 200, by hash
    # The split depends on the prompt only: reading the rows in another order changes nothing.
    again = load_task(DatasetSpec(path=write_jsonl(tmp_path / "rev.jsonl", gsm_rows(200)[::-1]), preset="gsm8k"))
    assert {ex.prompt for ex in again.pools["test"]} == {ex.prompt for ex in test}
    assert (gsm_task.name, gsm_task.verifier) == ("gsm8k", "math")


def test_examples_are_deterministic_shuffled_and_prefix_stable(gsm_task):
    a = gsm_task.examples("train", 20, seed=3)
    assert a == gsm_task.examples("train", 20, seed=3)
    assert a != gsm_task.examples("train", 20, seed=4)
    assert a == gsm_task.examples("train", 50, seed=3)[:20]
    assert len({ex.prompt for ex in a}) == 20  # no repeats within an epoch
    assert [ex.prompt for ex in a] != [ex.prompt for ex in gsm_task.pools["train"][:20]]  # shuffled
    assert all(ex in gsm_task.pools["test"] for ex in gsm_task.examples("test", 5, seed=0))


def test_cycling_past_the_pool_visits_every_example_once_per_epoch(gsm_task):
    pool = gsm_task.pools["test"]
    k = len(pool)
    stream = gsm_task.examples("test", 2 * k + 3, seed=1)
    assert Counter(ex.prompt for ex in stream[:k]) == Counter(ex.prompt for ex in pool)  # epoch 0: a permutation
    assert Counter(ex.prompt for ex in stream[k : 2 * k]) == Counter(ex.prompt for ex in pool)  # epoch 1
    assert stream[:k] != stream[k : 2 * k]  # each epoch has its own order


def test_stream_resumes_at_any_cursor(gsm_task):
    full = gsm_task.examples("train", 400, seed=7)  # crosses an epoch boundary (pool < 200)
    for start in (0, 13, 170, 199, 250):
        assert gsm_task.stream("train", start, 16, seed=7) == full[start : start + 16]


def test_separate_test_source_and_overlap_drop(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", gsm_rows(30))
    test = write_jsonl(tmp_path / "test.jsonl", gsm_rows(10, start=25))  # 5 prompts also in train
    task = load_task(DatasetSpec(path=train, test_path=test, preset="gsm8k"))
    assert len(task.pools["test"]) == 10 and len(task.pools["train"]) == 25
    assert task.counts == {"records": 30, "test_records": 10, "train_overlap_dropped": 5}
    assert not {ex.prompt for ex in task.pools["train"]} & {ex.prompt for ex in task.pools["test"]}


def test_dataset_dict_directory_with_test_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {"text": f"Write f{i}.", "code": f"def f{i}():\n    return {i}", "test_list": [f"assert f{i}() == {i}"]}
        for i in range(6)
    ]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    ).save_to_disk(str(tmp_path / "mbpp"))
    task = load_task(DatasetSpec(path=str(tmp_path / "mbpp"), preset="mbpp", test_split="test"))
    assert [len(task.pools[s]) for s in ("train", "test")] == [4, 2]
    assert (task.name, task.verifier) == ("mbpp", "code")
    assert task.pools["test"][0].fields["tests"] == ["assert f4() == 4"]
    assert task.extract(task.pools["test"][0].demonstration) == "def f4():\n    return 4"


def test_alphabet_covers_prompts_demonstrations_and_system_prompt(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm_rows(20))
    task = load_task(DatasetSpec(path=path, preset="gsm8k", system_prompt="Box it!", test_fraction=0.5))
    texts = [ex.prompt + ex.demonstration for pool in task.pools.values() for ex in pool]
    assert task.alphabet == "".join(sorted(set("".join(texts)) | set("Box it!\n")))
    # The tiny char-level tokenizer built from it encodes every prompt without <|unk|>.
    tok = build_char_tokenizer(task.alphabet)
    ids = encode_chat(tok, task.pools["train"][0].prompt, task.system_prompt)
    assert tok.unk_token_id not in ids


def test_filter_by_length_counts(tmp_path):
    examples = [Example(prompt="x" * n, answer="", demonstration="") for n in (3, 10, 5, 11, 10)]
    kept, dropped = filter_by_length(examples, lambda ex: len(ex.prompt), 10)
    assert [len(ex.prompt) for ex in kept] == [3, 10, 5, 10] and dropped == 1  # 10 tokens fits, 11 does not
    assert filter_by_length(examples, lambda ex: len(ex.prompt), 2) == ([], 5)

    rows = [{"prompt": "a" * n, "answer": "1"} for n in range(1, 41)]
    task = load_task(DatasetSpec(path=write_jsonl(tmp_path / "l.jsonl", rows), test_fraction=0.3))
    tok = build_char_tokenizer(task.alphabet)
    # The tiny chat template adds <bos><|user|> ... <|assistant|>: 3 tokens around the prompt.
    dropped = task.drop_long_prompts(lambda ex: len(encode_chat(tok, ex.prompt)), 3 + 25)
    assert sum(dropped.values()) == 15  # prompts of 26..40 characters
    assert task.counts["train_too_long_dropped"] == dropped["train"]
    assert max(len(ex.prompt) for pool in task.pools.values() for ex in pool) == 25


def test_verify_delegates_to_the_named_reward(monkeypatch):
    seen = {}

    def exact(prompt, completion, *, answer, scale=1.0, **fields):
        seen.update(fields)
        return scale if completion.strip() == answer else 0.0

    def broken(prompt, completion, **_):
        raise RuntimeError("boom")

    monkeypatch.setitem(REGISTRY._entries, "test_exact", exact)
    monkeypatch.setitem(REGISTRY._entries, "test_broken", broken)
    ex = Example(prompt="1+1=", answer="2", demonstration="2", fields={"hint": "small"})
    task = DatasetTask([ex], [], verifier="test_exact", verifier_params={"scale": 0.5})
    assert task.verify(" 2 ", ex) == 0.5 and task.verify("3", ex) == 0.0
    assert seen["hint"] == "small" and seen["example"] is ex and seen["task"] is task
    bad = DatasetTask([ex], [], verifier="test_broken")
    assert bad.verify("2", ex) == 0.0 and bad.verify_errors == 1
    with pytest.raises(UnknownNameError, match="no_such_reward"):
        DatasetTask([ex], [], verifier="no_such_reward").verify("2", ex)
    with pytest.raises(ValueError, match="would call itself"):
        DatasetTask([ex], [], verifier="task")


def test_empty_split_and_bad_arguments_raise():
    task = DatasetTask([Example("p", "a", "a")], [])
    with pytest.raises(ValueError, match="test split of task 'dataset' is empty"):
        task.examples("test", 1, seed=0)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        task.examples("dev", 1, seed=0)  # type: ignore[arg-type]
    assert task.examples("train", 0, seed=0) == []
    assert task.examples("train", 3, seed=0) == [task.pools["train"][0]] * 3


def test_spec_validation():
    with pytest.raises(ValidationError, match="extra"):
        DatasetSpec(path="x.jsonl", colums={})
    with pytest.raises(ValidationError, match="test_fraction"):
        DatasetSpec(path="x.jsonl", test_fraction=1.0)
    with pytest.raises(ValidationError, match="preset"):
        DatasetSpec(path="x.jsonl", preset="gsm")
    spec = DatasetSpec.model_validate({"path": "d", "fields": {"prompt": "q", "answer": None}, "max_examples": 5})
    assert spec.fields == {"prompt": "q", "answer": None} and not spec.has_test_source


def test_max_examples_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", gsm_rows(50))
    task = load_task(DatasetSpec(path=path, preset="gsm8k", max_examples=10))
    assert len(task) == 10
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_task(DatasetSpec(path=str(tmp_path / "missing.jsonl")))
