"""A cost model of one RL step at scale: generation, update and weight sync, synchronous vs asynchronous.

``docs/scaling.md`` uses it to predict what the loop's layouts give at 8, 64 and 512 GPUs and checks
it against the step times that verl, AReaL and NeMo-RL publish (``bench/scale_model.py``).

A step samples ``seqs`` completions (prompts x group) whose lengths follow a log-normal distribution
of mean ``mean_response`` and shape ``sigma``, cut at ``max_response`` (reasoning lengths are heavy
tailed; the cut is where truncated responses pile up), then trains on all of them.

- **Generation** runs on engines of ``tp`` devices each. A decode step of an engine holding b
  sequences of contexts c_i reads the weights once and each sequence's K/V, and computes 2 x params
  FLOP per sequence:

      t(b) = t0 + W / (tp B e_bw) + sum_i c_i kv / (tp B e_bw) + b 2 P / (tp F e_dec)

  (W weight bytes, kv K/V bytes per token, B memory bandwidth, F peak FLOP/s, e_bw and e_dec the
  fractions of them an engine reaches; t0 a fixed cost per step whatever the batch: the engine's
  CPU work between steps, launches and the tensor-parallel all-reduces' latency, which does not
  shrink with tp). Every other term shrinks with tp, so t0 weighs most in the tail of a long
  response on a wide engine. *Synchronous* generation is simulated step by step: each
  engine starts its share of the batch (at most ``max_seqs`` at once, refilled as sequences end)
  and the phase ends when its longest sequence does, so the tail of long responses decodes at a
  small batch. *Streaming* generation (asynchronous training with partial rollouts) keeps every
  engine full, so the phase costs the batch's tokens at the full-batch rate.
- **Update**: 6 x params FLOP per trained token (2 more when the old log-probs are recomputed by
  the learner, as colocated verl does), at ``mfu`` of peak on the training devices, plus FSDP's
  collectives per optimizer step (3 x the weights' bytes, not overlapped with compute).
- **Weight sync**: the weights' bytes over the link between learner and engines, plus a fixed cost.

``sync_step`` runs everything on the same N devices one phase after the other; ``async_step``
splits N into R engine devices and N - R learner devices (the best split in whole engines) and
overlaps: the step is the slower side plus the sync. All efficiencies are inputs; ``docs/scaling.md``
says which were measured (here, on the H200) and which were taken from the published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense peak FLOP/s in the training dtype, memory bandwidth and capacity in bytes."""

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    link_bw: float = 25e9  # between nodes, bytes/s a device (weight sync; the learner's collectives past 8 devices)
    nvlink_bw: float = 300e9  # within a node of 8 devices, bytes/s a device (the learner's collectives)
    e_bw: float = 0.7  # share of the bandwidth a decode step reaches
    e_dec: float = 0.4  # share of peak FLOP/s a decode step's matmuls reach
    mfu: float = 0.35  # share of peak FLOP/s the update reaches on learner-only devices
    mfu_colocated: float | None = None  # the same where the engine shares the devices (None: mfu)
    kv_frac: float = 0.85  # share of an engine's memory left for weights + K/V (vLLM's gpu_memory_utilization)
    # t0, seconds a decode step costs whatever its batch (scheduling, input preparation, the sampled
    # tokens' trip to the host, output processing). Public figures for vLLM: about 4 ms of GPU idle a
    # step in V0 (vllm issue #6854, an 8B model on H100), 5-6 ms at batch 256 with V0's asynchronous
    # output processing (#10634, Llama-2-7B), an estimated 0.2-0.3 ms once that work overlaps the GPU's
    # (#10634; V1's separate engine-core process, asynchronous scheduling in PR #19970). The default,
    # 1 ms, is a round figure between the two, nearer the overlapped end where V1 engines run; not
    # measured here (no GPU with vLLM yet).
    step_overhead_s: float = 1e-3


