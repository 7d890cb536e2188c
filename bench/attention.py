"""Benchmark: posttrain's attention (``posttrain.models.attention``) against HF's sdpa, forward and
backward, at the shapes of a post-training step on a small model (not a test).

Each shape is ``B`` rows of ``Tq`` queries over ``Tk`` keys, 9 query heads over 3 K/V heads of size
64 (SmolLM2-135M's), a causal mask with the queries the last ``Tq`` positions (the update's second
forward: the completion against its cached prompt). A run is one forward and the backward of the sum
of squares of the output, with gradients for q, k and v; both sides run under bf16 autocast
(``model.autocast = "bfloat16"``) and in fp32, interleaved (A B A B), and the median is printed.
Where :func:`posttrain.models.attention.math_pays` is False (fp32, long sequences) posttrain's
function calls sdpa itself, so the two sides then time the same kernel.

    python bench/attention.py              # the shapes below, 5 timed runs each
    python bench/attention.py --smoke      # one small shape, 1 run

Last line: ``update_shape_ms=X sdpa_ms=Y speedup=Y/X`` (SmolLM2's update shape, bf16; speedup > 1:
posttrain's is faster).
"""

from __future__ import annotations

import argparse

import torch
from common import machine_line, median, timed_interleaved
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.models.attention import attention, math_pays

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (rows, queries, keys): the update's completion forward (64 x 64 tokens after 50-token prompts),
# longer completions, fewer rows of longer ones
SHAPES = [(64, 63, 113), (16, 127, 177), (16, 200, 250), (8, 256, 306), (32, 255, 305), (2, 1024, 1074)]


def one_run(fn: object, module: nn.Module, shape: tuple[int, int, int], bf16: bool) -> object:
    """A callable: forward and backward of ``fn`` at ``shape`` (fresh leaf gradients each call)."""
    b, tq, tk = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, HEADS, tq, HEAD_DIM, generator=gen, requires_grad=True)
    k = torch.randn(b, KV_HEADS, tk, HEAD_DIM, generator=gen, requires_grad=True)
    v = torch.randn(b, KV_HEADS, tk, HEAD_DIM, generator=gen, requires_grad=True)
    allowed = (torch.arange(tk)[None] <= torch.arange(tk - tq, tk)[:, None])[None, None].expand(b, 1, tq, tk)

    def run() -> float:
        for t in (q, k, v):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out, _ = fn(module, q, k, v, allowed, scaling=HEAD_DIM**-0.5)
        loss = out.float().square().sum()
        loss.backward()
        return float(loss.detach())

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="one small shape, 1 run")
    a = ap.parse_args()
    shapes, runs = ([(4, 15, 25)], 1) if a.smoke else (SHAPES, a.runs)
    print(machine_line())
    module = nn.Module()
    module.is_causal, module.training, module.num_key_value_groups = True, True, HEADS // KV_HEADS
    first: tuple[float, float] | None = None
    print(f"{'rows':>4} {'Tq':>5} {'Tk':>5} {'dtype':>6} {'scores':>8} {'path':>6} {'posttrain ms':>12} "
          f"{'sdpa ms':>8} {'speedup':>7}")
    for shape in shapes:
        for bf16 in (True, False):
            res = timed_interleaved({"posttrain": one_run(attention, module, shape, bf16),
                                     "sdpa": one_run(sdpa_attention_forward, module, shape, bf16)}, 1, runs)
            ours, theirs = (median(res[s][0]) * 1e3 for s in ("posttrain", "sdpa"))
            b, tq, tk = shape
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                path = "matmul" if math_pays(torch.empty(b, HEADS, tq, 1), torch.empty(b, KV_HEADS, tk, 1), 0.0, {}) \
                    else "sdpa"
            print(f"{b:>4} {tq:>5} {tk:>5} {'bf16' if bf16 else 'fp32':>6} "
                  f"{b * HEADS * tq * tk * 4 / 2**20:>6.1f}Mi {path:>6} {ours:>12.1f} {theirs:>8.1f} "
                  f"{theirs / ours:>6.2f}x")
            if first is None:
                first = (ours, theirs)
    assert first is not None
    print(f"update_shape_ms={first[0]:.2f} sdpa_ms={first[1]:.2f} speedup={first[1] / first[0]:.2f}")


if __name__ == "__main__":
    main()
