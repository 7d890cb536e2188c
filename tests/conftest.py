"""Shared fixtures: the repo root, the tiny recipe, and quiet consoles."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from posttrain.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"


@pytest.fixture
def quiet() -> Console:
    return Console(quiet=True)


@pytest.fixture
def tiny_cfg(tmp_path: Path):
    """Factory: the tiny recipe with overrides, writing into a fresh tmp run directory."""

    def make(*overrides: str, out: str | None = None) -> Config:
        return load_config(
            TINY,
            [f'out="{out or tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false", *overrides],
        )

    return make
