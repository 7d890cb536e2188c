import re
from pathlib import Path

import pytest

from posttrain.config import ConfigError, apply_override, config_from_dict, dump_toml, load_config

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.toml"


def test_recipe_loads_and_overrides_apply():
    cfg = load_config(TINY, ["algorithm.loss=cispo", "rollout.group_size=16", "train.lr=3e-4"])
    assert cfg.algorithm.loss == "cispo"
    assert cfg.rollout.group_size == 16
    assert cfg.train.lr == pytest.approx(3e-4)


def test_unknown_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["rollout.group_sise=4"])
    msg = str(e.value)
    assert "rollout.group_sise" in msg and "group_size" in msg


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="unknown key 'optimiser'"):
        config_from_dict({"optimiser": {"lr": 1}})


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["rollout.group_size=many"])
    assert "rollout.group_size" in str(e.value) and "many" in str(e.value)


def test_out_of_range_value():
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(TINY, ["train.lr=-1"])


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("algorithm.advantage=grpoo", "'grpo'"),
        ("algorithm.loss=nope", "ppo_clip"),
        ("algorithm.aggregation=mean", "token_mean"),
        ("algorithm.kl=k9", "k3"),
        ('task.name="sudoku"', "arithmetic"),
        ('algorithm.parameterization="ref_logit"', "ref_logit_mix"),
    ],
)
def test_unknown_registry_name_lists_choices(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert fragment in str(e.value)


def test_unknown_loss_parameter_is_rejected():
    with pytest.raises(ConfigError, match="eps_hi"):
        load_config(TINY, ["algorithm.loss_params={eps_hi=0.3}"])


@pytest.mark.parametrize("override", [
    "model.lora.rank=4", "train.processes=2", 'cluster.backend="ray"',
    "rollout.max_staleness=1",
])
def test_a_parameterization_runs_only_where_it_is_built(override):
    # ref_logit_mix wraps the policy in the trainer's process: layouts that ship weights elsewhere are refused
    base = ['algorithm.parameterization="ref_logit_mix"']
    assert load_config(TINY, base).algorithm.parameterization == "ref_logit_mix"
    with pytest.raises(ConfigError, match="algorithm.parameterization = 'ref_logit_mix' runs with the hf engine"):
        load_config(TINY, [*base, override])
    with pytest.raises(ConfigError, match=r"has no parameter\(s\) \['w'\]"):
        load_config(TINY, [*base, "algorithm.parameterization_params={w=0.5}"])


def test_unknown_reward_name():
    with pytest.raises(ConfigError, match="reward"):
        config_from_dict({"reward": [{"name": "nonexistent"}]})


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/recipe.toml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_override({}, "rollout.group_size")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["algorithm.loss_params={eps_low=0.2, eps_high=0.28}"])
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    again = load_config(path)
    assert again == cfg


def test_config_reference_doc_is_generated_from_the_code():
    from posttrain.docgen.config_doc import render

    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert doc == render(), "docs/config.md is stale: run `python -m posttrain.docgen.config_doc > docs/config.md`"


def test_a_mistyped_name_gets_the_closest_choice():
    from posttrain.config import ConfigError

    for override, hint in [("algorithm.advantage=grpp", "did you mean 'grpo'?"),
                           ("algorithm.loss=ppo_clp", "did you mean 'ppo_clip'?"),
                           ("algorithm.batch_selector=shufle_r1", "did you mean 'shuffle_r1'?"),
                           ('task.name="arithmetc"', "did you mean 'arithmetic'?")]:
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(TINY, [override])


def test_validating_a_config_imports_nothing_of_the_loop():
    # config -> train was an import circle (the batch-selector check lived in prepare/selectors.py); the check
    # reads the registries of the drivers and the batch selectors (config/checks.py), nothing of the loop, the
    # learner or the run's set-up
    import subprocess
    import sys

    code = (
        "import sys; from posttrain.config import load_config; "
        "load_config('recipes/tiny.toml', ['algorithm.batch_selector=\"shuffle_r1\"']); "
        "print(sorted(m for m in sys.modules if m.startswith(('posttrain.train', 'posttrain.learn', "
        "'posttrain.run'))))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
