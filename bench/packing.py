r"""Benchmark: the update with and without ``train.packing`` on a batch whose completion lengths vary 4x (not a test).

Setting (both sides): a SmolLM2-135M-shaped LLaMA with random weights (30 layers, hidden 576, 9 query heads
over 3 K/V heads, vocabulary 49,152, tied embeddings; built from its config, so nothing is downloaded), fp32,
CPU, loaded through ``posttrain.models.load_model`` (posttrain's attention, as a run gets it). One rollout
batch of 4 prompts x 4 completions: prompts of 40..60 random tokens, completions of random tokens whose real
lengths are spread evenly from 128 to 512 (rows truncated to those lengths: no EOS, no sampling), so the
batch's width is 512 and a padded row holds on average 320 real completion tokens. The update is the
library's (``posttrain.learn.update.policy_update``, the tiny recipe's GRPO-style PPO-clip loss, AdamW lr 1e-6,
one epoch, one minibatch) with ``train.micro_batch_tokens = 2048`` on both sides:

- padded (``train.packing = false``): each micro-batch is ``[rows, longest prompt + 512]``, a group's prompt
  run once through the KV cache; the budget counts the padded width;
- packed (``train.packing = true``): each micro-batch is one sequence of its rows' real tokens, rows kept apart
  by posttrain's attention (each row's causal attention on its own); the budget counts real tokens.

Both sides run on one model, alternated (A B A B; the first run of each untimed), and print the median update
time, the micro-batches and the padded-token share of the trunk's input (tokens that are padding / tokens fed
to the decoder layers). The issue's target: packed at least 1.3x faster than padded.

    python bench/packing.py                       # the setting above, 3 timed updates per side
    python bench/packing.py --layers 6 --runs 2   # a cut model, quicker
    python bench/packing.py --smoke               # the tiny model, completions of 8..32 tokens, 1 run

Last line: ``padded_update_s=A packed_update_s=B speedup=A/B padded_share=P`` (the packed side feeds no padding
to the decoder layers; the chunked output head still runs over the ``[N, T]`` positions on both sides).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import machine_line, median, timed_interleaved
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.config import LearnSettings, load_config
from posttrain.learn.packing import row_tokens
from posttrain.learn.parts import LearnParts
from posttrain.learn.shard import plan_micro_batches
from posttrain.learn.update import policy_update
from posttrain.models import TinySpec, build_tiny, load_model
from posttrain.rollout import Rollout

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M-Instruct), weights left random
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")


def parse_args() -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=128, help="the shortest completion")
    ap.add_argument("--max-tokens", type=int, default=512, help="the longest completion (the batch's width)")
    ap.add_argument("--budget", type=int, default=2048, help="train.micro_batch_tokens on both sides")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: 30)")
    ap.add_argument("--runs", type=int, default=3, help="timed updates per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed updates per side first")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 2 x 2 completions of 8..32 tokens, 1 run")
    return ap.parse_args()


def build_model(work: Path, smoke: bool, layers: int | None) -> torch.nn.Module:
    """The benchmark's model, saved and loaded back through posttrain's loader."""
    d = work / "model"
    if smoke:
        build_tiny(d, TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64, num_layers=2,
                               max_positions=128))
    else:
        shape = {**SMOLLM2_SHAPE, **({"num_hidden_layers": layers} if layers else {})}
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(d)
    return load_model(str(d))


def make_batch(prompts: int, group: int, lo: int, hi: int, vocab: int, prompt_len: tuple[int, int]) -> Rollout:
    """``prompts`` x ``group`` rows of random tokens, completion lengths spread evenly over ``lo .. hi``
    (interleaved over the groups so that every group holds short and long rows).
    """
    gen = torch.Generator().manual_seed(0)
    n = prompts * group
    lengths = torch.linspace(lo, hi, n).round().long()
    lengths = lengths.view(group, prompts).t().reshape(n)  # row p * G + g: the (g * P + p)-th length
    prompt_ids = [torch.randint(3, vocab, (int(torch.randint(*prompt_len, (1,), generator=gen)),),
                                generator=gen).tolist() for _ in range(prompts)]
    mask = (torch.arange(hi)[None] < lengths[:, None]).float()
    ids = torch.randint(3, vocab, (n, hi), generator=gen) * mask.long()
    return Rollout(prompt_ids=prompt_ids, token_ids=ids, attention_mask=mask, loss_mask=mask.clone(),
                   behaviour_logprobs=torch.zeros(n, hi), finished=torch.zeros(n, dtype=torch.bool),
                   texts=[""] * n, n=group)


def padded_share(rows: Rollout, budget: int, packed: bool) -> tuple[float, int]:
    """The share of the decoder's input tokens that are padding, and the number of micro-batches."""
    prompts = rows.row_prompts
    runs = plan_micro_batches(row_tokens(prompts, rows.attention_mask, packed), budget)
    if packed:  # one sequence of real tokens a micro-batch: no padding
        return 0.0, len(runs)
    real = float(sum(len(p) for p in prompts) + rows.attention_mask.sum())
    width = rows.token_ids.shape[1]
    fed = sum(len(r) * (max(len(prompts[i]) for i in r.tolist()) + width) for r in runs)
    return 1.0 - real / fed, len(runs)


