"""Every advantage estimator and policy loss the loop can serve runs end to end (TRL's
test_train_loss_types idea): finite loss, parameters change. Entries that need inputs the loop
does not provide yet are rejected at config time with a clear message."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms import advantages, entropy, losses
from posttrain.config import ADVANTAGE_INPUTS, LOSS_INPUTS, ConfigError
from posttrain.train.rl import train


def servable(registry, provided):
    return [n for n in registry.names() if set(registry.required(n)) <= set(provided)]


def run_one(tiny_cfg, quiet, tmp_path, *overrides):  # needs the test_entries fixture
    cfg = tiny_cfg(
        "train.steps=2",
        "checkpoint.every=0",
        "rollout.prompts_per_step=4",
        'reward=[{name="test_step_reward"}]',
        "train.lr=1e-2",
        *overrides,
    )
    train(cfg, console=quiet)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/nonfinite"] == 0 for r in rows)
    before = AutoModelForCausalLM.from_pretrained(run / "base_model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000002").state_dict()
    return rows, any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", servable(losses.REGISTRY, LOSS_INPUTS))
def test_every_loss_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    if name.startswith("test_"):
        pytest.skip("test-only entry")
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, f"algorithm.loss={name}", "algorithm.loss_params={}")
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # finite (not NaN)
    assert changed


@pytest.mark.parametrize("name", servable(advantages.REGISTRY, ADVANTAGE_INPUTS))
def test_every_advantage_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    rows, _ = run_one(tiny_cfg, quiet, tmp_path, f"algorithm.advantage={name}")
    assert all(r["adv/mean"] == r["adv/mean"] for r in rows)


@pytest.mark.parametrize(
    "overrides",
    [
        ('algorithm.advantage="canon"',),  # metric: mean token entropy (one no-grad forward)
        ('algorithm.advantage="canon"', 'algorithm.advantage_metric="length"'),
        ('algorithm.advantage="progrpo"',),  # prompt_confidence (one no-grad forward over the prompts)
    ],
    ids=["canon-entropy", "canon-length", "progrpo"],
)
def test_estimators_fed_computed_inputs_train(overrides, tiny_cfg, quiet, tmp_path, test_entries):
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, *overrides, "eval.prompts=4")
    assert changed and all(r["loss"] == r["loss"] and r["adv/zero_group_frac"] < 1 for r in rows)


def test_an_estimator_needing_an_input_the_loop_lacks_fails_at_config_time(tiny_cfg, monkeypatch):
    def needs_token_rewards(rewards, *, token_rewards):
        """Test-only estimator."""
        return rewards

    monkeypatch.setitem(advantages.REGISTRY._entries, "test_token_rewards", needs_token_rewards)
    with pytest.raises(ConfigError, match=r"needs input\(s\) \['token_rewards'\] that the training loop does not"):
        tiny_cfg('algorithm.advantage="test_token_rewards"')


@pytest.mark.parametrize("name", entropy.names())
def test_every_entropy_regularizer_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, f'algorithm.entropy="{name}"')
    assert changed and all(r["loss"] == r["loss"] for r in rows)
