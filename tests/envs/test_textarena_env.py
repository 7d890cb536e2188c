"""textarena: TextArena's single-player games through the episode protocol (posttrain/envs/textarena_env.py),
played with scripted actions, and a tiny training run on one of them.
"""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.envs import make_env
from posttrain.envs.textarena_env import TextArenaEpisode, offline_games
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.chat_delta import ChatDelta
from posttrain.rollout.multiturn import Limits, run_episodes
from posttrain.tasks.base import Example
from posttrain.train import rl

ta = pytest.importorskip("textarena", reason="needs textarena: pip install 'textarena>=0.7.4'")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "textarena_guess.toml"


def _episode(env, seed=0):
    return env.start(Example("", "", "", {"seed": seed}))


def _binary_search(ep, low=1, high=20):
    """Play Guess The Number by bisection on the game's 'higher' / 'lower' replies; the step results."""
    results = []
    while True:
        guess = (low + high) // 2
        res = ep.step(str(guess))  # no brackets: bracket_actions makes it the move [guess]
        results.append(res)
        if res.done:
            return results
        reply = res.messages[0]["content"]
        assert reply == f"The target number is {'higher' if 'higher' in reply else 'lower'}."  # no echo of the move
        low, high = (guess + 1, high) if "higher" in reply else (low, guess - 1)


def test_guess_the_number_is_won_by_bisection():
    env = make_env("textarena", {"game": "GuessTheNumber-v0"})
    assert env.max_turns == 11  # the game's own turn limit (registered with max_turns=10), + 1 (see below)
    ep = _episode(env, seed=3)
    prompt = ep.reset()
    assert len(prompt) == 1 and prompt[0]["role"] == "user"
    assert "guess the number between 1 and 20" in prompt[0]["content"]
    results = _binary_search(ep)
    assert len(results) <= 5  # ceil(log2 20) = 5 guesses always suffice
    *middle, last = results
    assert all(r.reward == 0.0 and r.info == {"format_errors": 0.0, "success": 0.0} for r in middle)
    assert (last.messages, last.reward, last.done, dict(last.info)) == ((), 1.0, True,
                                                                       {"format_errors": 0.0, "success": 1.0})


def test_an_invalid_move_is_a_warning_then_the_end_never_a_crash():
    env = make_env("textarena", {"game": "GuessTheNumber-v0"})
    ep = _episode(env)
    ep.reset()
    first = ep.step("I think it is eleven")  # no [number]: TextArena warns once (error_allowance 1) ...
    assert not first.done and first.info == {"format_errors": 1.0, "success": 0.0}
    assert first.messages[0]["content"].startswith("You attempted an invalid move.")
    second = ep.step("[99]")  # ... and ends the game on the second one in a row (out of range)
    # the game scores an invalid ending by its completion fraction: no guess yet, 0
    assert (second.done, second.reward, dict(second.info)) == (True, 0.0, {"format_errors": 1.0, "success": 0.0})


def test_the_game_turn_limit_ends_with_a_partial_reward():
    env = make_env("textarena", {"game": "GuessTheNumber-v0", "max_turns": 2})
    assert env.max_turns == 3  # TextArena checks the limit before it counts the turn: 2 + 1 guesses
    ep = _episode(env, seed=1)
    ep.reset()
    secret = ep.env.game_number  # the game's hidden number, to pick three wrong guesses
    wrong = [g for g in (1, 20, 2, 19) if g != secret][:3]
    results = [ep.step(str(g)) for g in wrong]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info == {"format_errors": 0.0, "success": 0.0}
    # the game's completion fraction: 1 - |last guess - secret| / (20 - 1)
    assert results[-1].reward == pytest.approx(1 - abs(wrong[2] - secret) / 19)


