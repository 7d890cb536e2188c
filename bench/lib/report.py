"""What grpo_step.py and real_step.py print after a lockstep run: equal work, step times, phases,
peak memory, and the distance of each phase to a floor measured on the same machine.

Floors (fp32, this machine, nothing else assumed):

- update: the FLOPs the step needs, 6 x non-embedding parameters x positions + 6 x the lm_head on
  the completion positions, with each distinct prompt counted once (the G completions of a prompt
  share it), over the best rate of a ``[positions, hidden] @ [hidden, intermediate]`` matmul (plain or
  oneDNN-prepacked, the faster).
  The nominal count (every row with its own copy of the prompt, as TRL computes it) is printed too.
  Attention scores (quadratic in length) are not counted.
- generation: the prefill of the distinct prompts at that matmul rate, plus ``new_tokens`` decode
  steps, each the larger of its FLOPs (2 x parameters x rows, lm_head included) at the rate of a
  ``[rows, hidden] @ [hidden, intermediate]`` matmul and the time to read every weight once
  (measured as a matrix-vector product over a matrix of the model's size).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from common import median

from posttrain.planning.plan import Arch


class Dims(Arch):
    """A LLaMA-style model's sizes (``posttrain.planning.plan.Arch``: body, head, params), read from its
    ``config.json``.
    """

    @classmethod
    def from_dir(cls, path: str | Path) -> Dims:
        return cls.of(SimpleNamespace(**json.loads((Path(path) / "config.json").read_text())))


def matmul_flops_per_s(m: int, k: int, n: int, reps: int = 30, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-``reps`` FLOP/s of a ``[m, k] @ [k, n]`` in ``dtype`` (fp32 by default) on this machine: the
    faster of a plain matmul (MKL's sgemm in fp32) and oneDNN's on a prepacked ``[k, n]`` (what the engine's
    decode runs, bf16 and fp32: 1.3-2x MKL's rate at decode's few rows, ~1.15x at the update's thousands), so
    that no kernel beats the floor.
    """
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    best = _best_time(lambda: a @ b, reps, warmup=3)
    packed = _packed_matmul(b, m)
    if packed is not None:
        best = min(best, _best_time(lambda: packed(a), reps, warmup=3))
    return 2 * m * k * n / best


