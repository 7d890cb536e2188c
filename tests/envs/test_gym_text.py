"""gym_text: a user's gymnasium-style text environment by import path (posttrain/envs/gym_text.py), played by
hand and through the multi-turn driver, hostile environments included.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from posttrain.envs import make_env
from posttrain.errors import ConfigError
from posttrain.models.tiny import PRINTABLE, build_char_tokenizer
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.rollout.multiturn import Limits, run_episodes
from posttrain.tasks.base import Example

TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{{ m.content }}{{ eos_token }}{% else %}"
            "<u>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


class Counter:
    """Count up to a seeded target with ``+`` and submit with ``=``; ``mode`` makes it misbehave."""

    def __init__(self, mode: str = "good", limit: int = 8) -> None:
        self.mode, self.limit = mode, limit

    def reset(self, seed: int):
        self.target, self.count, self.steps = random.Random(seed).randint(1, 5), 0, 0
        return (3 if self.mode == "int_reset" else f"reach {self.target}"), {}

    def step(self, action: str):
        self.steps += 1
        if self.mode == "raises":
            raise ZeroDivisionError("boom")
        if self.mode == "int_obs":
            return 42, 0.0, False, False, {}
        if self.mode == "nan":
            return "x", math.nan, False, False, {}
        if self.mode == "forever":
            return "again", 0.0, False, False, {}
        truncated = self.steps >= self.limit
        if action.strip() == "+":
            self.count += 1
            return f"at {self.count}", 0.0, False, truncated, {}
        if action.strip() == "=":
            return "", float(self.count == self.target), True, False, {"note": "text is dropped"}
        return "use + or =", -0.1, False, truncated, {"format_errors": 1}


def make_counter(**kwargs) -> Counter:
    return Counter(**kwargs)


MAKE = f"{__name__}:make_counter"


def test_a_game_is_won_and_the_rewards_add_up():
    env = make_env("gym_text", {"make": MAKE})
    assert env.max_turns == 16
    ex = env.examples("train", 1, 0)[0]
    target = random.Random(ex.fields["seed"]).randint(1, 5)
    ep = env.start(ex)
    assert ep.reset() == [{"role": "user", "content": f"reach {target}"}] and ex.prompt == f"reach {target}"
    bad = ep.step("plus")
    assert (bad.messages[0]["content"], bad.reward, bad.done, dict(bad.info)) == (
        "use + or =", -0.1, False, {"format_errors": 1.0, "success": 0.0})
    key = ep.state_key()
    for k in range(target):
        assert ep.step("+").messages[0]["content"] == f"at {k + 1}"
    assert ep.state_key() != key
    end = ep.step("=")
    # success: terminated with a summed reward -0.1 + 1.0 = 0.9 < success_reward 1.0 -> 0; its own reward is 1
    assert (end.messages, end.reward, end.done, dict(end.info)) == ((), 1.0, True, {"success": 0.0})
    lenient = make_env("gym_text", {"make": MAKE, "success_reward": 0.5}).start(ex)
    lenient.reset()
    lenient.step("plus")
    for _ in range(target):
        lenient.step("+")
    assert lenient.step("=").info == {"success": 1.0}


def test_truncation_ends_the_episode_unsolved():
    ep = make_env("gym_text", {"make": MAKE, "limit": 2}).start(Example("", "", "", {"seed": 1}))
    ep.reset()
    assert not ep.step("+").done
    last = ep.step("+")
    assert last.done and last.info == {"success": 0.0}


def test_examples_are_seeded_and_the_splits_share_no_seed():
    env = make_env("gym_text", {"make": MAKE})
    a = env.examples("train", 20, 3)
    assert a == env.examples("train", 20, 3) and a[:5] == env.examples("train", 5, 3)
    assert a != env.examples("train", 20, 4)
    train = {ex.fields["seed"] for ex in env.examples("train", 300, 0)}
    test = {ex.fields["seed"] for ex in env.examples("test", 30, 0)}
    assert train and test and not train & test
    assert set("".join(ex.prompt for ex in a)) <= set(env.alphabet)


def test_bad_paths_and_broken_resets_are_config_errors():
    with pytest.raises(ConfigError, match="expected 'module:function'"):
        make_env("gym_text", {"make": "make_counter"})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        make_env("gym_text", {"make": "no_such_module_xyz:make"})
    with pytest.raises(ConfigError, match="has no 'nothing_here'"):
        make_env("gym_text", {"make": f"{__name__}:nothing_here"})
    with pytest.raises(ConfigError, match="does not reset: TypeError: .*observation of type int, expected str"):
        make_env("gym_text", {"make": MAKE, "mode": "int_reset"})
    with pytest.raises(ConfigError, match="does not reset: TypeError: .*unexpected keyword argument 'colour'"):
        make_env("gym_text", {"make": MAKE, "colour": 1})


class ScriptedEngine:
    """Returns the same scripted turn for every row of every round."""

    def __init__(self, tokenizer, action: str) -> None:
        self.tok, self.action, self.pad_id, self.version = tokenizer, action, tokenizer.pad_token_id, 0

    def generate(self, prompts, sampling, seed=None):
        row = self.tok(self.action, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = torch.tensor([row] * len(prompts))
        mask = torch.ones_like(ids, dtype=torch.float)
        return Rollout.single_turn(prompts, ids, mask, -0.5 * mask, torch.ones(len(prompts), dtype=torch.bool),
                                   [""] * len(prompts), 1, self.version)


def test_hostile_environments_lose_their_episode_not_the_run():
    tok = build_char_tokenizer(PRINTABLE + "\n")
    tok.chat_template = TEMPLATE
    delta = ChatDelta(tok)
    modes = ["good", "raises", "int_obs", "nan", "forever"]
    episodes = [make_env("gym_text", {"make": MAKE, "mode": m}).start(Example("", "", "", {"seed": 0}))
                for m in modes]
    first = [ep.reset() for ep in episodes]
    prompts = [delta.prompt_ids(f) for f in first]
    recs = run_episodes(ScriptedEngine(tok, "+"), delta, episodes, prompts, first, SamplingParams(max_new_tokens=4),
                        Limits(max_turns=3, max_tokens=200, step_timeout_s=5.0), lambda r: r)
    ends = {m: (r.end, r.reward, len(r.turns)) for m, r in zip(modes, recs, strict=True)}
    assert ends == {"good": ("max_turns", 0.0, 3), "raises": ("error", None, 1), "int_obs": ("error", None, 1),
                    "nan": ("error", None, 1), "forever": ("max_turns", 0.0, 3)}
    errors = {m: r.error for m, r in zip(modes, recs, strict=True) if r.error}
    assert errors["raises"] == "error: ZeroDivisionError: boom"
    assert "observation of type int, expected str" in errors["int_obs"]
    assert "reward nan, expected a finite number" in errors["nan"]


def test_a_recipe_brings_its_environment_in_a_plugin_file(tmp_path):
    from posttrain.config import load_config
    from posttrain.run.setup import build_task

    (tmp_path / "gym_text_plugin_env.py").write_text(
        "class Echo:\n"
        "    def reset(self, seed):\n        self.n = seed % 7\n        return f'say {self.n}', {}\n"
        "    def step(self, action):\n        return '', float(action.strip() == str(self.n)), True, False, {}\n\n"
        "def make():\n    return Echo()\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text('plugins = ["gym_text_plugin_env.py"]\n[task]\nname = "env"\n[task.env]\nname = "gym_text"\n'
                      'params = { make = "gym_text_plugin_env:make", max_turns = 1 }\n')
    task = build_task(load_config(recipe, [f'out="{tmp_path / "run"}"']))
    ex = task.examples("test", 3, 0)[0]
    episode, first = task.start(ex)
    n = ex.fields["seed"] % 7
    assert first == [{"role": "user", "content": f"say {n}"}] and task.env.max_turns == 1
    assert episode.step(str(n)).info == {"success": 1.0}
