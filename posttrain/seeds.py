"""Seeds: one stable 63-bit seed per purpose, derived from the run's seed and a name, and the seeding of
Python, NumPy and torch. Every module that draws randomness takes its seed from here, so that a run
(and its resume) sample the same numbers wherever they are drawn.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