@dataclass(frozen=True)
class Model:
    """A decoder's size: parameters, K/V bytes per token (all layers), bytes per weight."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights."""
        return self.params * self.dtype_bytes

    @property
    def kv_bytes(self) -> float:
        """K and V of one token in every layer."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Workload:
    """One step's batch: completions, their length distribution, the prompt length, engine layout."""

    seqs: int
    prompt: float
    mean_response: float
    max_response: int
    sigma: float = 1.0
    tp: int = 1
    max_seqs: int = 256  # vLLM's max_num_seqs per engine
    recompute_old: bool = True  # the learner recomputes old log-probs (colocated verl); async uses the sampler's
    max_staleness: int = 1  # asynchronous: a sample may be up to this many policy versions old
    optimizer_steps: int = 1  # minibatches a step: each moves the weights through the learner's collectives
    sync_fixed_s: float = 1.0


def response_lengths(w: Workload) -> list[int]:
    """``w.seqs`` lengths at evenly spaced quantiles of the log-normal (mean ``mean_response``), cut at the max."""
    mu = math.log(w.mean_response) - w.sigma**2 / 2
    nd = NormalDist(mu, w.sigma)
    out = [min(w.max_response, max(1, round(math.exp(nd.inv_cdf((i + 0.5) / w.seqs))))) for i in range(w.seqs)]
    return sorted(out, reverse=True)


def decode_step_s(m: Model, hw: Hardware, tp: int, batch: int, ctx_tokens: float) -> float:
    """t(b): one decode step of an engine of ``tp`` devices holding ``batch`` sequences, ``ctx_tokens`` in all."""
    bw = tp * hw.mem_bw * hw.e_bw
    flops = tp * hw.peak_flops * hw.e_dec
    return hw.step_overhead_s + (m.weight_bytes + ctx_tokens * m.kv_bytes) / bw + batch * 2.0 * m.params / flops


def engine_slots(m: Model, hw: Hardware, w: Workload) -> int:
    """Sequences an engine holds at once: ``max_seqs``, or fewer when their K/V at mean length does not fit."""
    free = w.tp * hw.mem_bytes * hw.kv_frac - m.weight_bytes
    if free <= 0:
        raise ValueError(f"{m.name} does not fit an engine of {w.tp} x {hw.name}: raise tp")
    per_seq = (w.prompt + w.mean_response) * m.kv_bytes
    return max(1, min(w.max_seqs, int(free / per_seq)))


