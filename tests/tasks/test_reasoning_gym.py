"""ReasoningGymTask: config checks at validation, prompts, the dataset's own scorer, disjoint splits, mixes,
pickling for the reward workers, and a two-step run of recipes/reasoning_gym.toml on the tiny model."""

from __future__ import annotations

import json
import math
import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install 'posttrain[reasoning_gym]'")

from posttrain.config import ConfigError, load_config  # noqa: E402
from posttrain.tasks import TASKS, make_task, split_of  # noqa: E402
from posttrain.tasks import reasoning_gym as rg  # noqa: E402
from posttrain.tasks.reasoning_gym import INSTRUCTION, ReasoningGymTask  # noqa: E402
from posttrain.train.rl import train  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reasoning_gym.toml"
# sums of two one-digit numbers: about 200 distinct questions, so train and test draws would meet if the split
# did not keep them apart
SMALL = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _cfg(params: str):
    return load_config(None, ['task.name="reasoning_gym"', f"task.params={params}"])


def test_registered_and_checked_at_config_validation_without_building_a_dataset():
    assert TASKS["reasoning_gym"] is ReasoningGymTask
    built = rg._build.cache_info().misses
    cfg = _cfg('{dataset="leg_counting", max_animals=3, size=50}')
    assert cfg.task.params == {"dataset": "leg_counting", "max_animals": 3, "size": 50}
    mix = _cfg('{datasets={leg_counting=1, chain_sum={weight=2.5, max_terms=3}}, size=100}')
    assert mix.task.params["datasets"] == {"leg_counting": 1, "chain_sum": {"weight": 2.5, "max_terms": 3}}
    assert rg._build.cache_info().misses == built  # validation read the config dataclasses, built nothing


@pytest.mark.parametrize(("params", "message"), [
    ('{dataset="leg_countin"}', "task.params.dataset: unknown reasoning-gym dataset 'leg_countin'; did you mean "
                                "'leg_counting'?"),
    ('{datasets={chain_sums=1}}', "did you mean 'chain_sum'?"),
    ('{dataset="leg_counting", max_animal=3}', "task.params.max_animal: unknown leg_counting config key "
                                               "'max_animal'; did you mean 'max_animals'?"),
    ('{dataset="leg_counting", min_animals=5, max_animals=2}', "max_animals must be >= min_animals"),
    ("{}", "set one of dataset = NAME"),
    ('{dataset="leg_counting", datasets={chain_sum=1}}', "got both"),
    ('{datasets={chain_sum=0}}', "task.params.datasets.chain_sum: the weight must be a number > 0"),
    ('{datasets={chain_sum=1}, max_terms=3}', "put a dataset's settings in its table"),
    ('{datasets={}}', "at least one dataset"),
    ('{dataset="composite"}', "unknown reasoning-gym dataset 'composite'"),
    ('{dataset="chain_sum", fallback="last_numbr"}', "did you mean 'last_number'?"),
])
def test_bad_params_are_config_errors_naming_the_key(params, message):
    with pytest.raises(ConfigError, match="task.params") as err:
        _cfg(params)
    assert message in str(err.value)


