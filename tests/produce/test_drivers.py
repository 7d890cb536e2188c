"""The rollout-driver registry: names, typed options, and produce without trainer state."""

from __future__ import annotations

import inspect

import torch

from posttrain.config import ProduceSettings
from posttrain.produce.drivers import DRIVERS, SPECS, ProduceContext, produce
from posttrain.rollout import make_engine
from posttrain.run.setup import open_run
from posttrain.seeds import derive_seed


def test_every_driver_declares_its_options():
    # a new driver is one new file: nothing lists the drivers, so this test names only some it must find
    names = {"single_turn", "hint_reroll", "partial_states", "multi_turn", "external_mix", "reward_conditioned"}
    assert set(DRIVERS.names()) == set(SPECS) >= names  # rollout.driver is checked against DRIVERS (config/checks.py)
    for fn in map(DRIVERS.get, DRIVERS.names()):  # one signature: (ctx, state, step, batch, cursor)
        assert list(inspect.signature(fn).parameters) == ["ctx", "state", "step", "batch", "cursor"]


def test_produce_reads_only_the_engine_and_the_settings(tiny_cfg, quiet):
    # produce is a function of (policy version, seeds, data cursor): two calls agree, and the rows
    # are the engine's own sample for seed (seed, "sample", step, batch)
    from posttrain.rollout import SamplingParams

    cfg = tiny_cfg("rollout.prompts_per_step=3", "rollout.group_size=2", "scoring.workers=0")
    opened = open_run(cfg, resume=False)
    model, tok = opened.model, opened.tokenizer
    engine = make_engine("hf", model, tok)
    engine.sync(model.state_dict(), version=4)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, n=2)
    ctx = ProduceContext(opened.task, tok, engine, sampling, [("task", {})], torch.tensor([1.0]),
                         ProduceSettings.of(cfg))
    a, state = produce(ctx, None, step=5, batch=0, cursor=10)
    b, _ = produce(ctx, None, step=5, batch=0, cursor=10)
    assert state is None and a.consumed == 3
    assert torch.equal(a.rollouts.token_ids, b.rollouts.token_ids) and a.scored_texts == b.scored_texts
    assert a.rollouts.policy_version.tolist() == [4] * 6
    again = engine.generate(a.prompt_ids, sampling, seed=derive_seed(cfg.seed, "sample", 5, 0))
    assert torch.equal(again.token_ids, a.rollouts.token_ids)
    assert a.rewards_PGK.shape == (3, 2, 1) and a.correct_PG.shape == (3, 2)
