"""The Python API: ``load_config``, ``train``, ``sft``, ``dpo`` and ``evaluate`` (exported from ``posttrain``).

Each entry takes a recipe path or a :class:`~posttrain.config.Config`, plus dotted overrides, and runs what
the command line runs (``posttrain train RECIPE k=v``), returning the run's summary dict (``run_dir`` in it).
``train(rewards=[fn, (other_fn, 0.5)])`` lends Python callables to the run as reward components named after
the functions: they are registered for the call (before the reward workers fork, so the workers know them)
and unregistered after it. See ``docs/api.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config import Config
    from posttrain.run.checkpoint import Resume

RewardItem = Callable[..., object] | str | tuple[Callable[..., object] | str, float]


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``recipe`` (``None``: the defaults), import its plugins, apply dotted ``overrides`` and validate;
    a bad key, value or name raises :class:`~posttrain.errors.ConfigError` naming it.
    """
    from posttrain.config import load_config as load

    return load(recipe, list(overrides))


def _config(recipe_or_config: str | Path | Config | None, overrides: Sequence[str],
            rewards: list[dict] | None = None) -> Config:
    """A validated Config from a recipe or a Config, with ``overrides`` (and reward components) applied."""
    from posttrain.config import Config, apply_override, config_from_dict, read_recipe

    if isinstance(recipe_or_config, Config):
        data = recipe_or_config.model_dump(mode="json")
    elif recipe_or_config is None:
        data = {}
    elif isinstance(recipe_or_config, str | Path):
        data = read_recipe(recipe_or_config)
    else:
        raise ConfigError(f"expected a recipe path or a posttrain Config, got {type(recipe_or_config).__name__}")
    for o in overrides:
        apply_override(data, o)
    if rewards is not None:
        data["reward"] = rewards
    return config_from_dict(data)


@contextmanager
def lent_rewards(rewards: Sequence[RewardItem]) -> Iterator[list[dict]]:
    """Register each callable as a reward named after it for the ``with`` block; yields the ``[[reward]]``
    components (``{name, weight}``). A string is a registered reward's name; ``(item, weight)`` weighs it.
    A lambda (no name), a non-callable or a name taken by another reward is a :class:`ConfigError`.
    """
    from posttrain.algorithms.registry import LOADING
    from posttrain.rewards import REGISTRY

    lent: list[str] = []
    specs: list[dict] = []
    try:
        for i, item in enumerate(rewards):
            fn, weight = item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ConfigError(f"rewards[{i}]: the weight of a (callable, weight) pair is a number, got {weight!r}")
            if isinstance(fn, str):
                specs.append({"name": fn, "weight": float(weight)})
                continue
            name = getattr(fn, "__name__", None)
            if not callable(fn) or not name or name == "<lambda>":
                raise ConfigError(f"rewards[{i}]: expected a named function (prompt, completion, **fields) -> "
                                  f"float | None, a reward name or a (function, weight) pair; got {item!r}")
            known = next((n for n in REGISTRY.names() if REGISTRY.get(n) is fn), None)
            if known is not None:  # a registered reward passed as itself: used by its name, not lent
                name = known
            else:
                LOADING.append(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', name)}")
                try:
                    REGISTRY.register(name)(fn)
                except ValueError as e:
                    raise ConfigError(f"rewards[{i}]: {e}") from None
                finally:
                    LOADING.pop()
                lent.append(name)
            specs.append({"name": name, "weight": float(weight)})
        yield specs
    finally:
        for name in lent:
            REGISTRY.unregister(name)


def train(recipe_or_config: str | Path | Config | None = None, *, overrides: Sequence[str] = (),
          rewards: Sequence[RewardItem] | None = None, resume: Resume = False,
          console: Console | None = None) -> dict:
    """RL training (``posttrain train``); returns the summary (``run_dir``, ``steps``, final metrics).

    ``rewards`` replaces the recipe's ``[[reward]]`` components with these callables (or reward names),
    each ``(prompt, completion, **fields) -> float | None``, scored like any reward (in the reward workers,
    with timeouts; a raise, a non-number or NaN scores ``None`` and is counted). ``resume=True`` continues
    the run in the config's ``out``; pass the same ``rewards`` again.
    """
    from posttrain.train.rl import train as run

    if rewards is None:
        return run(_config(recipe_or_config, overrides), resume=resume, console=console or Console())
    with lent_rewards(rewards) as specs:
        return run(_config(recipe_or_config, overrides, specs), resume=resume, console=console or Console())


def sft(recipe_or_config: str | Path | Config | None = None, *, overrides: Sequence[str] = (),
        resume: Resume = False, console: Console | None = None) -> dict:
    """Supervised fine-tuning on the task's demonstrations (``posttrain sft``); returns the summary."""
    from posttrain.trainers.sft import sft as run

    return run(_config(recipe_or_config, overrides), resume=resume, console=console or Console())


def dpo(recipe_or_config: str | Path | Config | None = None, *, overrides: Sequence[str] = (),
        resume: Resume = False, console: Console | None = None) -> dict:
    """Preference optimization, the DPO family (``posttrain dpo``); returns the summary."""
    from posttrain.trainers.dpo import dpo_train

    return dpo_train(_config(recipe_or_config, overrides), resume=resume, console=console or Console())


def evaluate(recipe_or_config: str | Path | Config | None = None, *, model: str | Path | None = None,
             overrides: Sequence[str] = (), out: str | Path | None = None,
             console: Console | None = None) -> dict:
    """pass@k, maj@k and calibration of ``model`` (a model, checkpoint or run directory; default
    ``model.path``) on the task's held-out prompts (``posttrain eval``); returns the results dict, also
    written to ``out`` (default ``<cfg.out>/eval.json``).
    """
    from posttrain.evaluation.run import run_eval

    cfg = _config(recipe_or_config, overrides)
    return run_eval(cfg, model=str(model) if model is not None else None, out=str(out) if out is not None else None,
                    console=console or Console())
