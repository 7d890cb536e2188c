r"""Benchmark: the step cost model (``posttrain.planning.scale_model``) against published runs, and its predictions.

Not a timing of this machine: it evaluates the model of ``docs/scaling.md`` (generation simulated per
engine with the tail of long responses, the update at a fixed share of peak, the weight sync over a
link) with one set of efficiencies for every row (``--e-bw``, ``--e-dec``, ``--mfu``; defaults 0.7,
0.4, 0.35, not fitted) and a decode step's fixed cost (``--step-overhead-ms``, default 1 ms from
public vLLM figures, ``posttrain.planning.scale_model.Hardware``), and prints

1. the published step phases of verl's fully-async experiment (Qwen2.5-Math-7B on H20, 32/64/128
   GPUs, colocated synchronous vs a half/half split), NeMo-RL v0.4 (Llama-3.1-8B on 16 H100,
   on-policy vs one-step off) and AReaL v0.3 (R1-Distill-Qwen 1.5B/7B, 128/192 H800, sync vs
   async), next to the model's figures for the same setting;
2. the model's sync vs async step time and trained tokens/s per GPU at 8, 64 and 512 GPUs for a
   reference workload (a 7B model on H100, 512 prompts x 16 completions, 2K mean and 16K max
   response).

Where a run's mean response length is not published it is fitted (verl: on its 32-GPU rows, with the
colocated learner's MFU; the 64- and 128-GPU rows are then predictions) or assumed (AReaL): the rows
say which.

    python bench/scale_model.py
    python bench/scale_model.py --smoke     # a small reference workload, one published row

Last line: ``gpus=N sync_step_s=X async_step_s=Y speedup=Z`` for the largest GPU count.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from posttrain.planning.scale_model import (
    Hardware,
    Model,
    Workload,
    async_step,
    decode_step_s,
    engine_slots,
    generation_sync_s,
    response_lengths,
    sync_step,
    update_s,
)

# Dense bf16 peak FLOP/s, HBM bandwidth and capacity from the vendors' data sheets.
H20 = Hardware("H20", 148e12, 4.0e12, 96e9)
H100 = Hardware("H100-SXM", 989e12, 3.35e12, 80e9)
H800 = Hardware("H800", 989e12, 3.35e12, 80e9)
# Sizes from the models' config.json (parameters, layers, K/V heads, head dim).
QWEN25_7B = Model("Qwen2.5-7B", 7.62e9, 28, 4, 128)
QWEN_15B = Model("R1-Distill-Qwen-1.5B", 1.78e9, 28, 2, 128)
LLAMA31_8B = Model("Llama-3.1-8B", 8.03e9, 32, 8, 128)

# verl docs/advance/fully_async.md, "Asynchronous Training on 7B Model" (H20, Qwen2.5-Math-7B, DAPO,
# 512 prompts x 16, max response 28K): GPUs, colocated step / gen / old_log_prob / update_actor, and the
# fully_async split's step / update (seconds, means over 400 steps). The page's 32-GPU rows print
# update_actor 269.80 for colocated and 313.81 for the 16:16 split; taken here the other way round, since
# then the colocated phases sum to the step within 11 s as at 64 and 128 GPUs, and the split's update
# fits inside its 294.77 s step.
VERL = [
    (32, 790.10, 357.41, 107.71, 313.81, 294.77, 269.80),
    (64, 365.28, 150.72, 70.26, 133.41, 189.26, 156.98),
    (128, 356.30, 177.85, 53.92, 113.81, 150.63, 113.16),
]


def bisect(f, lo: float, hi: float, target: float) -> float:
    """The x in [lo, hi] where the increasing function f reaches ``target``."""
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def verl_rows(hw: Hardware, rows: list) -> list[str]:
    """Published vs model for verl's colocated and split runs, two unknowns fitted on the first row.

    The mean response length is fitted so that the split learner (at ``hw.mfu``) takes the published
    update time; the colocated learner's MFU so that the colocated update (with the old log-probs)
    takes the published old_log_prob + update_actor; the engine's efficiencies (bandwidth and decode
    FLOP/s, scaled together) so that the colocated generation takes the published gen time. The
    other rows are predictions.
    """
    # 512 prompts a step in minibatches of 32 (ppo_mini_batch_size): 16 optimizer steps. Engines as in
    # verl's experiment scripts (recipe/fully_async_policy/exp/qwen2-7B-math_{32,64,128}/fsdp2_colocate,
    # and the 16/32/64-rollout-GPU fully-async ones): gen_tp=4 at every size, so 8 / 16 / 32 colocated
    # engines of 1,024 / 512 / 256 sequences; gpu_memory_utilization 0.80; verl's rollout default
    # max_num_seqs 1024 (rollout.yaml), FCFS.
    base = Workload(seqs=512 * 16, prompt=150, mean_response=1000, max_response=28 * 1024, sigma=1.5,
                    optimizer_steps=16, tp=4, max_seqs=1024)
    hw = replace(hw, kv_frac=0.80)
    gpus0, _, _, old0, upd0, _, aupd0 = rows[0]
    mean = bisect(lambda x: update_s(QWEN25_7B, hw, replace(base, mean_response=x), gpus0 // 2, False),
                  50.0, 28 * 1024.0, aupd0)
    w = replace(base, mean_response=mean)
    ratio = hw.e_dec / hw.e_bw  # the engine's two efficiencies scaled together
    eng = bisect(lambda x: -generation_sync_s(QWEN25_7B, replace(hw, e_bw=x, e_dec=x * ratio), w, gpus0),
                 0.01, 1.0, -rows[0][2])
    hw = replace(hw, e_bw=eng, e_dec=eng * ratio)
    mfu_col = bisect(lambda x: -update_s(QWEN25_7B, replace(hw, mfu_colocated=x), w, gpus0, True, colocated=True),
                     0.01, 1.0, -(old0 + upd0))
    hw = replace(hw, mfu_colocated=mfu_col)
    out = [f"verl, {QWEN25_7B.name} on {hw.name}, 8,192 completions, max 28K; fitted on the {gpus0}-GPU rows: "
           f"mean response {mean:,.0f} tokens (longest {response_lengths(w)[0]:,}), engine efficiencies "
           f"{hw.e_bw:.3f} / {hw.e_dec:.3f}, colocated learner MFU {hw.mfu_colocated:.3f} (split learner {hw.mfu})",
           f"engines of {w.tp} GPUs holding up to {engine_slots(QWEN25_7B, hw, w)} sequences at once; colocated: "
           + ", ".join(f"{g // w.tp} x {w.seqs // (g // w.tp):,} sequences at {g} GPUs" for g, *_ in rows)]
    out.append(f"{'GPUs':>5} {'layout':>8} | {'published step':>14} {'gen':>7} {'update':>7} | "
               f"{'model step':>10} {'gen':>7} {'update':>7}")
    for gpus, step, gen, old, upd, astep, aupd in rows:
        s = sync_step(QWEN25_7B, hw, w, gpus)
        a = async_step(QWEN25_7B, hw, w, gpus, engine_devices=gpus // 2)
        out.append(f"{gpus:>5} {'sync':>8} | {step:>14.1f} {gen:>7.1f} {old + upd:>7.1f} | "
                   f"{s.step_s:>10.1f} {s.generate_s:>7.1f} {s.update_s:>7.1f}")
        out.append(f"{gpus:>5} {'1:1':>8} | {astep:>14.1f} {'':>7} {aupd:>7.1f} | "
                   f"{a.step_s:>10.1f} {a.generate_s:>7.1f} {a.update_s:>7.1f}")
        out.append(f"{'':>5} {'speedup':>8} | {step / astep:>14.2f} {'':>7} {'':>7} | {s.step_s / a.step_s:>10.2f}")
    longest = response_lengths(w)[0]  # alone on an engine: its steps at batch 1, context half-way on average
    tail = longest * decode_step_s(QWEN25_7B, hw, w.tp, 1, w.prompt + longest / 2)
    out.append(f"the fitted engine decodes the longest response alone in {tail:.1f} s "
               f"({longest * hw.step_overhead_s:.1f} s of it the fixed cost a step)")
    gen0 = rows[0][2]
    for gpus, _, gen, *_ in rows[1:]:
        # A step's cost is affine in its batch (t0 + weights, plus per-sequence terms), so k times the
        # engines cut a batch's generation by at most k: the per-sequence part by k, the steps of the
        # longest response not at all. The bound holds for any such model, efficiencies and t0 aside.
        out.append(f"one workload on {gpus // gpus0}x the engines: generation >= {gen0 * gpus0 / gpus:.1f} s at "
                   f"{gpus} GPUs from the {gpus0}-GPU row's {gen0:.1f} s (published {gen:.1f} s)")
    return out


def nemo_rows(hw: Hardware) -> list[str]:
    """NeMo-RL v0.4 performance summary: Llama-3.1-8B on 16 H100, 2,048 samples of mean length 1,060."""
    w = Workload(seqs=2048, prompt=100, mean_response=960, max_response=4096, optimizer_steps=4)  # T-GBS 512
    s = sync_step(LLAMA31_8B, hw, w, 16)
    a = async_step(LLAMA31_8B, hw, w, 16, streaming=False)
    return [
        f"NeMo-RL v0.4, {LLAMA31_8B.name} on 16 x {hw.name}, 2,048 completions, mean sequence 1,060, max 4,096",
        "  published: on-policy 97.7 s, one-step off 74.6 s (1.31x)",
        f"  model:     sync {s.step_s:.1f} s (gen {s.generate_s:.1f}, update {s.update_s:.1f}), "
        f"one-step off {a.step_s:.1f} s on {a.engine_devices}+{a.devices - a.engine_devices} devices "
        f"({s.step_s / a.step_s:.2f}x)",
    ]


def areal_rows(hw: Hardware) -> list[str]:
    """AReaL v0.3 blog table 2: 1,000 PPO steps, sync vs async; response lengths not published (assumed)."""
    out = ["AReaL v0.3 (blog/AReaL_v0_3.md table 2), 512 prompts x 16, lengths assumed: mean 8K, max 27K"]
    for m, gpus, sync_h, async_h in ((QWEN_15B, 128, 41.0, 14.8), (QWEN25_7B, 192, 57.7, 25.4)):
        w = Workload(seqs=512 * 16, prompt=200, mean_response=8000, max_response=27 * 1024)
        s, a = sync_step(m, hw, w, gpus), async_step(m, hw, w, gpus)
        out.append(f"  {m.name:<22} {gpus:>4} x {hw.name}: published {sync_h * 3.6:.1f} vs {async_h * 3.6:.1f} "
                   f"s a step ({sync_h / async_h:.2f}x); model {s.step_s:.1f} vs {a.step_s:.1f} s "
                   f"({s.step_s / a.step_s:.2f}x)")
    return out


def predictions(hw: Hardware, m: Model, w: Workload, gpus_list: list[int]) -> tuple[list[str], list[tuple]]:
    """Sync vs async at each GPU count for one workload."""
    out = [f"prediction: {m.name} on {hw.name}, {w.seqs:,} completions, mean {w.mean_response:,.0f} / max "
           f"{w.max_response:,} response tokens, {engine_slots(m, hw, w)} sequences per engine",
           f"{'GPUs':>5} | {'sync step':>9} {'gen':>7} {'update':>7} {'tok/s/GPU':>9} | "
           f"{'async step':>10} {'split':>9} {'gen':>7} {'update':>7} {'tok/s/GPU':>9} | speedup"]
    got = []
    for gpus in gpus_list:
        s, a = sync_step(m, hw, w, gpus), async_step(m, hw, w, gpus)
        split = f"{a.engine_devices}+{gpus - a.engine_devices}"
        out.append(f"{gpus:>5} | {s.step_s:>9.1f} {s.generate_s:>7.1f} {s.update_s:>7.1f} "
                   f"{s.tokens_per_s_per_device:>9.0f} | {a.step_s:>10.1f} {split:>9} {a.generate_s:>7.1f} "
                   f"{a.update_s:>7.1f} {a.tokens_per_s_per_device:>9.0f} | {s.step_s / a.step_s:.2f}x")
        got.append((gpus, s.step_s, a.step_s))
    return out, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--e-bw", type=float, default=0.7, help="share of memory bandwidth a decode step reaches")
    ap.add_argument("--e-dec", type=float, default=0.4, help="share of peak FLOP/s of a decode step's matmuls")
    ap.add_argument("--mfu", type=float, default=0.35, help="share of peak FLOP/s the update reaches")
    ap.add_argument("--step-overhead-ms", type=float, default=H20.step_overhead_s * 1e3,
                    help="fixed cost of a decode step, whatever its batch (ms)")
    ap.add_argument("--gpus", default="8,64,512", help="GPU counts for the predictions")
    ap.add_argument("--smoke", action="store_true", help="a small workload and one published row (seconds)")
    args = ap.parse_args()
    eff = {"e_bw": args.e_bw, "e_dec": args.e_dec, "mfu": args.mfu, "step_overhead_s": args.step_overhead_ms / 1e3}
    h20, h100, h800 = (replace(h, **eff) for h in (H20, H100, H800))
    print(f"efficiencies (every row): memory bandwidth {args.e_bw}, decode FLOP/s {args.e_dec}, "
          f"update MFU {args.mfu}; a decode step's fixed cost {args.step_overhead_ms:g} ms\n")
    gpus_list = [int(g) for g in args.gpus.split(",")]
    if args.smoke:
        print("\n".join(verl_rows(h20, VERL[:1])))
        ref = Workload(seqs=256, prompt=150, mean_response=500, max_response=2048)
    else:
        print("\n".join(verl_rows(h20, VERL)), "\n")
        print("\n".join(nemo_rows(h100)), "\n")
        print("\n".join(areal_rows(h800)), "\n")
        ref = Workload(seqs=512 * 16, prompt=150, mean_response=2048, max_response=16 * 1024, optimizer_steps=4)
    lines, got = predictions(h100, QWEN25_7B, ref, gpus_list)
    print("\n".join(lines))
    gpus, sync_s, async_s = got[-1]
    print(f"gpus={gpus} sync_step_s={sync_s:.1f} async_step_s={async_s:.1f} speedup={sync_s / async_s:.2f}")


if __name__ == "__main__":
    main()
