"""Learner ranks as Ray actors (train.processes = 2 with cluster.backend = "ray"): the same parameters as
one learner process after 3 AdamW steps (1e-4), the driver's policy following the ranks (equal rewards,
so the engines sampled the same weights), a checkpoint that resumes on spawned ranks, a LoRA adapter
trained as in one process (its checkpoint resumed in one process), and a rank actor that dies stopping
the run with a clear message.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from learner_runs import COMMON, adapter, max_diff, one_process_and_two_ranks, rows, weights
from safetensors.torch import load_file

from posttrain.config import LearnSettings
from posttrain.errors import RankError
from posttrain.learn.distributed.fsdp_learner import usable_cores
from posttrain.train.rl import train

HAS_RAY = importlib.util.find_spec("ray") is not None
pytestmark = [
    pytest.mark.skipif(not HAS_RAY, reason="ray not installed (pip install 'posttrain[ray]')"),
    pytest.mark.skipif(usable_cores() < 2, reason="train.processes = 2 needs 2 CPU cores"),
    pytest.mark.slow,
]
# one rollout worker actor samples for every run, so only the learner differs between them
RAY = ("cluster.backend=ray", "cluster.rollout_workers=1")


def test_ray_rank_actors_shard_ppos_critic_as_the_spawned_ranks_do(tiny_cfg, quiet, tmp_path, length_reward):
    # the critic's config and weights travel to the actors; rank 0 sends the updated critic back each step
    common = (*COMMON, *RAY, "algorithm.advantage=gae", "critic.warmup_steps=1", "train.steps=2", *length_reward)
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", out=str(tmp_path / "two")), console=quiet)
    crit = [load_file(str(sorted((tmp_path / r / "checkpoints").glob("step_*"))[-1] / "critic" / "model.safetensors"))
            for r in ("one", "two")]
    assert max_diff(*crit) < 1e-4 and max_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-4
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "two"), strict=True):
        assert a["critic/value_loss"] == pytest.approx(b["critic/value_loss"], rel=1e-4)


def test_ray_rank_actors_train_the_same_parameters_as_one_process(tiny_cfg, quiet, tmp_path, length_reward):
    common = (*COMMON, *RAY, *length_reward)
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", out=str(tmp_path / "two")), console=quiet)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max_diff(one, weights(tmp_path / "one", 0)) > 1e-3  # the policy moved after step 1
    assert max_diff(one, two) < 1e-4
    for a, b in zip(rows(tmp_path / "one"), rows(tmp_path / "two"), strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the rollout worker got the ranks' weights every step
        for k in ("loss", "optim/grad_norm", "policy/kl_ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    # the checkpoint of the actor ranks resumes on spawned ranks (local backend: a different sampler,
    # so only that it runs on and keeps the format)
    out = str(tmp_path / "two")
    train(tiny_cfg(*COMMON, *length_reward, "train.steps=4", "train.processes=2", out=out), resume=True,
          console=quiet)
    assert len(rows(tmp_path / "two")) == 4


def test_ray_rank_actors_train_a_lora_adapter_as_one_process(tiny_cfg, quiet, tmp_path, length_reward):
    # each actor injects the adapter into the model it builds (base and adapter from the object store); the KL
    # reference is its root with the adapter off; rank 0 returns the adapter alone; 2 steps on the actors, then
    # the checkpoint resumes in one process for the third
    common = (*COMMON, *RAY, "model.lora.rank=4", "model.lora.alpha=8", *length_reward)
    one_dir, two_dir = one_process_and_two_ranks(tiny_cfg, quiet, tmp_path, common, then=1)
    assert max_diff(adapter(one_dir), adapter(one_dir, 0)) > 1e-3  # the adapter moved
    for step in (1, -1):  # after the actors' second step, and after the resumed third
        assert max_diff(adapter(one_dir, step), adapter(two_dir, step)) < 1e-4, step
    for a, b in zip(rows(one_dir), rows(two_dir), strict=True):
        assert a["reward/mean"] == b["reward/mean"]  # the rollout worker got the adapter (merged) every step
        for k in ("loss", "optim/grad_norm", "policy/kl_ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a["step"])
    assert rows(one_dir)[-1]["policy/kl_ref"] > 0  # the reference is the base, not the moving policy


def test_a_rank_actor_that_dies_stops_the_run_with_a_clear_message(tiny_cfg, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.learn.distributed.ray_learner import RayRankGroup
    from posttrain.models.tiny import TinySpec, build_tiny

    cfg = tiny_cfg()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path / "tiny", TinySpec()))
    setup = {"settings": LearnSettings.of(cfg), "pad_id": 0, "device": "cpu", "threads": 1, "deterministic": True}
    group = RayRankGroup(2, setup, model, None, address="", reserve_cpus=2)
    assert group.call("optimizer_state")["state"] == {}  # alive: a fresh optimizer's (empty) state
    os.kill(group.pids[1], 9)  # rank 1's process dies (as an OOM kill would)
    with pytest.raises(RankError, match=r"learner rank's actor died.*during optimizer_state.*--resume"):
        group.call("optimizer_state")
    assert group.actors == [] and group.pg is None  # stopped and freed
