"""Fixtures shared by the trainers' tests: DPO preference pairs, and a record of what the loop
feeds the advantage estimator."""

import json

import pytest

from posttrain.algorithms import advantages

# tiny.toml's task: reversed 2-digit sums, so "12+34=" is answered "64" (46 reversed)
DPO_PAIRS = [
    {"q": "12+34=", "good": "64", "bad": "55"},
    {"q": "51+57=", "good": "801", "bad": "9"},
    {"q": "20+13=", "good": "33", "bad": "34"},
    {"q": "45+45=", "good": "09", "bad": "90"},
    {"q": "66+11=", "good": "77", "bad": "78"},
]


@pytest.fixture
def dpo_pairs():
    """Five hand-written preference pairs (fields q / good / bad)."""
    return [dict(p) for p in DPO_PAIRS]


@pytest.fixture
def pairs_file(tmp_path, dpo_pairs):
    """The pairs as a JSONL file."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in dpo_pairs))
    return path


@pytest.fixture
def advantage_calls(monkeypatch):
    """The keyword inputs of every ``advantages.compute`` call during the test, in order."""
    seen = []
    compute = advantages.compute

    def spy(name, rewards, **kwargs):
        seen.append(kwargs)
        return compute(name, rewards, **kwargs)

    monkeypatch.setattr(advantages, "compute", spy)
    return seen