def test_without_the_package_the_config_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` meets when not installed
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install 'posttrain\[reasoning_gym\]'"):
        _cfg('{dataset="leg_counting"}')


def test_prompt_answer_and_demonstration_come_from_the_entry():
    task = make_task("reasoning_gym", **SMALL)
    ex = task.examples("train", 1, seed=0)[0]
    entry = ex.fields["entry"]
    assert ex.prompt == entry["question"].rstrip() + "\n\n" + INSTRUCTION
    assert ex.answer == entry["answer"] and ex.demonstration == f"<answer>{entry['answer']}</answer>"
    assert ex.fields["source_dataset"] == "chain_sum"
    # the answer is the sum the question states: "... 4 + 7 =" -> 11
    expression = entry["question"].rstrip().rsplit(":", 1)[1].strip().rstrip("=")
    assert int(ex.answer) == eval(expression)  # noqa: S307 - two one-digit numbers and + / -
    bare = make_task("reasoning_gym", **SMALL, instruction="").examples("train", 1, seed=0)[0]
    assert bare.prompt == entry["question"]


def test_verify_is_the_datasets_scorer_on_the_tagged_answer():
    task = make_task("reasoning_gym", **SMALL)
    ex = task.examples("test", 1, seed=0)[0]
    right, wrong = ex.answer, str(int(ex.answer) + 1)
    assert task.verify(ex.demonstration, ex) == 1.0
    assert task.verify(f"so {wrong}, no: <answer>{wrong}</answer> then <answer> {right} </answer>", ex) == 1.0  # last
    assert task.verify(f"<answer>{wrong}</answer>", ex) == 0.0
    assert task.verify(f"The answer is {right}.", ex) == 0.0  # reasoning-gym's rule: no tags, no answer
    # a dataset with partial credit keeps it: spell_backward's scorer gives the share of letters in place
    words = make_task("reasoning_gym", dataset="spell_backward", size=50)
    w = words.examples("train", 1, seed=0)[0]
    n = len(w.answer)
    assert words.verify(f"<answer>{w.answer}</answer>", w) == 1.0
    assert words.verify(f"<answer>{w.answer[:-1]}#</answer>", w) == pytest.approx((n - 1) / n)


def test_fallback_reads_untagged_completions_and_tags_still_win():
    numbers = make_task("reasoning_gym", **SMALL, fallback="last_number")
    ex = numbers.examples("test", 1, seed=0)[0]
    right, wrong = ex.answer, str(int(ex.answer) + 1)
    assert numbers.extract(f"3 + 4 = 7\nso it is {right}.") == right
    assert numbers.verify(f"The final answer is {right}.", ex) == 1.0
    assert numbers.verify(f"<answer>{wrong}</answer> {right}", ex) == 0.0  # the tags win
    assert numbers.extract("no number here") is None
    lines = make_task("reasoning_gym", **SMALL, fallback="last_line")
    assert lines.extract("thinking\n  result: 12 \n\n") == "result: 12"


def test_deterministic_per_seed_and_prefix_stable():
    task = make_task("reasoning_gym", dataset="leg_counting", size=1000)
    a = task.examples("train", 40, seed=3)
    assert [e.prompt for e in a] == [e.prompt for e in task.examples("train", 40, seed=3)]
    assert [e.prompt for e in task.examples("train", 15, seed=3)] == [e.prompt for e in a[:15]]
    assert [e.prompt for e in task.examples("train", 40, seed=4)] != [e.prompt for e in a]
    # the remembered split of each item seen only skips regenerating rejected items: the same draws come out
    warm = make_task("reasoning_gym", dataset="leg_counting", size=1000)
    warm.examples("test", 100, seed=3)
    assert [e.prompt for e in warm.examples("train", 40, seed=3)] == [e.prompt for e in a]


def test_list_settings_reach_the_dataset_as_its_tuples():
    # basic_arithmetic's operators default to a tuple; TOML gives a list
    cfg = _cfg('{dataset="basic_arithmetic", operators=["+"], allow_parentheses=false, allow_negation=false}')
    task = make_task("reasoning_gym", **cfg.task.params)
    assert task.dataset.config.operators == ("+",)
    questions = [e.fields["entry"]["question"] for e in task.examples("train", 20, seed=0)]
    assert all("+" in q and not {"-", "*", "/"} & set(q) for q in questions)


def test_held_out_questions_never_occur_in_training():
    # the split is the question's: every item of the pool, under any run seed, falls on the side its text says
    task = make_task("reasoning_gym", **SMALL, size=2000)
    train = [e for seed in (0, 1) for e in task.examples("train", 1500, seed=seed)]
    test = [e for seed in (0, 1) for e in task.examples("test", 200, seed=seed)]
    questions = {split: {e.fields["entry"]["question"] for e in exs} for split, exs in (("train", train),
                                                                                       ("test", test))}
    assert not questions["train"] & questions["test"]
    assert all(split_of(f"reasoning_gym:{q}") == s for s, qs in questions.items() for q in qs)
    # the pool repeats questions (2000 items, ~200 sums): the split holds them apart, not luck
    assert len(questions["train"]) + len(questions["test"]) < 400
    assert len(questions["test"]) >= 5


def test_a_split_the_pool_leaves_empty_says_to_raise_size():
    task = make_task("reasoning_gym", dataset="leg_counting", size=1)
    question = task.dataset[0]["question"]
    empty = "train" if split_of(f"reasoning_gym:{question}") == "test" else "test"
    with pytest.raises(ValueError, match="set task.params.size higher"):
        task.examples(empty, 1, seed=0)


def test_a_mix_draws_by_weight_and_scores_each_entry_with_its_own_dataset():
    task = make_task("reasoning_gym", datasets={"chain_sum": 3, "spell_backward": {"weight": 1, "max_word_len": 5}},
                     size=4000)
    exs = task.examples("train", 400, seed=0)
    counts = Counter(e.fields["source_dataset"] for e in exs)
    assert set(counts) == {"chain_sum", "spell_backward"}
    assert 0.65 < counts["chain_sum"] / len(exs) < 0.85  # weights 3 : 1
    assert all(len(e.answer) <= 5 for e in exs if e.fields["source_dataset"] == "spell_backward")
    assert all(task.verify(e.demonstration, e) == 1.0 for e in exs[:50])


@pytest.mark.parametrize("dataset", ["spell_backward", "string_manipulation"])
def test_pickles_as_its_params_for_the_reward_workers(dataset):
    # spell_backward holds a word list (1.6 MB pickled), string_manipulation a lambda (no pickle at all): the
    # task crosses to the reward workers with every call, as its params
    task = make_task("reasoning_gym", dataset=dataset, size=50)
    ex = task.examples("train", 1, seed=0)[0]
    data = pickle.dumps(task)
    assert len(data) < 1000
    back = pickle.loads(data)
    assert back.params == task.params and back.verify(ex.demonstration, ex) == 1.0


def test_recipe_trains_two_steps_on_the_tiny_model(tmp_path, quiet):
    cfg = load_config(RECIPE, [
        f'out="{tmp_path / "run"}"', 'model.path="tiny"', "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64", "model.tiny.num_layers=1", "model.tiny.max_positions=192", "train.steps=2",
        "rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "eval.prompts=4", "checkpoint.every=0",
        "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
    ])
    summary = train(cfg, console=quiet)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/nonfinite"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert all(r["reward/task/errors"] == 0 and r["reward/task/timeouts"] == 0 for r in rows)  # scored in workers
