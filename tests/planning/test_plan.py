"""posttrain plan: the memory estimate (hand arithmetic, the measurements it was fitted to), the
refusal of a run that cannot fit, and the command."""


import pytest
from transformers import LlamaConfig

from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.planning.plan import Arch, Part, check, estimate

# SmolLM2-135M-Instruct's shape (config.json of the HF copy)
SMOL = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def part(parts, name):
    return next(p for p in parts if p.name == name)


def test_arch_counts_smollm2_parameters():
    a = Arch.of(SMOL)
    assert (a.head_dim, a.kv_heads) == (64, 3)
    assert a.params == 134_515_008  # bench/lib/report.py's Dims and the loaded model agree
    # LoRA rank 16 on q,k,v,o,gate,up,down: per layer 16 x ((576+576) + 2(576+192) + (576+576) + 3(576+1536))
    # = 16 x (1152 + 1536 + 1152 + 6336) = 162,816; x 30 layers = 4,884,480
    assert a.lora_params(16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) == 4_884_480


def test_hand_example_of_every_part():
    # 8 prompts x 8 completions of 64 tokens, prompts of 50 tokens, fp32, one minibatch:
    # positions 8 x 50 + 64 x 64 = 4,496; activations 4,496 x 30 x (16 x 576 + 3 x 1536) x 4 = 7.459e9 B
    cfg = load_config(None, ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=64"])
    parts = estimate(cfg, Arch.of(SMOL), prompt_tokens=50)
    p = 134_515_008
    assert part(parts, "policy weights").bytes == 4 * p
    assert part(parts, "gradients").bytes == 4 * p and part(parts, "AdamW moments").bytes == 8 * p
    assert part(parts, "activations").bytes == 4_496 * 30 * 13_824 * 4
    # KV: 2 x 30 layers x 3 heads x 64 x 4 B x (8 x 50 + 64 x 64) = 46,080 x 4,496 = 207,175,680
    assert part(parts, "engine KV cache").bytes == 207_175_680
    # measured on this machine (bench/real_step.py, 2026-12-03): 7.3 GB of saved activations for this step
    assert part(parts, "activations").bytes == pytest.approx(7.3e9, rel=0.05)


def test_micro_batches_lora_and_reference_change_the_right_parts():
    arch = Arch.of(SMOL)
    base = ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=64"]
    micro = estimate(load_config(None, [*base, "train.micro_batch_tokens=1024"]), arch, 50)
    assert part(micro, "activations").bytes == 1024 * 30 * 13_824 * 4
    lora = estimate(load_config(None, [*base, "model.lora.rank=16", "algorithm.kl_coef=0.1"]), arch, 50)
    assert part(lora, "gradients").bytes == 4 * 4_884_480
    assert not any(p.name == "reference model" for p in lora)  # the base with the adapter off
    full = estimate(load_config(None, [*base, "algorithm.kl_coef=0.1"]), arch, 50)
    assert part(full, "reference model").bytes == 4 * 134_515_008
    # A*-PO samples the reference: a frozen copy too; 2 ranks shard one (LoRA: none) or two copies (a reference)
    astar = estimate(load_config(None, [*base, "algorithm.advantage=a_star", "algorithm.loss=a_star_po"]), arch, 50)
    assert part(astar, "reference model").bytes == 4 * 134_515_008
    two_lora = estimate(load_config(None, [*base, "model.lora.rank=16", "algorithm.kl_coef=0.1", "train.processes=2"]),
                        arch, 50)
    assert part(two_lora, "learner ranks' weight shards").bytes == 4 * 134_515_008
    # PPO's critic on 2 ranks: the driver's copy (4 B a weight) beside weights + gradients + AdamW split on the ranks
    gae = [*base, "algorithm.advantage=gae"]
    one, two = (part(estimate(load_config(None, [*gae, f"train.processes={m}"]), arch, 50),
                     "critic (weights, gradients, AdamW, activations)").bytes for m in (1, 2))
    assert two - one == 4 * 134_515_008
    bf16 = estimate(load_config(None, [*base, "model.dtype=bfloat16"]), arch, 50)
    assert part(bf16, "activations").bytes * 2 == part(estimate(load_config(None, base), arch, 50), "activations").bytes


def test_checkpointing_keeps_each_layers_input_and_one_layers_activations():
    # 4 prompts x 4 completions of 512 tokens, prompts of 50 tokens, fp32, one minibatch, checkpointed:
    # every row runs its prompt (no shared cache): 16 x (50 + 512) = 8,992 positions (plain: 4 x 50 + 16 x 512
    # = 8,392); a layer keeps its input (576 a token) and one layer's 13,824 live while the backward recomputes:
    # 8,992 x (30 x 576 + 13,824) x 4 = 8,992 x 31,104 x 4 = 1.1187e9 B, against 8,392 x 30 x 13,824 x 4 = 1.3922e10
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=512"]
    plain = part(estimate(load_config(None, base), Arch.of(SMOL), 50), "activations")
    ckpt = part(estimate(load_config(None, [*base, "train.gradient_checkpointing=true"]), Arch.of(SMOL), 50),
                "activations")
    assert plain.bytes == 8_392 * 30 * 13_824 * 4
    assert ckpt.bytes == 8_992 * (30 * 576 + 13_824) * 4 and "checkpointed" in ckpt.note
    assert ckpt.bytes < 0.1 * plain.bytes


def test_check_names_the_setting_for_the_largest_part():
    import torch

    huge = [Part("activations", 1e15, ""), Part("policy weights", 1.0, "")]
    with pytest.raises(ConfigError, match="train.micro_batch_tokens"):
        check(huge, torch.device("cpu"))
    check([Part("activations", 1.0, "")], torch.device("cpu"))  # fits: no error


def test_a_run_that_cannot_fit_stops_before_training(tiny_cfg, quiet, tmp_path):
    from posttrain.train.rl import train

    # 200,000 prompts x 4 completions: ~10 TB of activations in one minibatch
    cfg = tiny_cfg("rollout.prompts_per_step=200000", "train.steps=1")
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        train(cfg, console=quiet)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_plan_command_prints_the_parts_and_fits(capsys):
    assert main(["plan", "recipes/tiny.toml"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "engine KV cache" in out and "fits:" in out
    assert main(["plan", "recipes/tiny.toml", "rollout.prompts_per_step=200000"]) == 2
    assert "micro_batch_tokens" in capsys.readouterr().out


def test_plan_json_prints_the_parts_and_the_total(capsys):
    import json

    assert main(["plan", "recipes/tiny.toml", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["fits"] and got["advice"] is None and got["device"] == "cpu"
    assert got["total_gib"] == pytest.approx(sum(p["gib"] for p in got["parts"]))
    assert {p["name"] for p in got["parts"]} >= {"policy weights", "activations", "engine KV cache"}
    assert main(["plan", "recipes/tiny.toml", "rollout.prompts_per_step=200000", "--json"]) == 0
    big = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not big["fits"] and "gradient_checkpointing" in big["advice"]


def test_an_async_run_adds_the_producers_copy_and_its_weight_snapshots():
    # max_staleness 2, full fine-tuning: a 4 B x 134,515,008 copy + 4 snapshots = 5 x 538,060,032 B;
    # with LoRA-16 the snapshots are the adapter: 538,060,032 + 4 x 4 x 4,884,480 = 616,211,712 B
    arch = Arch.of(SMOL)
    assert not any(p.name == "async producer" for p in estimate(load_config(None, []), arch, 50))
    full = estimate(load_config(None, ["rollout.max_staleness=2"]), arch, 50)
    assert part(full, "async producer").bytes == 5 * 538_060_032
    lora = estimate(load_config(None, ["rollout.max_staleness=2", "model.lora.rank=16"]), arch, 50)
    assert part(lora, "async producer").bytes == 616_211_712
    # on Ray workers (plain models) a LoRA policy is published merged: the snapshots are whole again
    ray = estimate(load_config(None, ["rollout.max_staleness=2", "model.lora.rank=16", "cluster.backend=ray"]),
                   arch, 50)
    assert part(ray, "async producer").bytes == 5 * 538_060_032
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        check([Part("async producer", 1e15, "")], __import__("torch").device("cpu"))


def test_learner_ranks_add_a_sharded_copy_and_an_activation_set_each():
    # 2 ranks, no KL: their shards add up to one more fp32 copy (4 B x 134,515,008 = 538,060,032 B);
    # with micro-batches each rank holds its own micro-batch's activations: twice the one-process figure
    arch = Arch.of(SMOL)
    one = estimate(load_config(None, ["train.micro_batch_tokens=512", "algorithm.kl_coef=0"]), arch, 50)
    two = estimate(load_config(None, ["train.micro_batch_tokens=512", "algorithm.kl_coef=0", "train.processes=2"]),
                   arch, 50)
    assert not any(p.name == "learner ranks' weight shards" for p in one)
    assert part(two, "learner ranks' weight shards").bytes == 538_060_032
    assert part(two, "activations").bytes == 2 * part(one, "activations").bytes
    with_ref = estimate(load_config(None, ["algorithm.kl_coef=0.1", "train.processes=2"]), arch, 50)
    assert part(with_ref, "learner ranks' weight shards").bytes == 2 * 538_060_032  # the reference too
    with pytest.raises(ConfigError, match="train.processes = 1"):
        check([Part("learner ranks' weight shards", 1e15, "")], __import__("torch").device("cpu"))


def test_autocast_and_the_logit_mix_reference_add_their_copies():
    # model.autocast: a bf16 copy of the 134,515,008 weights, 2 B each = 269,030,016 B;
    # ref_logit_mix: a frozen fp32 copy (4 B x 134,515,008 = 538,060,032 B) and twice the engine's K/V
    arch = Arch.of(SMOL)
    plain = estimate(load_config(None, []), arch, 50)
    assert not any(p.name == "autocast weight copies" for p in plain)
    bf16 = estimate(load_config(None, ['model.autocast="bfloat16"']), arch, 50)
    assert part(bf16, "autocast weight copies").bytes == 269_030_016
    mix = estimate(load_config(None, ['algorithm.parameterization="ref_logit_mix"']), arch, 50)
    assert part(mix, "parameterization's reference").bytes == 538_060_032
    assert part(mix, "engine KV cache").bytes == 2 * part(plain, "engine KV cache").bytes
