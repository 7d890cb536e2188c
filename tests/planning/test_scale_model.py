"""The step cost model: hand-computed phases, and the invariants its predictions rest on."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from posttrain.planning.scale_model import (
    Hardware,
    Model,
    Workload,
    _engine_time,
    async_step,
    collectives_s,
    decode_step_s,
    engine_slots,
    generation_stream_s,
    generation_sync_s,
    response_lengths,
    sync_s,
    sync_step,
    update_s,
)

# A round-number device and model: 1 TFLOP/s, 100 GB/s, 100 GB; 1e9 parameters in 2 bytes (W = 2 GB),
# K/V of 2 layers x 1 head x 4 dims x K and V x 2 bytes = 32 bytes a token; no fixed cost a step
# (test_step_overhead_by_hand adds one).
HW = Hardware("unit", 1e12, 1e11, 1e11, link_bw=1e10, e_bw=1.0, e_dec=1.0, mfu=0.5, step_overhead_s=0.0)
M = Model("unit", 1e9, layers=2, kv_heads=1, head_dim=4)
Q7 = Model("7B", 7.6e9, 28, 4, 128)
H100 = Hardware("H100", 989e12, 3.35e12, 80e9)


def test_decode_step_by_hand() -> None:
    # weights 2e9 B + 100 context tokens x 32 B = 2,000,003,200 B at 1e11 B/s = 0.020000032 s;
    # 2 sequences x 2 x 1e9 FLOP = 4e9 FLOP at 1e12 FLOP/s = 0.004 s; total 0.024000032 s
    assert M.kv_bytes == 32
    assert decode_step_s(M, HW, 1, 2, 100) == pytest.approx(0.024000032, rel=1e-12)
    # two devices in tensor parallel halve both terms
    assert decode_step_s(M, HW, 2, 2, 100) == pytest.approx(0.012000016, rel=1e-12)


def test_engine_simulation_by_hand() -> None:
    # lengths [3, 1], prompt 10, two slots: one step with both (contexts 10 + 10, +1/2 each on average over
    # the block: 21 tokens), then two steps with the long one alone (context 11, +2/2: 12 tokens on average)
    w = Workload(seqs=2, prompt=10, mean_response=2, max_response=3, max_seqs=2)
    want = 1 * decode_step_s(M, HW, 1, 2, 21.0) + 2 * decode_step_s(M, HW, 1, 1, 12.0)
    assert _engine_time(M, HW, w, [3, 1]) == pytest.approx(want, rel=1e-12)
    # one slot: the sequences run one after the other (1 step then 3, each alone)
    one = Workload(seqs=2, prompt=10, mean_response=2, max_response=3, max_seqs=1)
    want = 3 * decode_step_s(M, HW, 1, 1, 11.5) + 1 * decode_step_s(M, HW, 1, 1, 10.5)
    assert _engine_time(M, HW, one, [3, 1]) == pytest.approx(want, rel=1e-12)


def test_step_overhead_by_hand() -> None:
    # t0 = 5 ms a step, whatever the batch: test_decode_step_by_hand's 0.024000032 s becomes 0.029000032 s,
    # and at tp 2 0.012000016 + 0.005 = 0.017000016 s (tensor parallelism splits bytes and FLOP, not t0)
    hw = replace(HW, step_overhead_s=0.005)
    assert decode_step_s(M, hw, 1, 2, 100) == pytest.approx(0.029000032, rel=1e-12)
    assert decode_step_s(M, hw, 2, 2, 100) == pytest.approx(0.017000016, rel=1e-12)
    # test_engine_simulation_by_hand's engine decodes 3 steps (1 with both sequences, 2 with the long one):
    # 3 x 5 ms = 0.015 s more, however many sequences each step holds
    w = Workload(seqs=2, prompt=10, mean_response=2, max_response=3, max_seqs=2)
    assert _engine_time(M, hw, w, [3, 1]) - _engine_time(M, HW, w, [3, 1]) == pytest.approx(0.015, rel=1e-9)
    # one 1,000-token response after a 0-token prompt, alone on one device: 1,000 steps at 500 context tokens
    # on average, each 0.005 + (2e9 + 500 x 32) B / 1e11 B/s + 2e9 FLOP / 1e12 FLOP/s
    # = 0.005 + 0.02000016 + 0.002 = 0.02700016 s: 27.00016 s, of which t0 is 5 s
    one = Workload(seqs=1, prompt=0, mean_response=1000, max_response=1000, sigma=1e-6)
    assert response_lengths(one) == [1000]
    assert generation_sync_s(M, hw, one, 1) == pytest.approx(27.00016, rel=1e-9)
    assert generation_sync_s(M, HW, one, 1) == pytest.approx(22.00016, rel=1e-9)


def test_more_engines_at_most_divide_generation_by_as_much() -> None:
    # a step costs t0 + bytes + per-sequence terms: k x the engines cut the per-sequence part by k and the
    # longest response's steps not at all, so one workload's generation falls by at most k (bench/scale_model.py
    # prints this bound against verl's published 32/64/128-GPU rows)
    w = Workload(seqs=2048, prompt=150, mean_response=500, max_response=8192, tp=4, max_seqs=1024)
    gens = [generation_sync_s(Q7, H100, w, n) for n in (8, 16, 32, 64)]
    assert all(a > b >= a / 2 for a, b in zip(gens, gens[1:], strict=False))


def test_update_and_sync_by_hand() -> None:
    # 4 sequences x (10 prompt + 5 response) = 60 tokens x 6 x 1e9 FLOP = 3.6e11 FLOP at 2 devices x 1e12 x 0.5
    # = 0.36 s; 8 x 1e9 with the old log-probs recomputed: 0.48 s; the sync: 1 s + 2e9 B / 1e10 B/s = 1.2 s
    # plus FSDP's collectives: 3 x 2e9 B x (2 - 1) / 2 = 3e9 B over NVLink (300 GB/s) = 0.01 s an optimizer step
    w = Workload(seqs=4, prompt=10, mean_response=5, max_response=5, sigma=1e-6)
    assert response_lengths(w) == [5, 5, 5, 5]
    assert update_s(M, HW, w, 2, recompute_old=False) == pytest.approx(0.37)
    assert update_s(M, HW, w, 2, recompute_old=True) == pytest.approx(0.49)
    assert update_s(M, HW, w, 1, recompute_old=False) == pytest.approx(0.72)  # one device: no collectives
    # 16 devices span two nodes: 3 x 2e9 x 15/16 = 5.625e9 B over the 1e10 B/s link = 0.5625 s, x 4 steps
    assert collectives_s(M, HW, replace(w, optimizer_steps=4), 16) == pytest.approx(2.25)
    assert sync_s(M, HW, w, colocated=False) == pytest.approx(1.2)


def test_lengths_follow_the_distribution() -> None:
    w = Workload(seqs=4096, prompt=100, mean_response=1000, max_response=10**7, sigma=1.0)
    lengths = response_lengths(w)
    assert sum(lengths) / len(lengths) == pytest.approx(1000, rel=0.05)  # quantiles of the log-normal
    capped = response_lengths(Workload(seqs=4096, prompt=100, mean_response=1000, max_response=4096, sigma=1.0))
    assert max(capped) == 4096 and lengths == sorted(lengths, reverse=True)


def test_generation_has_a_tail_floor_that_streaming_removes() -> None:
    w = Workload(seqs=8192, prompt=150, mean_response=2048, max_response=16384)
    longest = response_lengths(w)[0]
    floor = longest * decode_step_s(Q7, H100, 1, 1, 150)  # the longest response alone, at batch 1
    times = [generation_sync_s(Q7, H100, w, n) for n in (8, 64, 512)]
    assert times[0] > times[1] > times[2] >= floor  # more devices help, down to the tail's floor
    assert times[2] < 1.5 * floor  # at 512 devices the tail is most of the phase
    stream = [generation_stream_s(Q7, H100, w, n) for n in (8, 64, 512)]
    assert all(s < t for s, t in zip(stream, times, strict=True))
    assert stream[2] < floor  # streaming is not bound by the longest response


def test_async_gain_grows_with_devices_and_sync_sums_its_phases() -> None:
    w = Workload(seqs=8192, prompt=150, mean_response=2048, max_response=16384)
    speedups = []
    for n in (8, 64, 512):
        s, a = sync_step(Q7, H100, w, n), async_step(Q7, H100, w, n)
        assert s.step_s == pytest.approx(s.generate_s + s.update_s + s.sync_s)
        assert a.step_s == pytest.approx(max(a.generate_s, a.update_s) + a.sync_s)
        assert 0 < a.engine_devices < n
        speedups.append(s.step_s / a.step_s)
    assert speedups[0] < speedups[1] < speedups[2]
    # one-step off without partial rollouts keeps the tail: never better than streaming
    off = async_step(Q7, H100, w, 64, streaming=False)
    assert off.step_s >= async_step(Q7, H100, w, 64).step_s


def test_refuses_a_model_that_does_not_fit() -> None:
    big = Model("400B", 4e11, 100, 8, 128)
    with pytest.raises(ValueError, match="raise tp"):
        engine_slots(big, H100, Workload(seqs=8, prompt=10, mean_response=10, max_response=10))
    assert engine_slots(Q7, H100, Workload(seqs=8, prompt=10, mean_response=10, max_response=10)) == 256
    assert math.isfinite(generation_sync_s(Q7, H100, Workload(seqs=8, prompt=10, mean_response=10, max_response=20), 8))
