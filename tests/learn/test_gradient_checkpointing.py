"""train.gradient_checkpointing (posttrain/models/checkpointing.py): the decoder layers recompute their
activations in the backward pass, with the plain path's gradients, on every path of the update."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from posttrain.config import ConfigError, LearnSettings
from posttrain.learn.update import policy_update
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.models.checkpointing import enable_checkpointing, recomputes
from posttrain.models.load import encode_chat
from posttrain.rollout import SamplingParams, make_engine
from posttrain.train.loop_state import Phases
from posttrain.train.rl import train


@pytest.fixture(scope="module")
def tiny_batch(tmp_path_factory):
    """A tiny model and one sampled batch of 3 prompts x 4 completions (rows of a group share a prompt)."""
    d = tmp_path_factory.mktemp("gc") / "m"
    build_tiny(d, TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64, num_layers=3))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, q) for q in ("12+3=", "4+555=", "7+8=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=7, n=4), seed=3)
    return str(d), tok.pad_token_id, r


def _update(tiny_cfg, tiny_batch, checkpointed: bool, budget: int = 0):
    """One lr-0 update: its metrics, the gradients, and how often each decoder layer ran forward."""
    path, pad_id, r = tiny_batch
    model = load_model(path)
    if checkpointed:
        assert enable_checkpointing(model) == 3
    calls = {"layer": 0, "mlp": 0}  # a layer's __call__; its MLP's (also run when the backward recomputes it)
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: calls.__setitem__("layer", calls["layer"] + 1))
        layer.mlp.register_forward_pre_hook(lambda m, a: calls.__setitem__("mlp", calls["mlp"] + 1))
    cfg = tiny_cfg(f"train.micro_batch_tokens={budget}")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv = torch.linspace(-1, 1, 12)
    metrics = policy_update(model, None, opt, Phases.from_config(cfg).learn, LearnSettings.of(cfg), r.row_prompts, r,
                            r.loss_mask, adv, {}, pad_id, 0)
    return metrics, [p.grad.clone() for p in model.parameters()], calls


@pytest.mark.parametrize("budget", [0, 40])  # one pass; micro-batches of at most 40 tokens
def test_checkpointed_gradients_equal_the_plain_ones(tiny_cfg, tiny_batch, budget):
    plain_m, plain_g, plain_calls = _update(tiny_cfg, tiny_batch, False, budget)
    ckpt_m, ckpt_g, ckpt_calls = _update(tiny_cfg, tiny_batch, True, budget)
    for a, b in zip(plain_g, ckpt_g, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ckpt_m["loss"] == pytest.approx(plain_m["loss"], rel=1e-5, abs=1e-7)
    assert ckpt_m["optim/grad_norm"] == pytest.approx(plain_m["optim/grad_norm"], rel=1e-5)
    # plain: each layer's MLP runs once per layer call, and a micro-batch is two calls (a group's shared prompt,
    # then its rows); checkpointed: one call (each row runs its prompt: no cache in a checkpointed layer), and the
    # backward runs every MLP again
    assert plain_calls["mlp"] == plain_calls["layer"]
    assert ckpt_calls["layer"] == plain_calls["layer"] // 2 and ckpt_calls["mlp"] == 2 * ckpt_calls["layer"]


def test_recomputes_only_in_training_mode_with_gradients(tiny_batch):
    model = load_model(tiny_batch[0])
    assert not recomputes(model.train())
    enable_checkpointing(model)
    assert recomputes(model.train())
    assert not recomputes(model.eval())
    with torch.no_grad():
        assert not recomputes(model.train())


def test_a_model_without_checkpointable_layers_is_a_clear_error():
    with pytest.raises(ConfigError, match="train.gradient_checkpointing"):
        enable_checkpointing(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("lora", [False, True])
def test_a_run_with_checkpointing_matches_the_plain_run(tiny_cfg, quiet, tmp_path, lora):
    extra = ("model.lora.rank=4",) if lora else ()
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"run-{flag}"
        cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "eval.every=0",
                       f"train.gradient_checkpointing={str(flag).lower()}", *extra, out=str(out))
        train(cfg, console=quiet)
        runs[flag] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for plain, ckpt in zip(runs[False], runs[True], strict=True):
        for key in ("loss", "optim/grad_norm", "reward/mean"):
            assert ckpt[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_two_checkpointed_ranks_train_as_one_plain_process(tiny_cfg, quiet, tmp_path):
    if (torch.get_num_threads() or 1) < 2:
        pytest.skip("two ranks need two cores")
    common = ("train.steps=2", "checkpoint.every=0", "eval.every=0", "train.micro_batch_tokens=40")
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", "train.gradient_checkpointing=true", out=str(tmp_path / "two")),
          console=quiet)
    one, two = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        for k in ("loss", "optim/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
