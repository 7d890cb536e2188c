"""Reasoning Gym's procedural datasets as a task (``pip install 'posttrain[reasoning_gym]'``).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates about a hundred kinds of
verifiable problems (arithmetic, leg counting, word sorting, sudoku, ...), each dataset with its own
config dataclass and its own scorer ``dataset.score_answer(answer, entry)``. This task wraps one
dataset, or a weighted mix of several (reasoning-gym's ``composite`` dataset)::

    [task]
    name = "reasoning_gym"
    params = { dataset = "leg_counting", min_animals = 1, max_animals = 2 }   # config passed through

    [task]
    name = "reasoning_gym"
    params = { datasets = { leg_counting = 2.0, basic_arithmetic = { weight = 1.0, max_terms = 3 } } }

Every key but ``dataset``, ``datasets``, ``instruction`` and ``fallback`` is the dataset's own
config (for a mix: the composite's ``size`` and ``seed``; per-dataset settings go in the dataset's
table next to its ``weight``). The names and keys are checked when the config is validated, before
anything loads (:func:`parse`, through :meth:`ReasoningGymTask.check`): an unknown dataset is an
error with a did-you-mean, an unknown config key lists the valid ones, and reasoning-gym's own
``validate()`` runs on the config.

Prompt: the dataset's question, a blank line, then ``instruction`` (default :data:`INSTRUCTION`):
reasoning-gym reads the answer from the last ``<answer>...</answer>`` (its ``extract_answer``), and
its own system prompts ask for the same tags. ``instruction = ""`` leaves the question bare (set
``task.system_prompt`` instead, e.g. to reasoning-gym's ``SYSTEM_PROMPTS["default"]``).

A small model may never write the tags (SmolLM2-135M-Instruct answers "1 + 8 = 9" however it is
asked), and then every completion scores 0 and RL has nothing to learn from. ``fallback`` reads an
untagged completion anyway: ``"last_number"`` (its last number, for numeric datasets) or
``"last_line"`` (its last non-empty line); the default ``"none"`` is reasoning-gym's rule (no tags,
no answer). Tags, when present, always win.

Answer: the entry's ``answer`` (``""`` for the few datasets with many valid answers and no single
oracle, e.g. ``rubiks_cube``); demonstration: ``<answer>ANSWER</answer>``. The entry itself is in
``Example.fields["entry"]`` (and ``fields["source_dataset"]`` its dataset), which is what the scorer
reads. :meth:`ReasoningGymTask.verify` is the dataset's scorer on the extracted answer, so it can
give partial credit in ``[0, 1]`` where the dataset does (evaluation counts a score above 0.5 as
correct); a completion without answer tags (and no ``fallback``) scores 0.

Splits: the problems are the items ``0 .. size-1`` of the dataset built with ``seed`` (0 unless
given; reasoning-gym's default ``size``, mostly 500, unless given). A problem's split is that of its
question text (:func:`posttrain.tasks.base.split_of` on ``"reasoning_gym:" + question``), so a
question, however many items repeat it, is never in both splits; each split draws items with its own
seeded stream (:func:`posttrain.tasks.base.sample_split`). About one problem in ten is held out: set
``size`` larger for a larger test split. The task remembers the split of each item it has generated,
so a draw of an item of the other split is rejected without generating it again (the same draws,
fewer item builds: the test split rejects nine in ten).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.errors import ConfigError, unknown_name
from posttrain.tasks.base import Example, Split, make_alphabet, sample_split, split_of

INSTRUCTION = "Give your final answer inside <answer></answer> tags."
FALLBACKS = ("none", "last_number", "last_line")
"""What :meth:`ReasoningGymTask.extract` reads from a completion without ``<answer>`` tags."""
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MIX_KEYS = ("seed", "size")
"""The composite dataset's own config keys (a mix's per-dataset settings go in its ``datasets`` table)."""
INSTALL = "pip install 'posttrain[reasoning_gym]' (or: pip install reasoning-gym)"


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's ``{name: (dataset class, config dataclass)}``, imported on first use (about 1 s)."""
    try:
        import reasoning_gym  # noqa: F401 - importing registers every dataset
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ConfigError(f"task.name = 'reasoning_gym' needs the reasoning-gym package: {INSTALL}") from e
    return DATASETS


def dataset_names() -> list[str]:
    """The names of reasoning-gym's datasets (``composite`` left out: it is what ``datasets`` builds)."""
    return sorted(n for n in _registry() if n != "composite")