def test_tower_of_hanoi_is_won_by_the_optimal_moves():
    env = make_env("textarena", {"game": "TowerOfHanoi-v0"})
    ep = _episode(env)
    assert "A: [3, 2, 1]" in ep.reset()[0]["content"]
    moves = ["A C", "A B", "C B", "A C", "B A", "B C", "[A C]"]  # 2**3 - 1 moves; brackets given or not
    results = [ep.step(m) for m in moves]
    assert "C: [1]" in results[0].messages[0]["content"] and "[A C]" not in results[0].messages[0]["content"]
    assert [r.done for r in results] == [False] * 6 + [True]
    assert (results[-1].reward, results[-1].info["success"]) == (1.0, 1.0)
    assert sum(r.info["format_errors"] for r in results) == 0


def test_examples_are_seeded_reproducible_and_the_splits_share_no_seed():
    env = make_env("textarena", {"game": "FrozenLake-v0-random"})
    a = env.examples("train", 40, 5)
    assert a == env.examples("train", 40, 5) and a[:7] == env.examples("train", 7, 5)
    assert a != env.examples("train", 40, 6)
    assert len({ex.prompt for ex in a}) > 1  # the seed draws the board
    train = {ex.fields["seed"] for ex in env.examples("train", 300, 0)}
    test = {ex.fields["seed"] for ex in env.examples("test", 30, 0)}
    assert train and test and not train & test