def generation_sync_s(m: Model, hw: Hardware, w: Workload, devices: int) -> float:
    """Batched generation on ``devices``: each engine decodes its share until its longest sequence ends."""
    engines = max(1, devices // w.tp)
    lengths = response_lengths(w)
    shares = [lengths[e::engines] for e in range(engines)]  # round-robin: every engine gets long and short ones
    return max(_engine_time(m, hw, w, s) for s in shares[:1] + shares[-1:])


def _engine_time(m: Model, hw: Hardware, w: Workload, lengths: list[int]) -> float:
    """Simulate one engine: up to ``slots`` sequences decode together; a finished one frees its slot."""
    slots = engine_slots(m, hw, w)
    queue = sorted(lengths, reverse=True)  # longest first: the schedule that ends soonest
    running: list[int] = []  # remaining tokens of each running sequence
    ctx: list[float] = []  # context tokens of each running sequence
    total = 0.0
    while queue or running:
        while queue and len(running) < slots:
            running.append(queue.pop(0))
            ctx.append(w.prompt)
        n = min(running)  # advance to the next completion in one block of n decode steps
        mean_ctx = sum(ctx) + len(running) * n / 2.0  # over the block, contexts grow by n/2 on average
        total += n * decode_step_s(m, hw, w.tp, len(running), mean_ctx)
        ctx = [c + n for c in ctx]
        keep = [i for i, r in enumerate(running) if r > n]
        running = [running[i] - n for i in keep]
        ctx = [ctx[i] for i in keep]
    return total


def generation_stream_s(m: Model, hw: Hardware, w: Workload, devices: int) -> float:
    """Streaming generation (partial rollouts, staleness S): engines stay as full as the bound allows.

    An engine may hold up to (S + 1) steps' worth of its share in flight, so it decodes
    b = min(slots, (S + 1) x share) sequences at a time, and the step costs the batch's tokens at
    that rate. A long response is interrupted at each weight sync and continued (AReaL's and verl's
    partial rollouts), so it spreads over as many steps as it needs and no tail is waited for.
    """
    engines = max(1, devices // w.tp)
    batch = max(1, min(engine_slots(m, hw, w), round((w.max_staleness + 1) * w.seqs / engines)))
    step = decode_step_s(m, hw, w.tp, batch, batch * (w.prompt + w.mean_response / 2.0))
    return sum(response_lengths(w)) * step / (engines * batch)


def update_s(m: Model, hw: Hardware, w: Workload, devices: int, recompute_old: bool, colocated: bool = False) -> float:
    """The learner's pass over every trained token: 6 P FLOP (8 P with the old log-probs recomputed)."""
    tokens = w.seqs * w.prompt + sum(response_lengths(w))
    flop = (8.0 if recompute_old else 6.0) * m.params * tokens
    mfu = hw.mfu_colocated if colocated and hw.mfu_colocated is not None else hw.mfu
    return flop / (devices * hw.peak_flops * mfu) + collectives_s(m, hw, w, devices)


def collectives_s(m: Model, hw: Hardware, w: Workload, devices: int) -> float:
    """The sharded learner's traffic, not overlapped: per optimizer step FSDP gathers the weights for the
    forward and again for the backward and reduce-scatters the gradients, 3 x W x (N - 1) / N bytes a
    device, over NVLink within a node of 8 and over the network past it.
    """
    if devices < 2:
        return 0.0
    bw = hw.nvlink_bw if devices <= 8 else hw.link_bw
    return w.optimizer_steps * 3.0 * m.weight_bytes * (devices - 1) / devices / bw


def sync_s(m: Model, hw: Hardware, w: Workload, colocated: bool) -> float:
    """Weights to the engines: on the same devices a local copy at memory bandwidth, else over the link."""
    bw = hw.mem_bw * hw.e_bw if colocated else hw.link_bw
    return w.sync_fixed_s + m.weight_bytes / bw


@dataclass(frozen=True)
class Step:
    """One step's phases in seconds and the layout; ``tokens_per_s_per_device`` counts trained tokens."""

    layout: str
    devices: int
    engine_devices: int
    generate_s: float
    update_s: float
    sync_s: float
    step_s: float
    tokens: float

    @property
    def tokens_per_s_per_device(self) -> float:
        """Trained tokens per second per device (NeMo-RL's tokens/sec/GPU)."""
        return self.tokens / self.step_s / self.devices


def sync_step(m: Model, hw: Hardware, w: Workload, devices: int) -> Step:
    """Colocated synchronous step: generate on all devices, then update on all, then sync."""
    g = generation_sync_s(m, hw, w, devices)
    u = update_s(m, hw, w, devices, w.recompute_old, colocated=True)
    s = sync_s(m, hw, w, colocated=True)
    return Step("sync", devices, devices, g, u, s, g + u + s, _tokens(w))


def async_step(
    m: Model, hw: Hardware, w: Workload, devices: int, engine_devices: int | None = None, streaming: bool = True
) -> Step:
    """Split step: generation on R devices overlaps the update on the rest; the best R unless given.

    ``streaming``: partial rollouts keep the engines full (AReaL, verl's fully_async); without it the
    engines generate each batch as a whole while the learner trains the previous one (one-step
    off-policy: the overlap without the tail's cure).
    """
    if devices < 2 * w.tp and engine_devices is None:
        raise ValueError(f"an asynchronous layout needs at least one engine ({w.tp} devices) and one learner device")
    choices = [engine_devices] if engine_devices is not None else range(w.tp, devices, w.tp)
    best = None
    for r in choices:
        g = generation_stream_s(m, hw, w, r) if streaming else generation_sync_s(m, hw, w, r)
        u = update_s(m, hw, w, devices - r, recompute_old=False)
        s = sync_s(m, hw, w, colocated=False)
        step = Step("async" if streaming else "one_step_off", devices, r, g, u, s, max(g, u) + s, _tokens(w))
        if best is None or step.step_s < best.step_s:
            best = step
    return best


def _tokens(w: Workload) -> float:
    return w.seqs * w.prompt + sum(response_lengths(w))