def _known(key: str, name: object) -> str:
    if not isinstance(name, str) or name not in dataset_names():
        raise ConfigError(unknown_name(key, "reasoning-gym dataset", str(name), dataset_names()))
    return name


def _typed(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with lists as tuples where dataset ``name``'s field defaults to a tuple (TOML and
    JSON have no tuples; ``operators = ["+", "-"]`` is meant as reasoning-gym's tuple).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(_registry()[name][1])}
    return {k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple) else v for k, v in config.items()}


def _checked_config(key: str, name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` for dataset ``name``, checked against its dataclass and its ``validate()``."""
    fields = sorted(f.name for f in dataclasses.fields(_registry()[name][1]))
    for k in config:
        if k not in fields:
            raise ConfigError(unknown_name(f"{key}.{k}", f"{name} config key", k, fields))
    out = _typed(name, config)
    try:
        made = _registry()[name][1](**out)
        if hasattr(made, "validate"):
            made.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: reasoning-gym rejects the {name} config {out}: {e or type(e).__name__}") from e
    return out


@dataclass(frozen=True)
class Source:
    """What to build: reasoning-gym dataset ``name`` (``composite`` for a mix) with ``config``."""

    name: str
    config: dict[str, Any]
    instruction: str
    fallback: Literal["none", "last_number", "last_line"] = "none"

    def canonical(self) -> str:
        """A stable text of the source: the cache key of the built dataset."""
        return json.dumps({"name": self.name, "config": self.config}, sort_keys=True)


def _mix(datasets: object, rest: Mapping[str, Any]) -> dict[str, Any]:
    """The composite dataset's config for ``datasets = {NAME = weight | {weight = w, KEY = value}}``."""
    if not isinstance(datasets, Mapping) or not datasets:
        raise ConfigError("task.params.datasets: a table {NAME = weight, ...} of at least one dataset; "
                          f"got {datasets!r}")
    specs = []
    for name, value in datasets.items():
        key = f"task.params.datasets.{name}"
        _known("task.params.datasets", name)
        settings = dict(value) if isinstance(value, Mapping) else {"weight": value}
        weight = settings.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{key}: the weight must be a number > 0; got {weight!r}")
        specs.append({"name": name, "weight": float(weight), "config": _checked_config(key, name, settings)})
    unknown = sorted(set(rest) - set(MIX_KEYS))
    if unknown:
        raise ConfigError(f"task.params: {unknown} with a mix: a mix takes {list(MIX_KEYS)} (the composite's); put a "
                          f"dataset's settings in its table: datasets.NAME = {{ weight = 1.0, KEY = VALUE }}")
    config = {"seed": 0, **rest, "datasets": specs}
    try:  # the composite's own check (size, seed), on the DatasetSpec objects it expects
        _composite_config(config).validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ConfigError(f"task.params: reasoning-gym rejects the mix's {rest}: {e or type(e).__name__}") from e
    return config


def _composite_config(config: Mapping[str, Any]) -> Any:  # noqa: ANN401 - a reasoning_gym CompositeConfig
    from reasoning_gym.composite import CompositeConfig, DatasetSpec

    specs = [DatasetSpec(**{**spec, "config": _typed(spec["name"], spec["config"])}) for spec in config["datasets"]]
    return CompositeConfig(**{**config, "datasets": specs})


def parse(params: Mapping[str, Any]) -> Source:
    """Check ``task.params`` and say what to build; loads no dataset (the configs are dataclasses).

    Raises:
        ConfigError: naming the key: neither or both of ``dataset`` / ``datasets``, an unknown dataset
            (with a did-you-mean), an unknown config key (with the valid ones), a config reasoning-gym
            rejects, a bad weight, or reasoning-gym missing.

    """
    rest = dict(params)
    instruction, fallback = rest.pop("instruction", INSTRUCTION), rest.pop("fallback", "none")
    if not isinstance(instruction, str):
        raise ConfigError(f"task.params.instruction: a string; got {instruction!r}")
    if fallback not in FALLBACKS:
        raise ConfigError(unknown_name("task.params.fallback", "answer fallback", str(fallback), list(FALLBACKS)))
    dataset, datasets = rest.pop("dataset", None), rest.pop("datasets", None)
    if (dataset is None) == (datasets is None):
        raise ConfigError("task.params: set one of dataset = NAME (one reasoning-gym dataset) or "
                          "datasets = { NAME = weight, ... } (a weighted mix)"
                          + ("; got both" if dataset is not None else ""))
    if datasets is not None:
        return Source("composite", _mix(datasets, rest), instruction, fallback)
    name = _known("task.params.dataset", dataset)
    return Source(name, _checked_config("task.params", name, {"seed": 0, **rest}), instruction, fallback)


@functools.lru_cache(maxsize=16)
def _build(canonical: str) -> Any:  # noqa: ANN401 - a reasoning_gym ProceduralDataset
    """The dataset of ``Source.canonical()``, built once per process (word lists, puzzles load in
    ``__init__``): a worker process forked from the trainer finds it here already built.
    """
    from reasoning_gym import create_dataset

    source = json.loads(canonical)
    if source["name"] == "composite":
        return create_dataset("composite", **vars(_composite_config(source["config"])))
    return create_dataset(source["name"], **_typed(source["name"], source["config"]))


class ReasoningGymTask:
    """One reasoning-gym dataset or a weighted mix; see the module docstring."""

    name: str = "reasoning_gym"

    def __init__(self, **params: Any) -> None:  # noqa: ANN401 - the dataset's config, passed through
        self.params = dict(params)
        self.source = parse(self.params)
        self._canonical = self.source.canonical()
        # the split of each pool item seen: a draw of an item of the other split is rejected without
        # generating it again (the test split rejects nine draws in ten; some datasets take 0.1 s an item)
        self._split_of_item: dict[int, Split] = {}
        # any text: a tiny model's character tokenizer maps what is not printable ASCII to unk
        self.alphabet = make_alphabet(string.printable, self.source.instruction)

    @staticmethod
    def check(params: Mapping[str, Any]) -> None:
        """The config's load-free check of ``task.params`` (see :func:`parse`)."""
        parse(params)

    def __repr__(self) -> str:
        return f"ReasoningGymTask({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # The reward workers get the task with every call: send the params, not the dataset (some hold
        # megabytes of word lists, some cannot be pickled); the receiving process builds it once.
        return (_rebuild, (self.params,))

    @property
    def dataset(self) -> Any:  # noqa: ANN401 - a reasoning_gym ProceduralDataset
        """The built reasoning-gym dataset (cached per process)."""
        return _build(self._canonical)

    def _draw(self, rng: random.Random, split: Split) -> tuple[str, Example] | None:
        ds = self.dataset
        index = rng.randrange(ds.size)
        if self._split_of_item.get(index, split) != split:
            return None  # what sample_split would reject, known without generating the item
        entry = ds[index]
        question, answer = entry["question"], entry["answer"]
        answer = "" if answer is None else str(answer)
        prompt = f"{question.rstrip()}\n\n{self.source.instruction}" if self.source.instruction else question
        example = Example(
            prompt=prompt,
            answer=answer,
            demonstration=f"<answer>{answer}</answer>",
            fields={"entry": entry, "source_dataset": entry["metadata"].get("source_dataset", self.source.name)},
        )
        key = f"reasoning_gym:{question}"  # the split follows the question text alone
        self._split_of_item[index] = split_of(key)
        return key, example

    def examples(self, split: Split, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples of ``split``, sampled with replacement (see :func:`sample_split`).

        Raises:
            ValueError: when ``split`` holds no problem of the pool (a small ``size``), saying so.

        """
        size = self.dataset.size
        tries = min(10_000, max(200, 20 * size))  # a pool of `size` items: 20 size draws miss none (e^-20)
        try:
            return sample_split(split, n, seed, lambda rng: self._draw(rng, split), max_tries_per_example=tries)
        except ValueError as e:
            raise ValueError(f"reasoning-gym dataset {self.source.name!r}: {e} The pool is its {size} items "
                             "(its config's size), one question in ten held out: set task.params.size higher") from e

    def extract(self, completion: str) -> str | None:
        """The text in the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``); without
        tags, ``None``, or with ``fallback`` the completion's last number or last non-empty line.
        """
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(completion)
        if tagged is not None or self.source.fallback == "none":
            return tagged
        if self.source.fallback == "last_number":
            numbers = _NUMBER.findall(completion)
            return numbers[-1] if numbers else None
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None

    def verify(self, completion: str, example: Example) -> float:
        """The dataset's own ``score_answer`` on the extracted answer, in ``[0, 1]``; 0.0 without one."""
        answer = self.extract(completion)
        if answer is None:
            return 0.0
        return float(self.dataset.score_answer(answer, example.fields["entry"]))


def _rebuild(params: dict[str, Any]) -> ReasoningGymTask:
    """Unpickle a :class:`ReasoningGymTask` from its params."""
    return ReasoningGymTask(**params)
