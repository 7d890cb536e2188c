"""Shared fixtures: the repo root, the tiny recipe, quiet consoles, a fresh local Ray per module, DPO
preference pairs, and a record of what the loop feeds the advantage estimator."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.algorithms import advantages, losses
from posttrain.config import Config, load_config
from posttrain.rewards import REGISTRY as REWARDS

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"


@pytest.fixture(scope="module", autouse=True)
def _fresh_ray_per_module():
    """Shut down the local Ray that a module's runs started, so that the next module starts its own.

    A local Ray lives as long as the test process; after a test that kills actors on purpose its GCS once
    stopped answering the next module's actor registration (a CI run hung in ``internal_kv_put``).
    """
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _plugins_per_module():
    """Forget the plugins a module's recipes imported (their tasks, rewards, environments...), so that a later
    module sees the built-in registries only (e.g. tests/tasks' exact list of task names).
    """
    from posttrain.plugins import loaded_plugins, unload_plugins

    before = set(loaded_plugins())
    yield
    unload_plugins(set(loaded_plugins()) - before)


@pytest.fixture
def quiet() -> Console:
    return Console(quiet=True)


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """Factory: the tiny recipe with overrides, writing into a fresh tmp run directory."""

    def make(*overrides: str, out: str | None = None) -> Config:
        return load_config(
            TINY,
            [
                f'out="{out or tmp_path / "run"}"',
                "log.progress=false",
                "log.tensorboard=false",
                "log.plot_groups=false",
                *overrides,
            ],
        )

    return make


def _length(prompt, completion, **_):
    return float(len(completion))  # varies within a group, so advantages are non-zero


def _step_reward(prompt, completion, **_):
    return float(len(completion) > 3)  # a {0,1} reward that varies within groups


def _raises_sometimes(prompt, completion, **_):
    if len(completion) % 2:
        raise RuntimeError("boom")
    return float("nan") if completion.startswith("1") else 0.5


def _hangs_sometimes(prompt, completion, **_):
    if len(completion) % 3 == 0:
        time.sleep(3600)
    return 0.0


def _group_varies(prompt, completion, **_):
    # all-equal for prompts that start with an even digit (dropped by dynamic sampling)
    return float(len(completion) % 2) if int(prompt[0]) % 2 else 1.0


def _nan_loss(logprobs, old_logprobs, advantages, mask):
    """A loss that is always NaN (for the non-finite guard test)."""
    return logprobs * float("nan")


@pytest.fixture
def test_entries(monkeypatch):
    """Test-only rewards and a NaN loss, registered for one test; the registries are restored after."""
    for name, fn in (("test_length", _length), ("test_step_reward", _step_reward),
                     ("test_raises_sometimes", _raises_sometimes), ("test_group_varies", _group_varies),
                     ("test_hangs_sometimes", _hangs_sometimes)):
        monkeypatch.setitem(REWARDS._entries, name, fn)
    monkeypatch.setitem(losses.REGISTRY._entries, "test_nan_loss", _nan_loss)


@pytest.fixture
def length_reward(test_entries):
    """A reward that varies within groups, so the policy moves every step (the test_length entry)."""
    return ['reward=[{name="test_length"}]']


@pytest.fixture
def prepare_calls(monkeypatch):
    """Every (batch, prepared) pair ``rl.prepare`` sees and makes during the test, in order (a spy that
    calls the real phase)."""
    from posttrain.train import rl

    seen = []
    real = rl.prepare

    def spy(ctx, selector, batch, live, step):
        prep = real(ctx, selector, batch, live, step)
        seen.append((batch, prep))
        return prep

    monkeypatch.setattr(rl, "prepare", spy)
    return seen

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
