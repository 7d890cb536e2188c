"""What the sharded-learner tests share (test_fsdp.py, test_ray_learner.py): a run setting whose policy
moves, and readers of a run directory's checkpoints and metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

# a policy that moves: the length reward varies within groups; 2 minibatches (old log-probs recomputed,
# dealt to the ranks), a KL term (the reference sharded too), micro-batches of 1-2 rows (padding passes)
COMMON = ("train.steps=3", "checkpoint.every=1", "checkpoint.keep=5", "eval.every=0", "eval.prompts=4",
          "rollout.prompts_per_step=3", "rollout.group_size=3", "train.minibatches=2",
          "algorithm.kl_coef=0.05", "train.lr=1e-2")


def weights(run: Path, step: int = -1) -> dict[str, torch.Tensor]:
    """The policy weights of a run's checkpoint (the last by default)."""
    ckpt = sorted((run / "checkpoints").glob("step_*"))[step]
    return load_file(str(ckpt / "model.safetensors"))


def rows(run: Path) -> list[dict]:
    """A run's metrics, one dict a step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
