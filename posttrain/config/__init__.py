"""Typed, validated run configuration read from TOML recipes with dotted overrides.

``load_config("recipes/grpo.toml", ["algorithm.loss=cispo", "rollout.group_size=16"])``.
Every error is raised before any model loads, as a :class:`ConfigError` whose message names the
key, the value given and the valid choices.

The package is cut by role, as the loop is: ``model`` and ``task`` (what is trained, on what),
``produce`` (``[rollout]``: sampling, engine, driver), ``algorithm`` (the registry entries of the
prepare and learn phases), ``learn`` (``[train]``, ``[critic]``), ``run`` (cluster, eval,
diagnostics, checkpoint, log), ``trainers`` (sft, dpo, rm, rft); ``root`` joins them into
:class:`Config`, ``phases`` cuts it into what each phase reads, ``load`` reads and writes recipes,
``moved`` names the keys that moved.
"""

from posttrain.config.load import apply_override, config_from_dict, dump_toml, load_config, read_recipe
from posttrain.config.phases import LearnSettings, ProduceSettings
from posttrain.config.root import Config
from posttrain.errors import ConfigError

__all__ = [
    "Config", "ConfigError", "LearnSettings", "ProduceSettings", "apply_override", "config_from_dict", "dump_toml",
    "load_config", "read_recipe",
]