def side(model: torch.nn.Module, rows: Rollout, packing: bool, budget: int, steps: list[dict]) -> object:
    """A callable: one update of ``model`` on ``rows`` (its metrics appended to ``steps``)."""
    cfg = load_config(ROOT / "recipes" / "tiny.toml", [f"train.micro_batch_tokens={budget}",
                                                       f"train.packing={str(packing).lower()}", "train.lr=1e-6"])
    settings = LearnSettings.of(cfg)
    parts = LearnParts.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    adv = torch.linspace(-1, 1, rows.token_ids.shape[0])

    def run() -> None:
        steps.append(policy_update(model, None, opt, parts, settings, rows.row_prompts, rows, rows.loss_mask, adv,
                                   {"group_ids": torch.arange(len(adv)) // rows.n}, 0, 0))

    return run


def main() -> None:
    args = parse_args()
    prompt_len, runs = (40, 61), args.runs
    if args.smoke:
        args.prompts, args.group, args.min_tokens, args.max_tokens, args.budget = 2, 2, 8, 32, 64
        prompt_len, runs = (4, 9), 1
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.smoke, args.layers)
    rows = make_batch(args.prompts, args.group, args.min_tokens, args.max_tokens, model.config.vocab_size,
                      prompt_len)
    metrics: dict[str, list[dict]] = {"padded": [], "packed": []}
    fns = {name: side(model, rows, name == "packed", args.budget, metrics[name]) for name in metrics}
    res = timed_interleaved(fns, args.warmup, runs)
    t = {name: median(res[name][0]) for name in fns}
    share = {name: padded_share(rows, args.budget, name == "packed") for name in fns}
    layers = model.config.num_hidden_layers
    lengths = rows.attention_mask.sum(1).long().tolist()
    print(f"\nsetting: {'tiny LLaMA' if args.smoke else 'SmolLM2-135M-shaped LLaMA (random weights)'}, {layers} "
          f"layers, {args.prompts} prompts x {args.group} completions of {min(lengths)}..{max(lengths)} tokens "
          f"(width {rows.token_ids.shape[1]}), train.micro_batch_tokens = {args.budget}, fp32, torch "
          f"{torch.__version__}")
    print(f"{'side':8s} {'update s':>9s} {'micro-batches':>14s} {'padded share':>13s}  loss (first run)")
    for name in fns:
        print(f"{name:8s} {t[name]:9.2f} {share[name][1]:14d} {share[name][0]:13.1%}  {metrics[name][0]['loss']:.6f} "
              f"(runs {[round(x, 2) for x in res[name][0]]})")
    speedup = t["padded"] / t["packed"]
    print(f"packing: the update {speedup:.2f}x as fast as padded (target >= 1.3x)")
    print(f"padded_update_s={t['padded']:.3f} packed_update_s={t['packed']:.3f} speedup={speedup:.3f} "
          f"padded_share={share['padded'][0]:.3f}")


if __name__ == "__main__":
    main()
