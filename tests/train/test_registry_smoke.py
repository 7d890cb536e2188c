"""Every advantage estimator and policy loss the loop can serve runs end to end (TRL's
test_train_loss_types idea): finite loss, parameters change. Entries that need inputs the loop
does not provide yet are rejected at config time with a clear message."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.algorithms import advantages, aggregation, entropy, kl, losses
from posttrain.config import ConfigError
from posttrain.config.base import ADVANTAGE_INPUTS, LOSS_INPUTS, TURN_INPUTS
from posttrain.train.rl import train


def servable(registry, provided):
    return [n for n in registry.names() if set(registry.required(n)) <= set(provided)]


def driver_for(registry, name):
    """An entry that reads a group's external rows (RL-PLUS) runs with the driver that supplies them."""
    return ["rollout.driver=external_mix"] if "external" in registry.required(name) else []


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
    need = losses.REGISTRY.traits(name).aggregation  # the one its objective holds under (drpo's), if it declares one
    agg = [f"algorithm.aggregation={need}"] if need else []
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, f"algorithm.loss={name}", "algorithm.loss_params={}", *agg,
                            *driver_for(losses.REGISTRY, name))
    assert all(r["loss"] == r["loss"] for r in rows if "loss" in r)  # finite (not NaN)
    assert changed


@pytest.mark.parametrize("name", [n for n in servable(advantages.REGISTRY, ADVANTAGE_INPUTS)
                                  if not set(advantages.REGISTRY.required(n)) & set(TURN_INPUTS)])
def test_every_advantage_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    rows, _ = run_one(tiny_cfg, quiet, tmp_path, f"algorithm.advantage={name}", *driver_for(advantages.REGISTRY, name))
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


# The overrides each shaper needs in the loop (parameters, and a step scorer / a stepped task for the
# process-reward shapers); a shaper missing here fails test_every_shaper_has_a_smoke_run.
SHAPER_RUNS = {
    "overlong": ('algorithm.shapers=[{name="overlong", params={max_length=6, buffer=2}}]',),
    "noisy_verifier_backward": (
        'algorithm.shapers=[{name="noisy_verifier_backward", params={fp_rate=0.1, fn_rate=0.2}}]',
        'algorithm.advantage="rloo"',  # grpo's std division would cancel it: a config error
    ),
    "noisy_verifier_forward": (
        'algorithm.shapers=[{name="noisy_verifier_forward", params={fp_rate=0.1, fn_rate=0.2}}]',
        'algorithm.advantage="rloo"',  # grpo's std division would cancel it: a config error
    ),
    "par": ('algorithm.shapers=[{name="par"}]',),
    "rank": ('algorithm.shapers=[{name="rank"}]',),
    "traac_length": ('algorithm.shapers=[{name="traac_length", params={window=2}}]',),
    "prm_clip": ('algorithm.shapers=[{name="prm_clip"}]', 'algorithm.step_reward="reference_steps"',
                 "task.params={digits=2, steps=true}", "rollout.max_new_tokens=10"),
    "prm_delta": ('algorithm.shapers=[{name="prm_delta"}]', 'algorithm.step_reward="reference_steps"',
                  "task.params={digits=2, steps=true}", "rollout.max_new_tokens=10"),
}


def test_every_shaper_has_a_smoke_run():
    from posttrain.algorithms import shaping

    assert sorted(SHAPER_RUNS) == sorted(shaping.names())


@pytest.mark.parametrize("name", sorted(SHAPER_RUNS))
def test_every_shaper_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, *SHAPER_RUNS[name], "eval.prompts=4")
    assert changed and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize("name", aggregation.names())
def test_every_aggregation_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    params = "{norm_length=6}" if "norm_length" in aggregation.REGISTRY.required(name) else "{}"
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, f'algorithm.aggregation="{name}"',
                            f"algorithm.aggregation_params={params}", "eval.prompts=4")
    assert changed and all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize("name", kl.names())
def test_every_kl_estimator_trains(name, tiny_cfg, quiet, tmp_path, test_entries):
    # in the loss (kl_coef) and, for the same estimator, in the reward of reinforce_pp (kl_reward_coef)
    rows, changed = run_one(tiny_cfg, quiet, tmp_path, f'algorithm.kl="{name}"', "algorithm.kl_coef=0.1",
                            'algorithm.advantage="reinforce_pp"', f'algorithm.kl_reward="{name}"',
                            "algorithm.kl_reward_coef=0.1", "eval.prompts=4")
    assert changed and all(r["loss"] == r["loss"] and r["policy/kl_ref"] == r["policy/kl_ref"] for r in rows)
    assert all("kl_reward/kl" in r for r in rows)
