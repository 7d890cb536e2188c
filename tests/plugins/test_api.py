"""The public Python API (posttrain/api.py, exported lazily from ``posttrain``): a fast import, the README's
example run as written, reward callables lent to a run (in-process and in the reward workers), the hostile
ones, and the thin entry points around the trainers.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain
from posttrain.config import ConfigError
from posttrain.rewards import REGISTRY as REWARDS

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
FAST = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_import_posttrain_imports_no_torch_and_exports_the_api():
    code = ("import posttrain, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert callable(posttrain.train) and callable(posttrain.load_config)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        posttrain.nope  # noqa: B018


def test_posttrain_train_is_callable_and_still_the_loops_package():
    import posttrain.train.rl as rl  # an import through the attribute still finds the package

    assert rl.train is not posttrain.train and callable(posttrain.train)
    assert posttrain.train.rl is rl


def test_the_readme_python_example_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    example = readme[readme.index("## A ten-line example"):]
    recipe = re.search(r"```toml\n(.*?)```", example, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", example, re.S).group(1)
    assert "posttrain.train(" in code and 0 < len(code.strip().splitlines()) <= 12
    (tmp_path / "recipe.toml").write_text(recipe)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir, steps = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert int(steps) == 2
    rows = _metrics(tmp_path / run_dir)
    assert [r["step"] for r in rows] == [1, 2] and "reward/brevity/mean" in rows[-1] and "reward/task/mean" in rows[-1]


def brevity(prompt, completion, **fields):
    return 1.0 / (1 + len(completion))


def hostile(prompt, completion, *, answer, **fields):
    """Raises, returns a string, NaN or a number, by the completion's length (every failure mode at once)."""
    kind = len(completion) % 4
    if kind == 0:
        raise RuntimeError("the user's reward fell over")
    if kind == 1:
        return "high"
    if kind == 2:
        return math.nan
    return float(completion.strip() == answer)


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_callables_score_in_process_and_in_the_reward_workers(tmp_path, quiet, workers):
    out = tmp_path / "run"
    summary = posttrain.train(TINY, overrides=[f'out="{out}"', "train.steps=2", f"scoring.workers={workers}", *FAST],
                              rewards=[brevity, (hostile, 0.5)], console=quiet)
    assert summary["run_dir"] == str(out) and summary["steps"] == 2
    last = _metrics(out)[-1]
    assert 0 < last["reward/brevity/mean"] <= 1 and last["reward/brevity/errors"] == 0
    # the hostile reward's raises and strings are errors, its NaNs non-finite; the run went on
    assert last["reward/hostile/errors"] + last["reward/hostile/nonfinite"] > 0
    failures = [json.loads(line) for line in (out / "reward_failures.jsonl").read_text().splitlines()]
    saved = (out / "config.toml").read_text()
    assert 'name = "brevity"' in saved and 'name = "hostile"' in saved and "weight = 0.5" in saved
    assert "brevity" not in REWARDS and "hostile" not in REWARDS  # lent for the call only
    assert {f["reward"] for f in failures} == {"hostile"}  # each failure logged with its sample
    assert {f["status"] for f in failures} <= {"error", "nonfinite"} and all(f["completion"] is not None
                                                                              for f in failures)


def test_bad_reward_arguments_are_config_errors_before_any_run(tmp_path, quiet):
    def math(prompt, completion, **_):  # noqa: ARG001 - its name clashes with the built-in reward
        return 0.0

    base = [f'out="{tmp_path / "run"}"', "train.steps=1", *FAST]
    clash = r"reward 'math' from (tests\.)?plugins\.test_api\.test_bad.*<locals>\.math clashes with the built-in"
    with pytest.raises(ConfigError, match=clash + " reward 'math'"):
        posttrain.train(TINY, overrides=base, rewards=[math], console=quiet)
    with pytest.raises(ConfigError, match=r"rewards\[0\]: expected a named function"):
        posttrain.train(TINY, overrides=base, rewards=[lambda p, c, **_: 0.0], console=quiet)
    with pytest.raises(ConfigError, match=r"rewards\[1\]: the weight .* is a number"):
        posttrain.train(TINY, overrides=base, rewards=[brevity, (brevity, "heavy")], console=quiet)
    with pytest.raises(ConfigError, match="unknown reward 'no_such_reward'"):
        posttrain.train(TINY, overrides=base, rewards=["no_such_reward"], console=quiet)
    assert "brevity" not in REWARDS and not (tmp_path / "run").exists()


def test_load_config_and_the_sft_and_evaluate_entry_points(tmp_path, quiet):
    cfg = posttrain.load_config(TINY, ["train.steps=3"])
    assert isinstance(cfg, posttrain.Config) and cfg.train.steps == 3
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        posttrain.load_config(TINY, ["train.stepz=3"])
    out = tmp_path / "sft"
    summary = posttrain.sft(cfg, overrides=[f'out="{out}"', "sft.steps=2", *FAST], console=quiet)
    assert summary["run_dir"] == str(out) and summary["steps"] == 2
    results = posttrain.evaluate(TINY, model=out, overrides=["eval.prompts=4", "eval.n=2", "scoring.workers=0",
                                                             f'out="{tmp_path / "eval"}"'], console=quiet)
    assert "pass@1" in json.dumps(results) and (tmp_path / "eval" / "eval.json").exists()


def test_the_dpo_entry_point(tmp_path, quiet):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1)[::-1], "rejected": "0"}) + "\n"
                             for a in range(1, 9)))
    out = tmp_path / "dpo"
    summary = posttrain.dpo(TINY, overrides=[f'out="{out}"', "dpo.steps=2", 'dpo.pairs="file"', f'dpo.path="{pairs}"',
                                             "dpo.eval_every=0", *FAST], console=quiet)
    assert summary["run_dir"] == str(out) and [r["step"] for r in _metrics(out)] == [1, 2]


def test_a_registered_reward_passed_as_a_callable_is_used_by_its_name(tmp_path, quiet):
    from posttrain.rewards.format import format_reward

    assert REWARDS.get("format") is format_reward
    overrides = [f'out="{tmp_path / "run"}"', "train.steps=1", "scoring.workers=0", *FAST]
    summary = posttrain.train(TINY, overrides=overrides, rewards=[(format_reward, 0.5), brevity], console=quiet)
    assert 'name = "format"' in (tmp_path / "run" / "config.toml").read_text() and summary["steps"] == 1
    assert "format" in REWARDS and "brevity" not in REWARDS  # the built-in stays; only the lent one goes
