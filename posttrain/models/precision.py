"""Mixed precision: matmuls in bfloat16 under ``torch.autocast``, weights, gradients and AdamW in fp32.

``model.autocast = "bfloat16"`` makes the hf engine's sampling and the learner's forward and backward
passes run their matrix products in bfloat16 while the parameters, their gradients and the optimizer's
moments stay in ``model.dtype`` (float32): the usual mixed-precision recipe, as TRL's ``bf16 = True``
and verl's FSDP ``param_dtype = bf16`` with fp32 masters. On a CPU with AVX512-BF16 (this project's
2-core machines) a bfloat16 matmul of SmolLM2-135M's shapes runs 2.3-3x the fp32 rate ([4495x576] @
[576x1536]: 406 vs 177 GFLOP/s; the [341x576] @ [576x49152] output head: 367 vs 124 GFLOP/s); on a
GPU, bfloat16 is the tensor cores' format. Elementwise work (norms, softmax, the log-probs) stays in
fp32, and so do the log-probs the loss reads; they differ from fp32 ones by bfloat16's rounding
(about 1e-2 relative), the sampler's from the learner's by as much (see ``offpolicy/mismatch_k3``).

The learner's FSDP2 ranks (spawned or Ray actors) run their share of the update under the same
autocast, Ray rollout workers build their hf engines with it, and ``posttrain sft``, ``dpo``, ``rm``
and ``rft`` run their forward passes under it.

Autocast casts each fp32 weight once per region (its cache holds leaf tensors that require a
gradient), so a generate call or a micro-batch pays one cast of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = {"off": None, "bfloat16": torch.bfloat16}


def autocast_dtype(name: str) -> torch.dtype | None:
    """The compute dtype of ``model.autocast`` (``None``: off)."""
    if name not in DTYPES:
        raise ValueError(f"model.autocast = {name!r}: choose one of {list(DTYPES)}")
    return DTYPES[name]


@contextlib.contextmanager
def compute(device: torch.device | str, dtype: torch.dtype | None) -> Iterator[None]:
    """Matmuls on ``device`` in ``dtype`` inside the block (``None``: as the tensors are)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


def active_dtype(device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype in force on ``device``'s type here, or ``None``."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
