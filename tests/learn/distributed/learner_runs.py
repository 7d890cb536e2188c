"""What the sharded-learner tests share (test_fsdp.py, test_ray_learner.py): a run setting whose policy
moves, a run in one process beside the same run on 2 ranks resumed, and readers of a run directory's
checkpoints and metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.train.rl import train

# a policy that moves: the length reward varies within groups; 2 minibatches (old log-probs recomputed,
# dealt to the ranks), a KL term (the reference sharded too), micro-batches of 1-2 rows (padding passes)
COMMON = ("train.steps=3", "checkpoint.every=1", "checkpoint.keep=5", "eval.every=0", "eval.prompts=4",
          "rollout.prompts_per_step=3", "rollout.group_size=3", "train.minibatches=2",
          "algorithm.kl_coef=0.05", "train.lr=1e-2")


def saved(run: Path, file: str, step: int = -1) -> dict[str, torch.Tensor]:
    """A safetensors file of a run's checkpoint (the last by default)."""
    ckpt = sorted((run / "checkpoints").glob("step_*"))[step]
    return load_file(str(ckpt / file))


def weights(run: Path, step: int = -1) -> dict[str, torch.Tensor]:
    """The policy weights of a run's checkpoint (the last by default)."""
    return saved(run, "model.safetensors", step)


def adapter(run: Path, step: int = -1) -> dict[str, torch.Tensor]:
    """The LoRA adapter of a run's checkpoint (the last by default)."""
    return saved(run, "adapter_model.safetensors", step)


def one_process_and_two_ranks(tiny_cfg, quiet, tmp_path: Path, common: tuple, then: int) -> tuple[Path, Path]:
    """The run of ``common`` in one process (``one``), and the same run's first 2 steps on 2 ranks resumed
    for the rest on ``then`` processes (``two``); returns both run directories.
    """
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    two = str(tmp_path / "two")
    train(tiny_cfg(*common, "train.steps=2", "train.processes=2", out=two), console=quiet)
    train(tiny_cfg(*common, f"train.processes={then}", out=two), resume=True, console=quiet)
    return tmp_path / "one", tmp_path / "two"


def rows(run: Path) -> list[dict]:
    """A run's metrics, one dict a step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
