"""openenv: an OpenEnv server as a multi-turn environment (posttrain/envs/openenv_env.py), against a real OpenEnv
server (openenv-core's ``create_app`` under uvicorn) that the test starts on loopback in a process of its own:
played by hand, through the multi-turn driver with a server that hangs, answers malformed observations or dies,
and trained for two steps from a recipe-like config (the TOML of docs/agents.md, "OpenEnv environments").
"""

from __future__ import annotations

import json
import math
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("openenv.core.generic_client")
pytest.importorskip("uvicorn")

from posttrain.config import load_config  # noqa: E402
from posttrain.envs import make_env  # noqa: E402
from posttrain.errors import ConfigError  # noqa: E402
from posttrain.models.tiny import PRINTABLE, build_char_tokenizer  # noqa: E402
from posttrain.rollout import Rollout, SamplingParams  # noqa: E402
from posttrain.rollout.chat_delta import ChatDelta  # noqa: E402
from posttrain.rollout.multiturn import Limits, run_episodes  # noqa: E402
from posttrain.tasks.base import Example  # noqa: E402
from posttrain.train.rl import train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Count up to a seeded target (1..3) with "+" and submit with "=" (reward 1 on target, else 0). The actions "hang",
# "bad", "list" and "die" misbehave: no answer for 60 s, an observation without its text or with a list for it,
# the server's process exiting.
SERVER = '''
import os, random, sys, time
import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

class CountAction(Action):
    message: str

class CountObservation(Observation):
    text: str | list | None = None

class Count(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.count, self._state = random.Random(seed).randint(1, 3), 0, State(step_count=0)
        return CountObservation(text=f"reach {self.target}", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        a = action.message.strip()
        self._state.step_count += 1
        if a == "hang":
            time.sleep(60)
        if a == "die":
            os._exit(3)
        if a == "bad":
            return CountObservation(text=None, done=False, reward=0.0)
        if a == "list":
            return CountObservation(text=["not", "text"], done=False, reward=0.0)
        if a == "=":
            return CountObservation(text="", done=True, reward=float(self.count == self.target))
        if a == "+":
            self.count += 1
            return CountObservation(text=f"at {self.count}", done=False, reward=0.0)
        return CountObservation(text="use + or =", done=False, reward=0.0)

    @property
    def state(self):
        return self._state

app = create_app(Count, CountAction, CountObservation, env_name="count", max_concurrent_envs=64)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", ws_ping_interval=None)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The OpenEnv server of SERVER in a child process on a free loopback port."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "count_server.py").write_text(SERVER)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"count_server_{self.port}.log"  # a file, not a pipe: a full pipe would block the server
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(tmp / "count_server.py"), str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv test server exited: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the OpenEnv test server did not start within 60 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("openenv"))
    yield s
    s.stop()


def test_a_game_is_played_over_the_wire(server):
    env = make_env("openenv", {"base_url": server.url, "observation_field": "text", "max_turns": 6})
    assert env.max_turns == 6 and set("reach 0123456789") <= set(env.alphabet)
    ex = env.examples("train", 1, 0)[0]
    target = random.Random(ex.fields["seed"]).randint(1, 3)
    ep = env.start(ex)
    assert ep.reset() == [{"role": "user", "content": f"reach {target}"}] and ex.prompt == f"reach {target}"
    other = env.start(ex)  # a session of its own: the other episode's count does not move this one's
    other.reset()
    assert ep.step("?").messages == ({"role": "user", "content": "use + or ="},)
    key = ep.state_key()
    for k in range(target):
        assert other.step("+").messages[0]["content"] == f"at {k + 1}"
        assert ep.step("+").messages[0]["content"] == f"at {k + 1}"
    assert ep.state_key() != key
    end = ep.step("=")
    assert (end.messages, end.reward, end.done, dict(end.info)) == ((), 1.0, True, {"success": 1.0})
    assert other.step("+").messages[0]["content"] == f"at {target + 1}"
    assert other.step("=").reward == 0.0  # one past the target
    whole = make_env("openenv", {"base_url": server.url}).start(ex)  # observation_field = "": the JSON object
    assert json.loads(whole.reset()[0]["content"]) == {"text": f"reach {target}"}


def test_examples_are_seeded_and_the_splits_share_no_seed(server):
    env = make_env("openenv", {"base_url": server.url, "observation_field": "text"})
    a = env.examples("train", 6, 3)
    assert a == env.examples("train", 6, 3) and a != env.examples("train", 6, 4)
    assert {ex.prompt for ex in a} <= {"reach 1", "reach 2", "reach 3"}
    test = {ex.fields["seed"] for ex in env.examples("test", 6, 3)}
    assert not test & {ex.fields["seed"] for ex in a}


def test_a_bad_url_or_mapping_is_a_config_error(server):
    with pytest.raises(ConfigError, match="expected an http"):
        make_env("openenv", {"base_url": "127.0.0.1:1"})
    with pytest.raises(ConfigError, match="does not reset: reset failed: ConnectionError"):
        make_env("openenv", {"base_url": f"http://127.0.0.1:{free_port()}", "connect_timeout_s": 2})
    with pytest.raises(ConfigError, match=r"does not reset: .*observation\['txt'\] is None, expected a string"):
        make_env("openenv", {"base_url": server.url, "observation_field": "txt"})
    with pytest.raises(ValueError, match="unknown parameter 'colour'"):
        make_env("openenv", {"base_url": server.url, "colour": 1})


TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{{ m.content }}{{ eos_token }}{% else %}"
            "<u>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


class ScriptedEngine:
    """Row k answers ``actions[k]`` every round."""

    def __init__(self, tokenizer, actions: list[str]) -> None:
        self.tok, self.actions, self.pad_id, self.version = tokenizer, actions, tokenizer.pad_token_id, 0
        self.live = list(range(len(actions)))  # the rows still playing, in the driver's order

    def generate(self, prompts, sampling, seed=None):
        rows = [self.tok(self.actions[k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                for k in self.live[:len(prompts)]]
        width = max(map(len, rows))
        ids = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
        return Rollout.single_turn(prompts, ids, mask, -0.5 * mask, torch.ones(len(prompts), dtype=torch.bool),
                                   [""] * len(prompts), 1, self.version)


def play(url: str, actions: list[str], step_timeout_s: float = 10.0, turns: int = 2):
    """One round of episodes on seed 0, row k answering ``actions[k]``, through the multi-turn driver's loop."""
    tok = build_char_tokenizer(PRINTABLE + "\n")
    tok.chat_template = TEMPLATE
    delta = ChatDelta(tok)
    env = make_env("openenv", {"base_url": url, "observation_field": "text", "step_timeout_s": step_timeout_s})
    episodes = [env.start(Example("reach ?", "", "", {"seed": 0})) for _ in actions]
    first = [ep.reset() for ep in episodes]
    t0 = time.monotonic()
    recs = run_episodes(ScriptedEngine(tok, actions), delta, episodes, [delta.prompt_ids(f) for f in first], first,
                        SamplingParams(max_new_tokens=4), Limits(max_turns=turns, max_tokens=200,
                                                                 step_timeout_s=30.0), lambda r: r)
    return recs, time.monotonic() - t0


def test_a_hung_step_or_a_malformed_observation_loses_its_episode_not_the_run(server):
    recs, seconds = play(server.url, ["+", "hang", "bad", "list"], step_timeout_s=2.0)
    ends = [(r.end, r.reward, len(r.turns)) for r in recs]
    assert ends == [("max_turns", 0.0, 2), ("error", None, 1), ("error", None, 1), ("error", None, 1)]
    assert seconds < 20  # the hung step was cut at step_timeout_s (2 s), not waited for (60 s)
    assert "TimeoutError" in recs[1].error
    assert "observation['text'] is None, expected a string" in recs[2].error
    assert "observation['text'] is ['not', 'text'], expected a string" in recs[3].error
    assert play(server.url, ["="])[0][0].end == "done"  # the server still answers


def test_a_server_that_dies_mid_episode_ends_every_episode_as_an_error(tmp_path):
    s = Server(tmp_path)
    try:
        tok_env = make_env("openenv", {"base_url": s.url, "observation_field": "text"})
        late = tok_env.start(Example("reach ?", "", "", {"seed": 1}))
        recs, _ = play(s.url, ["+", "die", "+"])
        assert [r.end for r in recs] == ["error"] * 3 and all(r.reward is None for r in recs)
        assert s.proc.wait(10) == 3
        # a reset on the dead server does not raise: the episode shows the example's prompt, its first step fails
        assert late.reset() == [{"role": "user", "content": "reach ?"}]
        with pytest.raises(RuntimeError, match="reset failed: ConnectionError"):
            late.step("+")
    finally:
        s.stop()


TOML = """
# Multi-turn GRPO against an OpenEnv server (docs/agents.md, "OpenEnv environments"); the tiny model of tiny.toml.
seed = 0
out = "runs/openenv"

[model]
path = "tiny"

[model.tiny]
hidden_size = 64
intermediate_size = 128
num_layers = 2
num_heads = 4
max_positions = 128

[task]
name = "env"

[task.env]
name = "openenv"
params = { base_url = "http://127.0.0.1:8000", action_field = "message", observation_field = "text" }
max_turns = 3
max_tokens = 64

[rollout]
driver = "multi_turn"
group_size = 4
prompts_per_step = 4
max_new_tokens = 4
temperature = 1.0
"""


def recipe(url: str, tmp_path: Path) -> Path:
    """The TOML of docs/agents.md ("OpenEnv environments") with the server's URL."""
    path = tmp_path / "openenv.toml"
    path.write_text(TOML.replace("http://127.0.0.1:8000", url))
    return path


def test_a_recipe_trains_two_steps_against_the_server(server, tmp_path, quiet):
    cfg = load_config(recipe(server.url, tmp_path), [f'out="{tmp_path / "run"}"', "train.steps=2",
                                                     "log.progress=false", "log.tensorboard=false",
                                                     "log.plot_groups=false", "checkpoint.every=0", "eval.prompts=4"])
    assert train(cfg, console=quiet)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["reward/invalid_frac"] == 0 for r in rows)  # every episode got its rewards from the server


def test_observation_text_and_step_reward_check_what_the_server_sent():
    from posttrain.envs.openenv_env import observation_text, step_reward

    assert observation_text({"text": "hi", "n": 1}, "text") == "hi"
    assert observation_text({"b": 1, "a": "x"}, "") == '{"a": "x", "b": 1}'
    with pytest.raises(TypeError, match="expected a JSON object"):
        observation_text(["text"], "text")
    assert step_reward(None) == 0.0 and step_reward(2) == 2.0
    for bad in ("1", True, math.inf):
        with pytest.raises(TypeError, match="expected a finite number or null"):
            step_reward(bad)