def _packed_matmul(b: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> x @ b`` on a oneDNN-prepacked copy of ``b`` ``[k, n]`` (bf16 or fp32); ``None`` for other dtypes
    or where this torch build has no prepacking.
    """
    if b.dtype not in (torch.bfloat16, torch.float32):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), rows)
        linear = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None
    return lambda x: linear(x, packed, None, "none", [], "")


def stream_bytes_per_s(nbytes: int, cols: int, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-``reps`` bytes/s of reading a ``dtype`` matrix of ``nbytes`` once (a matrix-vector product)."""
    size = torch.finfo(dtype).bits // 8
    w, x = torch.randn(max(nbytes // size // cols, 1), cols).to(dtype), torch.randn(cols).to(dtype)
    return w.numel() * size / _best_time(lambda: w @ x, reps, warmup=1)


def streamed_decode_matmuls_s(d: Dims, rows: int, reps: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-``reps`` seconds of one decode step's matmuls alone: ``[rows, hidden]`` through every
    layer's seven projections and the head, each layer with its own weights (so they stream from
    memory, as a real decode step reads them; the floor's matmul rate is a cache-resident matrix's).
    """
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    shapes = [(d.hidden, q), (d.hidden, kv), (d.hidden, kv), (q, d.hidden),
              (d.hidden, d.intermediate), (d.hidden, d.intermediate), (d.intermediate, d.hidden)]
    def matmul(k: int, n: int) -> Callable[[torch.Tensor], torch.Tensor]:  # prepacked, as the engine's
        w = torch.randn(k, n).to(dtype)
        return _packed_matmul(w, rows) or (lambda x: x @ w)

    layers = [[matmul(k, n) for k, n in shapes] for _ in range(d.layers)]
    head = matmul(d.hidden, d.vocab)
    xs = {k: torch.randn(rows, k).to(dtype) for k in {k for k, _ in shapes}}

    def step() -> None:
        for weights in layers:
            for (k, _), mm in zip(shapes, weights, strict=True):
                mm(xs[k])
        head(xs[d.hidden])

    return _best_time(step, reps, warmup=1)


def _best_time(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after ``warmup`` untimed ones, in seconds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def floors(d: Dims, prompts: int, group: int, prompt_tokens: float, new_tokens: int, reps: int,
           dtype: torch.dtype = torch.float32) -> dict:
    """FLOPs and floor times of one step's update and generation (module docstring), with matmuls and
    weight reads in ``dtype`` (bf16 for a mixed-precision comparison)."""
    rows, T, Lp = prompts * group, new_tokens, prompt_tokens
    shared_pos = round(prompts * Lp + rows * T)
    nominal_pos = round(rows * (Lp + T))
    head_pos = rows * T
    update_shared = 6 * d.body * shared_pos + 6 * d.head * head_pos
    update_nominal = 6 * d.body * nominal_pos + 6 * d.head * head_pos
    mm_update = matmul_flops_per_s(shared_pos, d.hidden, d.intermediate, reps, dtype)
    mm_decode = matmul_flops_per_s(rows, d.hidden, d.intermediate, reps * 10, dtype)
    # what one decode step reads (the lm_head once, tied or not)
    weight_bytes = torch.finfo(dtype).bits // 8 * (d.body + d.head)
    stream = stream_bytes_per_s(weight_bytes, d.hidden, max(reps // 6, 2), dtype)
    decode_step_flops = 2 * (d.body + d.head) * rows
    decode_step = max(decode_step_flops / mm_decode, weight_bytes / stream)
    decode_streamed = streamed_decode_matmuls_s(d, rows, max(reps // 10, 2), dtype)
    prefill = 2 * d.body * prompts * Lp + 2 * d.head * prompts
    gen_floor = prefill / mm_update + T * decode_step
    return {
        "update_flops": update_shared,
        "update_flops_nominal": update_nominal,
        "update_positions": shared_pos,
        "nominal_positions": nominal_pos,
        "mm_update": mm_update,
        "update_floor_s": update_shared / mm_update,
        "mm_update_shape": f"[{shared_pos}x{d.hidden}] @ [{d.hidden}x{d.intermediate}] {str(dtype)[6:]}",
        "mm_decode_shape": f"[{rows}x{d.hidden}] @ [{d.hidden}x{d.intermediate}] {str(dtype)[6:]}",
        "mm_decode": mm_decode,
        "stream": stream,
        "weight_bytes": weight_bytes,
        "decode_step_flops": decode_step_flops,
        "decode_step_floor_s": decode_step,
        "decode_streamed_s": decode_streamed,
        "decode_bound": "weight reads" if weight_bytes / stream > decode_step_flops / mm_decode else "matmul",
        "gen_floor_s": gen_floor,
        "gen_tokens": rows * T,
    }


def print_report(results: dict[str, dict], prompts: int, group: int, new_tokens: int, warmup: int) -> dict[str, float]:
    """Print equal work, step times, phases and memory of each side; returns each side's median step."""
    sides = list(results)
    for side in sides:
        r = results[side]
        lens, pt = r["completion_len_mean"], r["prompt_tokens"]
        print(
            f"{side:9s}: prompt tokens mean {sum(pt) / len(pt):.1f} (min {min(pt)}, max {max(pt)}, "
            f"{len(pt)} prompts); mean completion length {sum(lens) / len(lens):.2f} tokens (per step min "
            f"{min(lens):.2f}, expected {new_tokens}); completion tokens per step {prompts * group * min(lens):.0f}; "
            f"optimizer steps per generation {sorted(set(r['optimizer_steps']))}; median batch reward std "
            f"{median(r['reward_std']):.3f}"
        )
    if "trl" in results and sum(results["trl"]["eos_completions"]):
        print(f"trl      : {sum(results['trl']['eos_completions'])} completions contain EOS")
    step_s: dict[str, float] = {}
    for side in sides:
        r = results[side]
        cycles = r["step_s"][warmup:]
        step_s[side] = median(cycles)
        gen, upd = median(r["generate_s"][warmup:]), median(r["update_s"][warmup:])
        own = side.startswith("posttrain")
        how = "its time/generate_s, time/update_s" if own else "reward call -> on_step_end -> next"
        peak = r["peak_rss_steps_mb"]
        print(
            f"{side:9s} step: median {step_s[side]:.3f} s (min {min(cycles):.3f}, max {max(cycles):.3f}, "
            f"n={len(cycles)}); generation {gen:.3f} s + update {upd:.3f} s ({how}); peak RSS "
            f"{r['peak_rss_mb']:,.0f} MiB over the process, "
            + (f"{peak:,.0f} MiB while training" if peak is not None else "(no per-phase peak here)")
        )
    if "trl" in results:
        a, b = (results[s]["step_s"][warmup:] for s in ("posttrain", "trl"))
        print(
            f"ratio trl / posttrain: {step_s['trl'] / step_s['posttrain']:.2f} (fastest steps, less "
            f"sensitive to background load: {min(b) / min(a):.2f})"
        )
    return step_s


def print_floors(f: dict, results: dict[str, dict], warmup: int) -> None:
    """Print each side's generation and update against the floors of :func:`floors`."""
    G = 1e9
    print(
        f"floor, update: {f['update_flops'] / G:.1f} GFLOP (6 x non-embedding params x {f['update_positions']:,} "
        f"positions, each prompt once, + lm_head on completion positions; {f['update_flops_nominal'] / G:.1f} "
        f"GFLOP with every row's own prompt, {f['nominal_positions']:,} positions) at the same-size matmul rate "
        f"{f['mm_update_shape']} {f['mm_update'] / G:.1f} GFLOP/s = {f['update_floor_s']:.3f} s"
    )
    print(
        f"floor, generation: decode step {f['decode_step_flops'] / G:.2f} GFLOP at the rate of "
        f"{f['mm_decode_shape']} {f['mm_decode'] / G:.1f} GFLOP/s = "
        f"{f['decode_step_flops'] / f['mm_decode'] * 1e3:.1f} ms, reading "
        f"{f['weight_bytes'] / 2**20:,.0f} MiB of weights at {f['stream'] / 2**30:.1f} GiB/s = "
        f"{f['weight_bytes'] / f['stream'] * 1e3:.1f} ms: {f['decode_step_floor_s'] * 1e3:.1f} ms a step "
        f"({f['decode_bound']}-bound); prefill + decode steps {f['gen_floor_s']:.3f} s for {f['gen_tokens']:,} "
        f"tokens = {f['gen_tokens'] / f['gen_floor_s']:,.0f} tokens/s"
    )
    print(
        f"decode matmuls alone with the weights streamed (each layer its own, as a decode step reads them; "
        f"prepacked for oneDNN, as the engine runs them): "
        f"{f['decode_streamed_s'] * 1e3:.1f} ms a step = {f['decode_step_flops'] / f['decode_streamed_s'] / G:.1f} "
        f"GFLOP/s, so a decode with nothing but its matmuls reaches at most "
        f"{f['decode_step_floor_s'] / f['decode_streamed_s']:.0%} of the floor's decode steps"
    )
    for side, r in results.items():
        if side == "posttrain_lora":  # its update does less work (no gradients of the frozen weights)
            continue
        gen, upd = median(r["generate_s"][warmup:]), median(r["update_s"][warmup:])
        print(
            f"{side:9s}: generation {f['gen_tokens'] / gen:,.0f} tokens/s = {f['gen_floor_s'] / gen:.0%} of its "
            f"floor; update {f['update_flops'] / upd / G:.1f} GFLOP/s (needed work) = {f['update_floor_s'] / upd:.0%} "
            "of the same-size matmul rate"
        )


def final_line(step_s: dict[str, float]) -> str:
    """``posttrain_step_s=X trl_step_s=Y speedup=Y/X`` (``n/a`` without a TRL side), then
    ``lora_step_s=L`` when there is a ``posttrain_lora`` side.
    """
    pt = step_s["posttrain"]
    lora = f" lora_step_s={step_s['posttrain_lora']:.4f}" if "posttrain_lora" in step_s else ""
    if "trl" not in step_s:
        return f"posttrain_step_s={pt:.4f} trl_step_s=n/a speedup=n/a{lora}"
    tr = step_s["trl"]
    return f"posttrain_step_s={pt:.4f} trl_step_s={tr:.4f} speedup={tr / pt:.2f}{lora}"


def lora_line(results: dict[str, dict], step_s: dict[str, float], rank: int, warmup: int) -> str:
    """LoRA against full fine-tuning on the posttrain side: step, update and peak memory."""
    full, lora = results["posttrain"], results["posttrain_lora"]
    upd_full, upd_lora = (median(r["update_s"][warmup:]) for r in (full, lora))
    return (
        f"LoRA rank {rank} vs full fine-tuning (posttrain): step {step_s['posttrain_lora']:.3f} vs "
        f"{step_s['posttrain']:.3f} s ({step_s['posttrain'] / step_s['posttrain_lora']:.2f}x), update "
        f"{upd_lora:.3f} vs {upd_full:.3f} s, peak RSS {lora['peak_rss_mb']:,.0f} vs {full['peak_rss_mb']:,.0f} MiB"
    )
