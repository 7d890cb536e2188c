"""A*-PO's offline V* stage (posttrain/trainers/astar_values.py, the file in posttrain/produce/ref_values.py): the
command's file holds the rewards the run's lazy reference sampler draws, its V* is the paper's formula, a run
reads it instead of sampling, filter_unsolved drops exactly the all-failed prompts, and bad files are refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import advantages
from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.produce.ref_values import value_row
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rollout import HFEngine
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example
from posttrain.train import rl
from posttrain.trainers.astar_values import run_astar_values

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "a_star_po.toml"
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0",
         "eval.every=0", "eval.prompts=4"]


def _digit_share(prompt, completion, **_):
    # a graded stand-in reward: the untrained tiny model's responses differ in it, so V* is not 0
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


@pytest.fixture
def astar_cfg(tmp_path, monkeypatch):
    """The A*-PO recipe, 2 steps of 4 prompts (8 prompts met), scored by the graded stand-in reward."""
    monkeypatch.setitem(REWARDS._entries, "test_digit_share", _digit_share)

    def make(*overrides):
        return load_config(RECIPE, [f'out="{tmp_path / "run"}"', *QUIET, "train.steps=2", "rollout.prompts_per_step=4",
                                    'reward=[{name="test_digit_share"}]', *overrides])

    return make


@pytest.fixture
def seen(monkeypatch):
    """Every step's (task, batch, prepared) as the loop's step saw and made them."""
    out = []
    real = rl._step

    def spy(rp, state, console):
        metrics, batch, prep = real(rp, state, console)
        out.append((rp.produce.task, batch, prep))
        return metrics, batch, prep

    monkeypatch.setattr(rl, "_step", spy)
    return out


@pytest.fixture
def seeds(monkeypatch):
    """The seed of every call of the public engine's generate (policy, reference and evaluation alike)."""
    out = []
    real = HFEngine.generate

    def counted(self, prompts, sampling, seed=None, interrupt=None):
        out.append(seed)
        return real(self, prompts, sampling, seed=seed, interrupt=interrupt)

    monkeypatch.setattr(HFEngine, "generate", counted)
    return out


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_v_star_is_the_papers_soft_maximum_by_hand():
    # references [1, 0, 0, 1], beta1 = 0.5: exp(1 / 0.5) = e^2 = 7.389056, mean (2 * 7.389056 + 2 * 1) / 4 = 4.194528,
    # log 4.194528 = 1.433780, times 0.5: V* = 0.716890; beta1 = 0: the plain mean 0.5
    ref = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert advantages.optimal_value(ref, beta1=0.5).item() == pytest.approx(0.716890, abs=1e-6)
    assert advantages.optimal_value(ref, beta1=0.0).item() == 0.5
    row = value_row(Example("12+34=", "64", "64", {"id": 7}), ref, torch.tensor([False, True, False, False]), 0.5)
    assert row == {"prompt": "12+34=", "id": 7, "rewards": [1.0, 0.0, 0.0, 1.0], "v_star": pytest.approx(0.716890),
                   "beta1": 0.5, "all_failed": False}  # one sample verified correct
    # equal rewards c: beta1 log mean exp(c / beta1) = c, whatever beta1; no verdicts: failed = no reward > 0
    flat = value_row(Example("1+1=", "2", "2"), torch.full((4,), -0.5), None, 0.5)
    assert flat["v_star"] == pytest.approx(-0.5) and flat["all_failed"] and "id" not in flat


def test_the_file_holds_exactly_the_rewards_the_run_samples(astar_cfg, seen, tmp_path, quiet):
    cfg = astar_cfg()
    out = tmp_path / "values.jsonl"
    summary = run_astar_values(cfg, out=str(out), console=quiet)
    rows = _rows(out)
    assert summary["prompts"] == len(rows) == 8 and summary["samples"] == 8
    for r in rows:  # V* = beta1 log mean_j exp(r_j / beta1), beta1 = 0.5 (the recipe's)
        assert len(r["rewards"]) == 8 and r["beta1"] == 0.5
        assert r["v_star"] == pytest.approx(0.5 * math.log(sum(math.exp(x / 0.5) for x in r["rewards"]) / 8))
    assert summary["v_star_mean"] == pytest.approx(sum(r["v_star"] for r in rows) / 8)
    assert len({v for r in rows for v in r["rewards"]}) > 1  # graded rewards, not all equal
    file = {r["prompt"]: torch.tensor(r["rewards"]) for r in rows}
    rl.train(cfg, console=quiet)  # the same recipe, no file: the lazy sampler of the loop
    met = [ex.prompt for _, batch, _ in seen for ex in batch.examples]
    assert set(met) == set(file)  # the command took the prompts the run meets
    for _, batch, prep in seen:
        for ex, refs in zip(batch.examples, prep.inputs["reference_rewards"], strict=True):
            assert torch.equal(refs, file[ex.prompt])  # exact: the same draws, the same scores


