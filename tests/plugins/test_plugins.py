"""Plugins named by a recipe (posttrain/plugins.py): imported before validation and in every process that
looks their entries up, listed by ``posttrain algorithms``, and refused with the file and line when broken.

The command-line tests run ``python -m posttrain.cli`` in a subprocess, as a user would; the in-process ones
restore every registry they touch (``restored`` below), so no user entry leaks into another test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain import plugins
from posttrain.algorithms import advantages, losses, shaping
from posttrain.config import ConfigError, load_config
from posttrain.envs import ENVS
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
FAST = ["log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0"]

# a reward that records the process that ran it, so the test can tell the reward workers scored it
REWARD_PLUGIN = '''
import os
import posttrain

@posttrain.register_reward("brevity")
def brevity(prompt, completion, *, pid_file, **fields):
    """Shorter completions score higher (a user's reward, from a file beside the recipe)."""
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\\n")
    return 1.0 / (1 + len(completion))
'''


@pytest.fixture
def restored(monkeypatch):
    """Every registry a plugin may write to, and the plugin cache, put back as they were after the test."""
    for reg in (REWARDS, ENVS, advantages.REGISTRY, losses.REGISTRY, shaping.REGISTRY):
        for attr in ("_entries", "_traits", "_origins"):
            monkeypatch.setattr(reg, attr, dict(getattr(reg, attr)))
    monkeypatch.setattr(plugins, "_LOADED", {})
    monkeypatch.setattr(plugins, "TASK_ORIGINS", {})
    saved_tasks = dict(TASKS)
    saved_modules = set(sys.modules)
    yield
    TASKS.clear()
    TASKS.update(saved_tasks)
    for name in set(sys.modules) - saved_modules:
        if name.startswith(("posttrain_plugin_", "user_")):
            sys.modules.pop(name)


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float, int]:
    """Run ``posttrain ARGS`` in a fresh interpreter; (result, seconds, its pid)."""
    env = {**os.environ, "COLUMNS": "250", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), time.perf_counter() - t0, proc.pid


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_file_beside_a_recipe_trains_from_the_cli_with_reward_workers_and_resumes(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_rewards.py").write_text(REWARD_PLUGIN)
    pid_file = tmp_path / "pids.txt"
    (project / "recipe.toml").write_text(
        f'base = "{TINY}"\nplugins = ["my_rewards.py"]\n\n[[reward]]\nname = "brevity"\n'
        f'params = {{ pid_file = "{pid_file}" }}\n'
    )
    run = tmp_path / "run"
    done, _, pid = _cli(["train", "recipe.toml", "--out", str(run), "train.steps=2", "scoring.workers=2", *FAST],
                        cwd=project)
    assert done.returncode == 0, done.stdout
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["reward/brevity/errors"] == 0 and 0 < rows[-1]["reward/brevity/mean"] <= 1
    scorers = {int(x) for x in pid_file.read_text().split()}
    assert scorers and pid not in scorers  # scored in the forked reward workers, not in the trainer
    saved = (run / "config.toml").read_text()
    assert f'plugins = ["{project / "my_rewards.py"}"]' in saved  # absolute: --resume finds it from anywhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed, _, _ = _cli(["train", "--out", str(run), "--resume", "train.steps=3", *FAST], cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stdout
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]


def test_compares_parallel_runs_find_the_plugin_of_their_recipe(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_PLUGIN)
    (tmp_path / "recipe.toml").write_text(
        f'base = "{TINY}"\nplugins = ["my_rewards.py"]\n\n[[reward]]\nname = "brevity"\n'
        f'params = {{ pid_file = "{tmp_path / "pids.txt"}" }}\n')
    done, _, _ = _cli(["compare", "recipe.toml", "train.steps=1", "scoring.workers=1", *FAST, "--seeds", "0", "1",
                       "--parallel", "2", "--out", "cmp", "--no-report"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    for seed in (0, 1):
        rows = _metrics(tmp_path / "cmp" / "recipe" / f"seed{seed}")
        assert [r["step"] for r in rows] == [1] and rows[0]["reward/brevity/errors"] == 0


BROKEN = {  # plugin source, the line the error must name, a phrase of the message
    "syntax": ("import posttrain\n\ndef reward(prompt, completion:\n    return 1.0\n", 3, "SyntaxError"),
    "raises": ("import posttrain\nLIMIT = 3\nraise RuntimeError('no API key for the judge')\n", 3,
               "RuntimeError: no API key for the judge"),
    "clash": ("import posttrain\n\n\n@posttrain.register_reward('math')\ndef mine(prompt, completion, **_):\n"
              "    return 0.0\n", 4, "clashes with the built-in reward 'math'"),
    "deep": ("import json\n\n\ndef load():\n    return json.loads('{not json')\n\n\nTABLE = load()\n", 5,
             "JSONDecodeError"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_plugin_fails_fast_with_its_file_and_line_and_no_traceback(tmp_path, kind):
    source, line, phrase = BROKEN[kind]
    plugin = tmp_path / f"broken_{kind}.py"
    plugin.write_text(source)
    (tmp_path / "recipe.toml").write_text(f'base = "{TINY}"\nplugins = ["{plugin.name}"]\n')
    done, seconds, _ = _cli(["train", "recipe.toml", "--out", str(tmp_path / "run")], cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout
    assert seconds < 10, f"took {seconds:.1f} s"
    assert f"{plugin}:{line}:" in done.stdout and phrase in done.stdout, done.stdout
    assert "Traceback" not in done.stdout
    assert not (tmp_path / "run").exists()  # refused before the run (or a model) started


def test_a_missing_plugin_file_or_module_is_a_config_error_naming_it(tmp_path, restored):
    (tmp_path / "recipe.toml").write_text('plugins = ["nowhere.py"]\n')
    with pytest.raises(ConfigError, match=r"plugins\[0\]: plugin file 'nowhere.py' not found .*nowhere.py"):
        load_config(tmp_path / "recipe.toml")
    with pytest.raises(ConfigError, match="plugin 'no_such_pkg.rewards': no module named 'no_such_pkg'"):
        load_config(None, ['plugins=["no_such_pkg.rewards"]'])
    with pytest.raises(ConfigError, match="plugins: expected a list"):
        load_config(None, ['plugins="x.py"'])


def test_plugins_resolve_against_their_recipe_and_a_base_recipe_keeps_its_own(tmp_path, restored):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "user_base_plugin.py").write_text(
        "import posttrain\n\n@posttrain.register_reward('user_base_reward')\n"
        "def r(prompt, completion, **_):\n    return 0.0\n")
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "user_top_plugin.py").write_text(
        "import posttrain\n\n@posttrain.register_shaper('user_clip')\n"
        "def clip(rewards, *, high=1.0):\n    '''Clip rewards from above.'''\n    return rewards.clamp(max=high)\n")
    (tmp_path / "base" / "base.toml").write_text('plugins = ["user_base_plugin.py"]\n[[reward]]\n'
                                                 'name = "user_base_reward"\n')
    (tmp_path / "top" / "top.toml").write_text('base = "../base/base.toml"\nplugins = ["user_top_plugin.py"]\n'
                                               '[algorithm]\nshapers = [{ name = "user_clip" }]\n')
    cfg = load_config(tmp_path / "top" / "top.toml")
    assert cfg.plugins == [str(tmp_path / "base" / "user_base_plugin.py"), str(tmp_path / "top" / "user_top_plugin.py")]
    assert REWARDS.origin("user_base_reward") == str(tmp_path / "base" / "user_base_plugin.py")
    assert shaping.REGISTRY.origin("user_clip") == str(tmp_path / "top" / "user_top_plugin.py")
    assert REWARDS.origin("math") is None
    assert load_config(tmp_path / "top" / "top.toml").plugins == cfg.plugins  # a second import is a no-op


def test_every_registry_has_a_public_decorator_and_user_entries_are_listed(tmp_path, restored, monkeypatch, capsys):
    from posttrain.cli import main

    plugin = tmp_path / "user_everything.py"
    plugin.write_text('''
import posttrain
from posttrain.tasks import ArithmeticTask


@posttrain.register_advantage("user_mean_baseline")
def mean_baseline(rewards):
    """Reward minus the group mean (a user's estimator)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@posttrain.register_loss("user_pg")
def pg(logprobs, old_logprobs, advantages, mask):
    """Plain policy gradient (a user's loss)."""
    return -advantages * logprobs


@posttrain.register_task("user_addition")
class Addition(ArithmeticTask):
    """Addition, as a user's task."""


@posttrain.register_env("user_guess")
class Guess:
    """A user's environment."""
''')
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["algorithms", "--plugin", str(plugin)]) == 0
    table = capsys.readouterr().out
    for kind, name in (("advantage", "user_mean_baseline"), ("loss", "user_pg"), ("task", "user_addition"),
                       ("env", "user_guess")):
        row = next(line for line in table.splitlines() if f" {name} " in line)
        assert kind in row and f"plugin {plugin}" in row, row
    assert "built-in" in next(line for line in table.splitlines() if " grpo " in line)
    assert main(["algorithms", "--recipe", str(tmp_path / "none.toml")]) == 2
    assert "recipe" in capsys.readouterr().out
    cfg = load_config(TINY, [f'plugins=["{plugin}"]', "algorithm.advantage=user_mean_baseline",
                             "algorithm.loss=user_pg", "task.name=user_addition"])
    assert (cfg.algorithm.advantage, cfg.algorithm.loss, cfg.task.name) == ("user_mean_baseline", "user_pg",
                                                                             "user_addition")
    assert TASKS["user_addition"].name == "user_addition"


def test_a_clash_between_two_plugins_names_both(tmp_path, restored):
    for name in ("user_first", "user_second"):
        (tmp_path / f"{name}.py").write_text(
            "import posttrain\n\n@posttrain.register_reward('shared_name')\ndef r(prompt, completion, **_):\n"
            "    return 0.0\n")
    load_config(None, [f'plugins=["{tmp_path / "user_first.py"}"]'])
    with pytest.raises(ConfigError) as err:
        load_config(None, [f'plugins=["{tmp_path / "user_second.py"}"]'])
    message = str(err.value)
    assert f"{tmp_path / 'user_second.py'}:3:" in message
    assert f"clashes with the reward 'shared_name' registered by {tmp_path / 'user_first.py'}" in message
    with pytest.raises(ValueError, match="built in; only a user's entries"):
        REWARDS.unregister("math")


def test_the_learner_ranks_import_the_plugins_of_their_config(tmp_path, restored, quiet):
    """A spawned learner rank (train.processes = 2) looks up a plugin's loss by name in its own process."""
    from posttrain.train.rl import train

    plugin = tmp_path / "user_rank_loss.py"
    plugin.write_text(
        "import posttrain\n\n\n@posttrain.register_loss('user_rank_pg')\n"
        "def pg(logprobs, old_logprobs, advantages, mask):\n    '''Plain policy gradient.'''\n"
        "    return -advantages * logprobs\n")
    cfg = load_config(TINY, [f'plugins=["{plugin}"]', "algorithm.loss=user_rank_pg", "train.processes=2",
                             "train.steps=1", f'out="{tmp_path / "run"}"', "scoring.workers=0", *FAST])
    summary = train(cfg, console=quiet)
    assert summary["steps"] == 1
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_module_plugin_that_failed_halfway_leaves_nothing_registered_and_imports_once_fixed(
        tmp_path, restored, monkeypatch):
    package = tmp_path / "user_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    rewards = package / "rewards.py"
    rewards.write_text("import posttrain\n\n\n@posttrain.register_reward('user_halfway')\n"
                       "def r(prompt, completion, **_):\n    return 1.0\n\n\nimport not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(None, ['plugins=["user_pkg.rewards"]'])
    assert f"{rewards}:9: ModuleNotFoundError: No module named 'not_installed_dependency'" in str(err.value)
    assert "user_halfway" not in REWARDS  # taken out again: a fixed plugin must not clash with its own entry
    rewards.write_text(rewards.read_text().replace("import not_installed_dependency\n", ""))
    cfg = load_config(None, ['plugins=["user_pkg.rewards"]', 'reward=[{name="user_halfway"}]'])
    assert cfg.plugins == ["user_pkg.rewards"] and REWARDS.origin("user_halfway") == "user_pkg.rewards"