def test_episodes_are_deterministic_across_threads_and_leave_the_global_generators_alone():
    env = make_env("textarena", {"game": "2048-v0"})
    ex = env.examples("train", 1, 0)[0]
    moves = ["up", "left", "down", "right", "up", "left"]

    def play(out, k):
        ep = env.start(ex)
        out[k] = [ep.reset()[0]["content"]] + [m["content"] for a in moves for m in ep.step(a).messages]

    random.seed(7)
    expected = random.random()
    random.seed(7)
    alone: dict[int, list[str]] = {}
    play(alone, 0)
    assert random.random() == expected  # the game's draws came from the episode's own generator
    together: dict[int, list[str]] = {}
    threads = [threading.Thread(target=play, args=(together, k)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(together[k] == alone[0] for k in range(6))  # tiles spawn the same way in every thread
    assert len(set(alone[0])) > 1  # the board changed


def test_unknown_online_and_broken_games_are_config_errors():
    with pytest.raises(ConfigError, match=r"task.env.params.game: unknown TextArena game 'GuesTheNumber-v0'; "
                                          r"did you mean 'GuessTheNumber-v0'\?"):
        make_env("textarena", {"game": "GuesTheNumber-v0"})
    with pytest.raises(ConfigError, match="'Wordle-v0' is not an offline single-player"):
        make_env("textarena", {"game": "Wordle-v0"})  # downloads an NLTK word list
    with pytest.raises(ConfigError, match="'Chess-v0' is not an offline single-player"):
        make_env("textarena", {"game": "Chess-v0"})  # two players
    with pytest.raises(ConfigError, match="does not start: .*unexpected keyword argument 'colour'"):
        make_env("textarena", {"game": "GuessTheNumber-v0", "colour": "red"})
    assert "Sokoban-v0" in offline_games() and "Hangman-v0" not in offline_games()


def test_a_game_id_is_checked_when_the_recipe_is_validated_before_anything_is_built(monkeypatch):
    from posttrain.config import load_config
    from posttrain.envs import textarena_env

    def no_build(*args, **kwargs):
        raise AssertionError("validation built a game")

    monkeypatch.setattr(textarena_env, "_factory", no_build)
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "textarena_guess.toml"
    with pytest.raises(ValueError, match=r"unknown TextArena game 'GuesTheNumber-v0'; did you mean 'GuessTheNumber-v0"):
        load_config(recipe, ['task.env.params.game="GuesTheNumber-v0"'])
    with pytest.raises(ValueError, match="'Chess-v0' is not an offline single-player"):
        load_config(recipe, ['task.env.params.game="Chess-v0"'])
    with pytest.raises(ValueError, match="a TextArena game id"):
        load_config(recipe, ["task.env.params.game=3"])
    assert load_config(recipe).task.env.params["game"]  # the shipped game validates


def test_a_game_that_breaks_ends_its_episode_with_an_error_naming_it():
    # Countdown (left out of the offline list for this) ends an invalid game with the reason text as its reward
    ep = TextArenaEpisode("Countdown-v0", lambda: ta.make("Countdown-v0-raw"), 0, True, 1.0)
    ep.reset()
    assert ep.step("nonsense").info["format_errors"] == 1.0
    with pytest.raises(RuntimeError, match=r"'Countdown-v0' \(seed 0\) ended with reward 'Invalid action format"):
        ep.step("nonsense")

    class Raises(ta.Env):
        def reset(self, num_players, seed=None):
            self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=3)
            self.state.reset(game_state={}, player_prompt_function=lambda **_: "go")

        def step(self, action):
            raise KeyError("board")

    ep = TextArenaEpisode("Raises", Raises, 4, True, 1.0)
    assert ep.reset() == [{"role": "user", "content": "go"}]
    with pytest.raises(RuntimeError, match=r"'Raises' \(seed 4\) raised in step: KeyError: 'board'"):
        ep.step("x")


class RepeatEngine:
    """Answers every row of every round with the same text (and EOS)."""

    def __init__(self, tokenizer, action: str) -> None:
        self.tok, self.action, self.pad_id, self.version = tokenizer, action, tokenizer.pad_token_id, 0

    def generate(self, prompts, sampling, seed=None):
        row = self.tok(self.action, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = torch.tensor([row] * len(prompts))
        mask = torch.ones_like(ids, dtype=torch.float)
        return Rollout.single_turn(prompts, ids, mask, -0.5 * mask, torch.ones(len(prompts), dtype=torch.bool),
                                   [""] * len(prompts), 1, self.version)


def test_through_the_driver_a_repeated_guess_is_warned_then_ends_the_game():
    env = make_env("textarena", {"game": "GuessTheNumber-v0"})
    tok = build_char_tokenizer(env.alphabet)
    delta = ChatDelta(tok)
    ex = next(e for e in env.examples("train", 40, 0) if _secret(env, e) != 10)
    episodes = [env.start(ex) for _ in range(2)]
    first = [ep.reset() for ep in episodes]
    prompts = [delta.prompt_ids(f) for f in first]
    recs = run_episodes(RepeatEngine(tok, "10"), delta, episodes, prompts, first, SamplingParams(max_new_tokens=8),
                        Limits(max_turns=6, max_tokens=600), lambda r: r)
    secret = _secret(env, ex)
    for rec in recs:  # [10] is a hint, the same guess again a warning, a third time the end (an invalid move)
        assert (rec.end, len(rec.turns), rec.info) == ("done", 3, {"format_errors": 2.0, "success": 0.0})
        assert rec.reward == pytest.approx(1 - abs(10 - secret) / 19)  # the game's completion fraction
        assert [m["content"].split(".")[0] for m in rec.messages if m["role"] == "user"][1:] == [
            f"The target number is {'higher' if secret > 10 else 'lower'}", "You attempted an invalid move"]
    assert recs[0].messages == recs[1].messages  # one seed, the same game


def _secret(env, example):
    ep = env.start(example)
    ep.reset()
    return ep.env.game_number


def test_the_recipe_trains_two_steps_on_the_tiny_model(tmp_path, quiet):
    cfg = load_config(RECIPE, [
        f'out="{tmp_path / "run"}"', 'model.path="tiny"', "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64", "model.tiny.num_layers=1", "model.tiny.max_positions=640",
        "task.env.max_turns=3", "task.env.max_tokens=64",
        "rollout.max_new_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.steps=2",
        "eval.prompts=2", "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false",
    ])
    assert cfg.rollout.driver == "multi_turn"
    summary = rl.train(cfg, console=quiet)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/nonfinite"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert all(r["reward/task/errors"] == 0 and r["reward/task/timeouts"] == 0 for r in rows)  # no episode lost
    assert all("episode/format_errors" in r and "episode/success" in r for r in rows)
    assert 0.0 <= summary["final"]["pass@1"] <= 1.0