def test_a_run_reads_the_file_and_samples_only_the_prompts_it_lacks(astar_cfg, seen, seeds, tmp_path, quiet):
    out = tmp_path / "values.jsonl"
    run_astar_values(astar_cfg(), out=str(out), limit=4, console=quiet)  # the first step's 4 prompts only
    rows = _rows(out)
    for r in rows:  # edited: every reference reward 0.25, so V* = 0.25 and A = r - 0.25 for these prompts
        r["rewards"] = [0.25] * 8
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    listed = {r["prompt"] for r in rows}
    seeds.clear()
    rl.train(astar_cfg(f'algorithm.reference_values="{out}"'), console=quiet)
    met = {ex.prompt for _, batch, _ in seen for ex in batch.examples}
    assert listed < met and len(met) == 8
    reference_draws = [s for s in seeds if s in {derive_seed(0, "reference", p): p for p in met}]
    lacked = {derive_seed(0, "reference", p) for p in met - listed}
    assert sorted(reference_draws) == sorted(lacked)  # one draw per prompt the file lacks, none for the others
    for _, batch, prep in seen:
        for i, ex in enumerate(batch.examples):
            if ex.prompt in listed:
                assert torch.equal(prep.inputs["reference_rewards"][i], torch.full((8,), 0.25))
                torch.testing.assert_close(prep.adv[i], batch.rewards_PG[i] - 0.25)


def _write_dataset(path, n):
    with open(path, "w") as f:  # GSM8K records: "a+b=" answered after "####"
        for i in range(n):
            a, b = i % 10, i // 10
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": f"{a + b}\n#### {a + b}"}) + "\n")


def test_filter_unsolved_drops_exactly_the_all_failed_prompts(tmp_path, seen, quiet):
    data = tmp_path / "train.jsonl"
    _write_dataset(data, 24)
    out = tmp_path / "values.jsonl"
    settings = [
        f'out="{tmp_path / "run"}"', *QUIET, "train.steps=1", "rollout.prompts_per_step=4", "rollout.max_new_tokens=8",
        'task.name="dataset"', "task.params={}", f'task.dataset={{path="{data}", preset="gsm8k", test_fraction=0.2}}',
        "model.tiny={hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_positions=48}",
        'reward=[{name="math"}]', "algorithm.advantage_params={beta1=0.5, samples=4}",
    ]
    summary = run_astar_values(load_config(RECIPE, settings), out=str(out), console=quiet)
    rows = _rows(out)
    pool = {r["prompt"] for r in rows}  # the whole training pool, once each
    assert summary["prompts"] == len(pool) == len(rows) > 12
    for i, r in enumerate(rows):  # edited verdicts: every third prompt's samples all failed, the others not
        r["all_failed"] = i % 3 == 0
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    unsolved = {r["prompt"] for r in rows if r["all_failed"]}
    rl.train(load_config(RECIPE, [*settings, f'algorithm.reference_values="{out}"', "algorithm.filter_unsolved=true"]),
             console=quiet)
    task, batch, _ = seen[0]
    assert {ex.prompt for ex in task.pools["train"]} == pool - unsolved
    assert not {ex.prompt for ex in batch.examples} & unsolved


def test_bad_or_stale_files_and_settings_are_clear_config_errors(astar_cfg, tmp_path, quiet):
    out = tmp_path / "values.jsonl"
    out.write_text(json.dumps({"prompt": "12+34=", "rewards": [0.0] * 8, "all_failed": True}) + "\n")
    stale = astar_cfg(f'algorithm.reference_values="{out}"', "algorithm.advantage_params={beta1=0.5, samples=4}")
    with pytest.raises(ConfigError, match=r"algorithm.reference_values: .* line 1 holds 8 .* this run samples 4 "
                                          r".*stale.*posttrain astar-values"):
        rl.train(stale, console=quiet)
    assert not (tmp_path / "run").exists()  # refused before the run directory or any model
    out.write_text('{"prompt": "12+34=", "rewards": [0.0, "x"]}\n')
    with pytest.raises(ConfigError, match="line 1: 'rewards' must be a list of finite numbers"):
        rl.train(astar_cfg(f'algorithm.reference_values="{out}"'), console=quiet)
    out.write_text("not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        rl.train(astar_cfg(f'algorithm.reference_values="{out}"'), console=quiet)
    with pytest.raises(ConfigError, match="no file"):
        rl.train(astar_cfg(f'algorithm.reference_values="{tmp_path / "missing.jsonl"}"'), console=quiet)
    with pytest.raises(ConfigError, match="filter_unsolved needs algorithm.reference_values"):
        astar_cfg("algorithm.filter_unsolved=true")
    with pytest.raises(ConfigError, match="filter_unsolved drops prompts from a dataset"):
        astar_cfg(f'algorithm.reference_values="{out}"', "algorithm.filter_unsolved=true")
    with pytest.raises(ConfigError, match="reads no reference rewards"):
        astar_cfg(f'algorithm.reference_values="{out}"', 'algorithm.advantage="grpo"', 'algorithm.loss="ppo_clip"',
                  "algorithm.advantage_params={}", "algorithm.loss_params={}")


def test_the_command_line_writes_the_file_and_refuses_a_recipe_without_reference_samples(tmp_path, capsys):
    out = tmp_path / "v.jsonl"
    args = [f'out="{tmp_path / "run"}"', "log.progress=false", "algorithm.advantage_params={beta1=0.0, samples=2}"]
    assert main(["astar-values", str(RECIPE), "--out", str(out), "--limit", "3", *args]) == 0
    rows = _rows(out)
    assert len(rows) == 3 and all(len(r["rewards"]) == 2 for r in rows)
    assert all(r["v_star"] == pytest.approx(sum(r["rewards"]) / 2) for r in rows)  # beta1 = 0: the mean
    text = capsys.readouterr().out
    assert "mean V*" in text and "all failed" in text and f'algorithm.reference_values="{out}"' in text
    tiny = RECIPE.parent / "tiny.toml"
    assert main(["astar-values", str(tiny), "--out", str(out), *args[:2]]) == 2
    assert "samples no reference responses" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["astar-values", str(RECIPE), "--limit", "0"])
