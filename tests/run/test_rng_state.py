"""Checkpoint RNG state: CPU generators always, CUDA generators when a GPU is in use (dropout on a CUDA
model draws from them; without them a resumed GPU run with LoRA dropout diverged at its first step)."""

import random

import numpy as np
import pytest
import torch

from posttrain.run.checkpoint import rng_state, set_rng_state


def test_round_trip_restores_every_cpu_generator():
    state = rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_cuda_state_is_kept_only_where_it_can_be_restored():
    state = rng_state()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert "cuda" not in state
    # a checkpoint written on a GPU machine resumes on this one: its CUDA states are skipped when the
    # device count differs (here: none), never an error
    set_rng_state({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip():
    torch.zeros(1, device="cuda")  # initialise CUDA
    state = rng_state()
    a = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), a)
