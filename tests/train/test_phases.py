"""The loop's phases: input providers, stateful components, and a loop that names no method."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from posttrain.algorithms import (
    advantages,
    aggregation,
    entropy,
    kl,
    loss_weights,
    losses,
    offpolicy,
    selection,
    shaping,
)
from posttrain.prepare.providers import PROVIDERS
from posttrain.prepare.selectors import REGISTRY as SELECTOR_FNS
from posttrain.prepare.selectors import SELECTORS
from posttrain.produce.drivers import DRIVERS
from posttrain.produce.parts import PROVIDED_INPUTS, advantage_inputs
from posttrain.train.loop_state import Phases, StepRecord, advance_all, components, load_all

RL = Path(__file__).resolve().parents[2] / "posttrain" / "train" / "rl.py"
# what a loop that knows whether it runs sync or async reaches for: the pipeline owns the weight hand-off
# (produce/pipeline.py: after_update, for_eval), so no module of train/ tests the mode or syncs an engine itself
HAND_OFF = {"asynchronous", "publish", "sync", "sync_to"}
STEP_HAND_OFF = HAND_OFF | {"max_staleness", "weights_for"}  # _step does not even fetch the weights


def test_every_provided_input_has_one_provider():
    assert set(PROVIDERS.names()) == set(PROVIDED_INPUTS)


def test_every_batch_selector_is_registered_with_its_parameters():
    assert set(SELECTOR_FNS.names()) == set(SELECTORS) == {"none", "shuffle_r1", "rorecomp"}


def test_inputs_follow_the_estimators_declaration(tiny_cfg):
    def inputs(*overrides: str) -> tuple[str, ...]:
        return advantage_inputs(tiny_cfg(*overrides).algorithm)

    assert "metric" in advantages.REGISTRY.required("canon")
    assert inputs("algorithm.advantage=grpo") == ()
    assert inputs("algorithm.advantage=gae") == ("values",)
    assert inputs("algorithm.advantage=canon", "algorithm.advantage_metric=entropy") == ("entropies", "metric")
    assert inputs("algorithm.advantage=canon", "algorithm.advantage_metric=length") == ("metric",)
    assert inputs("algorithm.advantage=reinforce_pp", "algorithm.kl_reward_coef=0.1") == ("token_rewards",)  # KL in r
    assert inputs("algorithm.advantage=remax") == ("baseline_rewards",)
    # the phases bind the same list: produce samples some of it, prepare provides the rest
    phases = Phases.from_config(tiny_cfg("algorithm.advantage=remax"))
    assert phases.produce.inputs == phases.prepare.inputs == ("baseline_rewards",)


def test_stateful_components_load_and_advance_by_key(tiny_cfg):
    cfg = tiny_cfg('algorithm.entropy="aent"', "rollout.driver=partial_states", "algorithm.kl_reward_coef=0.05",
                   "algorithm.kl_reward_target=0.1", "algorithm.advantage=reinforce_pp",
                   "algorithm.kl_reward_horizon=64", 'algorithm.batch_selector="rorecomp"')
    rollouts = components(Phases.from_config(cfg), cfg.rollout.driver)
    assert [c.key for c in rollouts] == ["entropy", "kl_reward", "batch_selector", "partial_states"]
    live = load_all(rollouts, {})
    assert live["kl_reward"] == 0.05 and live["partial_states"] is None
    r = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    rec = StepRecord(r, r, torch.ones(2, 2), {"entropy/regularized": 0.3}, {"kl_reward/kl": 0.2},
                     {"items": []}, [{"prefix": "1"}])
    saved = advance_all(rollouts, live, rec)
    assert saved["partial_states"] == [{"prefix": "1"}] and saved["batch_selector"] == {"items": []}
    assert saved["kl_reward"]["coef"] > 0.05  # KL above target: beta rises
    assert load_all(rollouts, saved)["kl_reward"] == saved["kl_reward"]["coef"]
    assert set(saved["entropy"]) and saved["entropy"] != {}


def _method_names() -> set[str]:
    """The names of the loop's registry entries (``none``, every registry's "off", is not a method)."""
    return {*advantages.names(), *losses.names(), *aggregation.names(), *kl.names(), *entropy.names(),
            *shaping.names(), *DRIVERS.names(), *SELECTORS} - {"none"}


def test_the_loop_names_no_method():
    src = RL.read_text()
    names = _method_names()
    named = sorted(n for n in names if re.search(rf"[\"']{re.escape(n)}[\"']", src))  # a name as a string
    assert named == [], f"rl.py names methods: {named}"


def hand_off_names(source: str, function: str | None = None, names: set[str] = HAND_OFF) -> list[str]:
    """The identifiers of ``names`` in ``source`` (in ``function`` only, when given), and "asynchronous" in its
    text (comments too) when ``function`` is given.
    """
    tree = ast.parse(source)
    if function is not None:
        tree = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    found = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree)
             if isinstance(n, ast.Attribute | ast.Name)} & names
    if function is not None and "asynchronous" in "\n".join(source.splitlines()[tree.lineno - 1 : tree.end_lineno]):
        found.add("asynchronous")
    return sorted(found)


def test_the_loop_does_not_know_whether_it_runs_sync_or_async():
    # the step as it once read: it branched on the mode to sync the engine or publish the weights
    old = (
        "def _step(rp, state):\n"
        "    if not rp.pipeline.asynchronous:\n"
        "        rp.learner.sync_to(rp.engine, state.version)\n"
        "    rp.pipeline.publish(state.step, rp.learner.weights_for(rp.pipeline.engine), state.version)\n"
    )
    assert hand_off_names(old, "_step", STEP_HAND_OFF) == ["asynchronous", "publish", "sync_to", "weights_for"]
    assert hand_off_names("def _step():\n    pass  # the asynchronous case\n", "_step") == ["asynchronous"]
    src = RL.read_text()
    assert hand_off_names(src, "_step", STEP_HAND_OFF) == [], "rl.py's _step hands weights over itself"
    for path in sorted(RL.parent.glob("*.py")):
        # no module of the loop tests the mode, syncs an engine, or fetches the weights to hand over (the pipeline
        # takes them from the Learner itself, at start and after each update)
        assert hand_off_names(path.read_text(), names=STEP_HAND_OFF - {"max_staleness"}) == [], \
            f"{path.name} tests sync vs async, syncs an engine or fetches the weights to hand over"


PHASES = [Path(__file__).resolve().parents[2] / "posttrain" / d for d in ("train", "produce", "prepare", "learn")]


def _compared_strings(tree: ast.AST) -> set[str]:
    """String constants that a comparison (``==``, ``!=``, ``in``, ``not in``) or a ``match`` case reads: what a
    branch on a method's name looks like (``if loss == NAME``, ``if driver in (NAME, ...)``).
    """
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in (node.left, *node.comparators):
                out |= {c.value for c in ast.walk(part) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            out.add(node.value.value)
    return out


def test_no_phase_module_branches_on_a_method_name():
    # rl.py names no method at all (above); every module of the phases (train/, produce/, prepare/, learn/) may
    # mention a method in a docstring or a message, and registers its own entries by name, but never compares a
    # name with a method's: what a phase does for a method is that method's entry and its declared traits
    names = _method_names() | {*loss_weights.names(), *offpolicy.names(), *selection.names()}
    files = sorted(p for d in PHASES for p in d.rglob("*.py"))
    assert len(files) > 30  # the guard reads the phases, not an empty folder
    branches = {str(p.relative_to(PHASES[0].parent)): sorted(_compared_strings(ast.parse(p.read_text())) & names)
                for p in files}
    assert {k: v for k, v in branches.items() if v} == {}


def test_the_branch_finder_sees_a_comparison_with_a_method_name():
    src = 'if cfg.algorithm.loss == "my_loss":\n    pass\nok = name in ("x", "my_driver")\n"""a docstring: y"""\n'
    assert _compared_strings(ast.parse(src)) == {"my_loss", "x", "my_driver"}
