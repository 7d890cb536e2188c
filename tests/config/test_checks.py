"""The one generic check over the chosen entries' traits (``posttrain/config/checks.py``).

One test per trait shows a refusal and its message (both keys, both values, the entry's note); the
last tests register a new entry at test time with a trait and see it refused with no config change,
which is what the design is for: a method declares its traits and adds no rule.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import advantages, losses, shaping
from posttrain.algorithms.registry import Registry, Traits
from posttrain.algorithms.stateful import updater
from posttrain.config import ConfigError, load_config
from posttrain.config.checks import chosen_entries, driver_registry, needs_critic, selector_registry

RL_PLUS = Path(__file__).resolve().parents[2] / "recipes" / "rl_plus.toml"
ENV = ("task.name=env", "task.params={}", 'task.env={name="guess_number", max_tokens=24}')


def refused(make, *overrides: str) -> str:
    """The message of the ConfigError that ``make(*overrides)`` raises."""
    with pytest.raises(ConfigError) as e:
        make(*overrides)
    return str(e.value)


def test_chosen_entries_name_each_key_its_registry_and_name(tiny_cfg):
    cfg = tiny_cfg('algorithm.shapers=[{name="overlong", params={max_length=6, buffer=2}}]', "algorithm.kl_coef=0.1",
                   'algorithm.loss_weights=[{name="top_entropy"}]')
    got = {e.key: (e.registry.kind, e.name) for e in chosen_entries(cfg)}
    assert got["rollout.driver"] == ("rollout driver", "single_turn")
    assert got["algorithm.shapers[0]"] == ("reward shaper", "overlong")
    assert got["algorithm.loss_weights[0]"] == ("loss weight", "top_entropy")
    assert got["algorithm.batch_selector"] == ("batch selector", "none")
    assert got["algorithm.kl"] == ("KL estimator", "k3")  # on: kl_coef > 0
    assert "algorithm.kl_reward" not in got and "algorithm.entropy" not in got  # off: not chosen


@pytest.mark.parametrize(("overrides", "entry", "reason"), [
    (["rollout.driver=partial_states"], "rollout.driver = 'partial_states'", "its queue holds prefixes"),
    (['algorithm.shapers=[{name="traac_length"}]'], "algorithm.shapers[0] = 'traac_length'", "keeps a history"),
])
def test_async_safe_false_refuses_a_producer_running_ahead(tiny_cfg, overrides, entry, reason):
    msg = refused(tiny_cfg, "rollout.max_staleness=2", *overrides)
    assert msg.startswith(f"invalid config:\n  rollout.max_staleness = 2: {entry} cannot run ahead of the learner")
    assert re.search(reason, msg) and "use rollout.max_staleness = 0" in msg
    tiny_cfg(*overrides)  # synchronous: fine


def test_row_coupled_refuses_micro_batches(tiny_cfg):
    msg = refused(tiny_cfg, "algorithm.loss=clip_cov", "train.micro_batch_tokens=64")
    assert "train.micro_batch_tokens = 64: algorithm.loss = 'clip_cov' couples the rows of a minibatch (it picks " \
           "the tokens to clip by a covariance" in msg
    assert "set train.micro_batch_tokens = 0" in msg
    tiny_cfg("algorithm.loss=clip_cov")  # one pass per minibatch: fine


def test_aggregation_requires_the_one_the_entry_declares(tiny_cfg):
    msg = refused(tiny_cfg, "algorithm.loss=drpo")
    assert "algorithm.aggregation = 'token_mean': algorithm.loss = 'drpo' needs 'seq_mean_token_mean'" in msg
    assert "would weigh the groups by their token counts" in msg
    assert "set algorithm.aggregation = 'seq_mean_token_mean'" in msg
    tiny_cfg("algorithm.loss=drpo", "algorithm.aggregation=seq_mean_token_mean")


def test_drivers_restricts_the_rollout_driver(tiny_cfg):
    msg = refused(tiny_cfg, 'algorithm.loss_weights=[{name="aapo"}]')
    assert "rollout.driver = 'single_turn': algorithm.loss_weights[0] = 'aapo' runs with the driver(s) " \
           "['hint_reroll'] only" in msg
    assert "set rollout.driver = 'hint_reroll'" in msg
    tiny_cfg('algorithm.loss_weights=[{name="aapo"}]', "rollout.driver=hint_reroll")


def test_engines_restricts_the_rollout_engine(tiny_cfg, monkeypatch):
    from posttrain.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)  # the config's check, not the install
    msg = refused(tiny_cfg, 'rollout.engine="vllm"', "rollout.driver=hint_reroll")
    # the drivers declared for vllm are the way out, read off the registry
    from posttrain.produce.drivers import DRIVERS

    way_out = sorted(n for n in DRIVERS.names() if DRIVERS.traits(n).engines in (None, ()) or
                     "vllm" in DRIVERS.traits(n).engines)
    assert {"multi_turn", "single_turn"} <= set(way_out) and "hint_reroll" not in way_out
    assert "rollout.engine = 'vllm': rollout.driver = 'hint_reroll' runs with the engine(s) ['hf'] only (its " \
           "re-roll is tested with the hf engine only so far); with 'vllm' use rollout.driver = one of " \
           f"{way_out}, or rollout.engine = 'hf'" in msg
    assert tiny_cfg('rollout.engine="vllm"').rollout.engine == "vllm"


def test_replays_rows_refuses_entries_whose_rows_it_cannot_store(tiny_cfg):
    msg = refused(tiny_cfg, "algorithm.batch_selector=rorecomp", *ENV)
    assert "algorithm.batch_selector = 'rorecomp' replays stored rows, and rollout.driver = 'multi_turn' keeps " \
           "per-row state they lose (a multi-turn episode's rows carry turn masks and turn ids): use one or the " \
           "other" in msg
    msg = refused(lambda *o: load_config(RL_PLUS, ['out="unused"', *o]), "algorithm.batch_selector=rorecomp")
    assert "rollout.driver = 'external_mix' keeps per-row state they lose (its demonstration rows" in msg
    msg = refused(tiny_cfg, "algorithm.batch_selector=rorecomp", 'algorithm.loss_weights=[{name="top_entropy"}]')
    assert "algorithm.loss_weights[0] = 'top_entropy' keeps per-row state they lose" in msg
    tiny_cfg("algorithm.batch_selector=rorecomp")


@pytest.mark.parametrize(("override", "reader"), [
    ("algorithm.old_logprobs=behaviour", "algorithm.old_logprobs = 'behaviour'"),
    ("algorithm.behaviour_correction=icepop", "algorithm.behaviour_correction = 'icepop'"),
    ('algorithm.loss_weights=[{name="opsm"}]', "algorithm.loss_weights[0] = 'opsm'"),
])
def test_reads_behaviour_refuses_a_driver_of_external_rows(override, reader):
    msg = refused(lambda *o: load_config(RL_PLUS, ['out="unused"', *o]), override)
    assert "rollout.driver = 'external_mix': its external rows have no sampler log-probs (its demonstration rows " \
           f"have no sampler log-probs and carry an `external` flag; tested with the hf engine only so far), which " \
           f"{reader} read(s); use the learner's recomputed pi_old" in msg


def test_an_entry_requiring_external_needs_a_driver_of_external_rows(tiny_cfg):
    msg = refused(tiny_cfg, "algorithm.loss=rl_plus", "algorithm.advantage=grpo_onpolicy_stats")
    assert "algorithm.advantage = 'grpo_onpolicy_stats' and algorithm.loss = 'rl_plus' read(s) the external rows " \
           "of a group (the input `external`), which only the driver(s) ['external_mix'] supply; got " \
           "rollout.driver = 'single_turn' (set rollout.driver = 'external_mix')" in msg


@pytest.mark.parametrize(("override", "clash"), [
    ("model.lora.rank=4", "model.lora (an adapter)"),
    ("train.processes=2", "train.processes = 2"),
    ('cluster.backend="ray"', "cluster.backend = 'ray'"),
    ("rollout.max_staleness=1", "rollout.max_staleness = 1"),
])
def test_one_process_refuses_ranks_adapters_ray_and_running_ahead(tiny_cfg, override, clash):
    msg = refused(tiny_cfg, "algorithm.parameterization=ref_logit_mix", override)
    assert "algorithm.parameterization = 'ref_logit_mix' runs with the hf engine in one process, synchronously, " \
           f"on the full model (it wraps the policy and the frozen starting model together in the trainer's " \
           f"process); not with {clash}" in msg


def test_needs_critic_tells_the_loop_to_build_the_critic(tiny_cfg):
    assert needs_critic(tiny_cfg("algorithm.advantage=gae"))
    assert not needs_critic(tiny_cfg())


def test_the_declarations_agree_with_what_the_entries_read():
    # what a trait says that the signature also shows: a stateful shaper (its history advances with the learner's
    # steps, and shapers run in the producer) is async_safe=False; an estimator reading values needs the critic
    for name in shaping.names():
        assert shaping.REGISTRY.traits(name).async_safe == (updater(shaping, name) is None), name
    for name in advantages.names():
        reads_values = bool({"values", "turn_values"} & set(advantages.REGISTRY.required(name)))
        assert advantages.REGISTRY.traits(name).needs_critic == reads_values, name


def test_every_refusing_trait_comes_with_a_note(tiny_cfg):
    default = Traits()
    registries = {e.registry.kind: e.registry for e in chosen_entries(tiny_cfg())}
    registries |= {"rollout driver": driver_registry()[0], "batch selector": selector_registry()}
    for registry in registries.values():
        for name in registry.names():
            t = registry.traits(name)
            if t != default and not t.needs_critic:
                assert t.note, f"{registry.kind} {name!r} declares {t} without a note for its refusals"


# --- a new entry: declared at registration, refused with no config change --------------------------------------


def batch_centred(logp_NT: torch.Tensor, old_logp_NT: torch.Tensor, adv_NT: torch.Tensor,
                  mask_NT: torch.Tensor) -> torch.Tensor:
    """A test-only loss: l_t = -(A_t - mean over the minibatch's tokens of A) * ratio_t (the mean couples rows)."""
    mean = (adv_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1)
    return -(adv_NT - mean) * torch.exp(logp_NT - old_logp_NT) * mask_NT


def length_history(rewards: torch.Tensor, *, lengths: torch.Tensor) -> torch.Tensor:
    """A test-only shaper: r - 0.001 * length (declared async_safe=False as if it kept a history)."""
    return rewards - 0.001 * lengths


def _register(monkeypatch, registry: Registry, name: str, fn: object, **traits: object) -> None:
    """Register ``fn`` as ``name`` with ``traits`` for one test (the registry is restored after)."""
    monkeypatch.setitem(registry._entries, name, fn)
    monkeypatch.setitem(registry._traits, name, Traits(**traits))


def test_a_new_row_coupled_loss_is_refused_micro_batches_with_no_config_change(tiny_cfg, monkeypatch):
    _register(monkeypatch, losses.REGISTRY, "test_batch_centred", batch_centred, row_coupled=True,
              note="its baseline is a mean over the minibatch")
    assert tiny_cfg("algorithm.loss=test_batch_centred").algorithm.loss == "test_batch_centred"
    msg = refused(tiny_cfg, "algorithm.loss=test_batch_centred", "train.micro_batch_tokens=32")
    assert "train.micro_batch_tokens = 32: algorithm.loss = 'test_batch_centred' couples the rows of a minibatch " \
           "(its baseline is a mean over the minibatch)" in msg


def test_a_new_entry_of_any_registry_is_read_the_same_way(tiny_cfg, monkeypatch):
    _register(monkeypatch, shaping.REGISTRY, "test_length_history", length_history, async_safe=False,
              aggregation="seq_mean_token_mean", note="a test-only history")
    shaper = 'algorithm.shapers=[{name="test_length_history"}]'
    msg = refused(tiny_cfg, shaper, "algorithm.aggregation=seq_mean_token_mean", "rollout.max_staleness=1")
    assert "rollout.max_staleness = 1: algorithm.shapers[0] = 'test_length_history' cannot run ahead" in msg
    msg = refused(tiny_cfg, shaper)
    assert "algorithm.aggregation = 'token_mean': algorithm.shapers[0] = 'test_length_history' needs " \
           "'seq_mean_token_mean' (a test-only history)" in msg
    tiny_cfg(shaper, "algorithm.aggregation=seq_mean_token_mean")


@pytest.mark.parametrize("selector", ["rorecomp", "shuffle_r1"])
def test_a_row_coupled_loss_is_refused_a_selector_that_draws_its_own_minibatches(tiny_cfg, selector):
    # DRPO normalizes within a prompt's group: the update keeps groups whole in every minibatch, a selector that
    # draws its own minibatches (pairs, a priority batch and a replayed buffer) would cut them apart
    msg = refused(tiny_cfg, "algorithm.loss=drpo", "algorithm.aggregation=seq_mean_token_mean",
                  f'algorithm.batch_selector="{selector}"')
    assert f"algorithm.batch_selector = '{selector}' draws its own minibatches" in msg
    assert "algorithm.loss = 'drpo' couples the rows of a minibatch" in msg and "use one or the other" in msg
    tiny_cfg("algorithm.loss=drpo", "algorithm.aggregation=seq_mean_token_mean")  # the update's own minibatches
    tiny_cfg(f'algorithm.batch_selector="{selector}"')  # a loss that couples no rows
