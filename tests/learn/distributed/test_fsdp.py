"""The sharded learner (train.processes = 2, FSDP2 over gloo in two spawned ranks) against the
one-process learner: same parameters after 3 steps within 1e-4 (AdamW), same metrics, checkpoints
that resume at either number of processes, and clear errors (too many processes, a dying rank).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from learner_runs import COMMON, adapter, max_diff, one_process_and_two_ranks, rows, saved, weights
from safetensors.torch import load_file

from posttrain.config import LearnSettings
from posttrain.errors import ConfigError
from posttrain.learn.distributed.fsdp_learner import RankError, RankGroup, usable_cores
from posttrain.learn.shard import Shard, spread
from posttrain.train.rl import train

needs_2_cores = pytest.mark.skipif(usable_cores() < 2, reason="train.processes = 2 needs 2 CPU cores")


def test_deal_gives_every_rank_as_many_passes_and_each_run_once():
    runs = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 4]), torch.tensor([5])]
    # 4 runs over 3 ranks: ceil(4 / 3) = 2 passes each; rank 0 takes runs 0 and 3, rank 1 run 1 then a
    # padding pass (run 0 again, not live), rank 2 run 2 then padding
    dealt = [Shard(r, 3).deal(runs) for r in range(3)]
    assert [len(d) for d in dealt] == [2, 2, 2]
    live = sorted(j for d in dealt for j, _, is_live in d if is_live)
    assert live == [0, 1, 2, 3]
    assert [(j, is_live) for j, _, is_live in dealt[1]] == [(1, True), (0, False)]


def test_spread_splits_a_single_run_across_the_ranks():
    one = [torch.arange(5)]
    # budget 0 gives one run of 5 rows; 2 ranks get rows 0-2 and 3-4
    assert [r.tolist() for r in spread(one, 5, 2)] == [[0, 1, 2], [3, 4]]
    assert [r.tolist() for r in spread([torch.arange(1)], 1, 2)] == [[0]]  # one row: nothing to split
    many = [torch.tensor([0]), torch.tensor([1]), torch.tensor([2])]
    assert spread(many, 3, 2) is many


def test_one_process_is_the_one_shard_of_a_world_of_one():
    local = Shard()
    runs = [torch.tensor([0, 1]), torch.tensor([2])]
    # every run, live, in order; nothing gathered from elsewhere, losses not scaled, outputs left where they are
    assert [(j, r.tolist(), live) for j, r, live in local.deal(runs)] == [(0, [0, 1], True), (1, [2], True)]
    assert local.gather({"a": 1}) == [{"a": 1}] and local.scale(True) == 1.0
    out = {"x": torch.ones(1)}
    assert local.portable(out) is out
    assert Shard(1, 2).scale(False) == 0.0 and Shard(1, 2).scale(True) == 2.0  # a padding pass adds nothing


def test_the_update_is_written_once():
    # one update path: the policy's and the critic's optimizer steps live in learn/update.py and learn/critic.py,
    # for any Shard; the distributed wing only places the ranks (no backward pass or optimizer step of its own)
    learn = Path(__file__).resolve().parents[3] / "posttrain" / "learn"
    stepping = sorted(p.relative_to(learn).as_posix() for p in learn.rglob("*.py")
                      if ".backward(" in p.read_text() or "optimizer.step()" in p.read_text())
    assert stepping == ["critic.py", "update.py"]


@needs_2_cores
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 40])
def test_two_ranks_train_the_same_parameters_as_one_process(tiny_cfg, quiet, tmp_path, length_reward, budget):
    common = (*COMMON, f"train.micro_batch_tokens={budget}", *length_reward)
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", out=str(tmp_path / "two")), console=quiet)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max_diff(one, weights(tmp_path / "one", 0)) > 1e-3  # the policy moved after step 1
    assert max_diff(one, two) < 1e-4
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "two"), strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the same samples: the driver's copy followed the ranks
        for k in ("loss", "optim/grad_norm", "policy/entropy", "policy/kl_ref", "train/optimizer_steps"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


@needs_2_cores
@pytest.mark.slow
def test_the_learners_forward_passes_run_on_the_ranks_as_in_one_process(tiny_cfg, quiet, tmp_path, length_reward):
    # the reward's KL reads the reference's log-probs and the 80/20 weight the policy's token entropies: on 2 ranks
    # both are Learner forwards the ranks run over their shards (Rank.forward), micro-batched by the same budget
    common = (*COMMON, "train.steps=2", "algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0",
              "algorithm.kl_reward_coef=0.05", 'algorithm.loss_weights=[{name="top_entropy"}]',
              "train.micro_batch_tokens=40", *length_reward)
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", out=str(tmp_path / "two")), console=quiet)
    assert max_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-4
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "two"), strict=True):
        assert a["kl_reward/kl"] != 0  # the policy moved off its reference after step 1, or the KL is sampled
        for k in ("kl_reward/kl", "loss_weight/top_entropy_mean", "loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"])


@needs_2_cores
@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_in_one_process_and_back(tiny_cfg, quiet, tmp_path, length_reward):
    common = (*COMMON, "train.steps=4", "checkpoint.every=2", *length_reward)
    train(tiny_cfg(*common, out=str(tmp_path / "ref")), console=quiet)
    # 2 steps on 2 ranks, then the rest in 1 process; and 2 steps in 1 process, the rest on 2 ranks
    for first, then, name in ((2, 1, "a"), (1, 2, "b")):
        out = str(tmp_path / name)
        train(tiny_cfg(*common, "train.steps=2", f"train.processes={first}", out=out), console=quiet)
        train(tiny_cfg(*common, f"train.processes={then}", out=out), resume=True, console=quiet)
        assert max_diff(weights(tmp_path / name), weights(tmp_path / "ref")) < 1e-4, name


def test_more_processes_than_cores_is_refused(tiny_cfg, quiet):
    with pytest.raises(ConfigError, match=r"train.processes = \d+: this machine has \d+ CPU cores"):
        train(tiny_cfg(f"train.processes={usable_cores() + 1}", "train.steps=1"), console=quiet)


@needs_2_cores
def test_a_rank_that_dies_stops_the_run_with_a_clear_message(tiny_cfg, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import TinySpec, build_tiny

    cfg = tiny_cfg()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "tiny", TinySpec()))
    setup = {"settings": LearnSettings.of(cfg), "pad_id": 0, "device": "cpu", "threads": 1, "deterministic": True}
    group = RankGroup(2, setup, model, None)
    try:
        os.kill(group.procs[0].pid, 9)
        with pytest.raises(RankError, match=r"learner rank 0 exited with code -9 during optimizer_state.*--resume"):
            group.call("optimizer_state")
    finally:
        group.close()
    assert not any(p.is_alive() for p in group.procs)


def critic_weights(run: Path, step: int = -1) -> dict[str, torch.Tensor]:
    return saved(run, "critic/model.safetensors", step)


@needs_2_cores
@pytest.mark.slow
def test_ppo_with_its_critic_sharded_matches_one_process_and_resumes(tiny_cfg, quiet, tmp_path, length_reward):
    # the critic trains on the ranks too (FSDP2, its own sharded AdamW); 2 steps, then a resume at 2 processes
    # (the critic's optimizer state gathered into the checkpoint and scattered back) for the third
    common = (*COMMON, "algorithm.advantage=gae", "critic.warmup_steps=1", *length_reward)
    one_dir, two_dir = one_process_and_two_ranks(tiny_cfg, quiet, tmp_path, common, then=2)
    assert max_diff(weights(one_dir), weights(one_dir, 0)) > 1e-3  # moved after the warm-up
    assert max_diff(critic_weights(one_dir), critic_weights(one_dir, 0)) > 1e-3
    assert max_diff(weights(one_dir), weights(two_dir)) < 1e-4
    assert max_diff(critic_weights(one_dir), critic_weights(two_dir)) < 1e-4
    for a, b in zip(rows(one_dir), rows(two_dir), strict=True):
        for k in ("critic/value_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/explained_variance"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"])


@needs_2_cores
@pytest.mark.slow
def test_a_lora_adapter_on_two_ranks_trains_as_in_one_process(tiny_cfg, quiet, tmp_path, length_reward):
    # the frozen base sharded with its adapter; the KL reference is each rank's own shard with the adapter off
    # (no second copy); rank 0 writes only the adapter back; a checkpoint of 2 ranks resumes in one process
    common = (*COMMON, "model.lora.rank=4", "model.lora.alpha=8", *length_reward)
    one_dir, two_dir = one_process_and_two_ranks(tiny_cfg, quiet, tmp_path, common, then=1)
    assert max_diff(adapter(one_dir), adapter(one_dir, 0)) > 1e-3  # the adapter moved
    assert max_diff(adapter(one_dir), adapter(two_dir)) < 1e-4
    for a, b in zip(rows(one_dir), rows(two_dir), strict=True):
        for k in ("loss", "optim/grad_norm", "policy/kl_ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"])
    assert rows(one_dir)[-1]["policy/kl_ref"] > 0  # the reference is the base, not the moving policy


@needs_2_cores
@pytest.mark.slow
def test_bf16_autocast_on_two_ranks_trains_as_in_one_process(tiny_cfg, quiet, tmp_path, length_reward):
    # model.autocast reaches the ranks: each runs its share of the update with bf16 matmuls over fp32 shards. Each
    # rank's weight gradients are rounded to bf16 over its half of the tokens before the fp32 all-reduce, so the
    # two layouts agree to bf16's rounding, not to 1e-4 as in fp32: same loss, grad norm within 1e-3, and AdamW's
    # first step (about lr sign(g) per weight) in the same direction (measured cosine 0.999; bf16 vs fp32 0.996).
    # One optimizer step: bf16 sampling turns later rounding-level differences into other tokens.
    common = (*COMMON, "train.steps=1", "train.minibatches=1", *length_reward)
    runs = {name: tmp_path / name for name in ("one", "two", "fp32")}
    train(tiny_cfg(*common, 'model.autocast="bfloat16"', out=str(runs["one"])), console=quiet)
    train(tiny_cfg(*common, 'model.autocast="bfloat16"', "train.processes=2", out=str(runs["two"])), console=quiet)
    train(tiny_cfg(*common, out=str(runs["fp32"])), console=quiet)
    start = load_file(str(runs["one"] / "base_model" / "model.safetensors"))
    moved = {k: torch.cat([(weights(runs[k])[n] - start[n]).flatten() for n in sorted(start)])
             for k in ("one", "two", "fp32")}
    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))
    print(f"\nupdate cosines: 2 ranks vs 1 process {cos(moved['one'], moved['two']):.6f}, "
          f"bf16 vs fp32 {cos(moved['one'], moved['fp32']):.6f}; |update| {moved['one'].norm():.4f}")
    (a,), (b,) = rows(runs["one"]), rows(runs["two"])
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-3)
    assert cos(moved["one"], moved["two"]) > 0.998
