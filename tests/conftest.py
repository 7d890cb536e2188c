"""Shared fixtures: the repo root, the tiny recipe, quiet consoles, and a fresh local Ray per module."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.algorithms import losses
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
