"""The ``agent`` driver (posttrain/produce/drivers/agent.py): agents written with the ``openai`` package run against
a per-episode URL on a server over a real tiny policy; the rows hold exactly the tokens and log-probs the server
sampled, failed agents score None without stopping the batch, a call that does not extend the episode starts a
new segment, and recipes/agent_openai.toml trains with the sampler's and the learner's log-probs agreeing.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, ProduceSettings, load_config
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.produce.drivers.agent import common_prefix
from posttrain.produce.drivers.agent_episodes import EpisodeLog
from posttrain.rollout import SamplingParams, make_engine
from posttrain.serve.protocol import Sample
from posttrain.tasks import ArithmeticTask
from posttrain.train.rl import train

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
TASK = ArithmeticTask(digits=2, ops="+", reverse=True)  # tiny.toml's task
P, G = 2, 3

HEAD = """
import json, time
import openai

def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)

def chat(url, messages):
    return client(url).chat.completions.create(model="any", messages=messages, max_tokens=6, logprobs=True,
                                               temperature=0.1).model_dump()  # the run's temperature wins

def index(url):  # the episode's number, from .../episodes/s<step>b<batch>e<n>/v1
    return int(url.rsplit("/episodes/", 1)[1].split("/")[0].rsplit("e", 1)[1])
"""


def agent_file(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + f"LOG = {str(tmp_path / (name + '.jsonl'))!r}\n" + textwrap.dedent(body))
    return str(path)


def calls_of(tmp_path: Path, name: str) -> dict[int, list[dict]]:
    rows = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return {r["n"]: r["calls"] for r in rows}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A real tiny policy on the hf engine (random weights: its answers vary, special tokens included)."""
    spec = TinySpec(alphabet=TASK.alphabet, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    max_positions=64, seed=1)
    path = str(build_tiny(tmp_path_factory.mktemp("tiny") / "model", spec))
    tok = load_tokenizer(path)
    return tok, make_engine("hf", load_model(path).eval(), tok)


def produce(policy, tiny_cfg, agent: str, *overrides: str, timeout_s: float = 30):
    """One generation batch of the agent driver over the real policy."""
    tok, engine = policy
    cfg = tiny_cfg("rollout.driver=agent", f"rollout.prompts_per_step={P}", f"rollout.group_size={G}",
                   f'rollout.driver_params={{agent = "{agent}:run", timeout_s = {timeout_s}}}', *overrides)
    ctx = ProduceContext(TASK, tok, engine, SamplingParams(n=G, max_new_tokens=6, temperature=1.0),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    batch, _ = DRIVERS.get("agent")(ctx, None, 1, 0, 0)
    return batch


def test_rows_hold_the_sampled_tokens_of_both_calls(policy, tiny_cfg, tmp_path):
    agent = agent_file(tmp_path, "two_calls", """
        def run(url, example):
            messages = [{"role": "user", "content": example.prompt}]
            a = chat(url, messages)
            messages += [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "="}]
            b = chat(url, messages)
            with open(LOG, "a") as f:
                f.write(json.dumps({"n": index(url), "calls": [a, b]}) + "\\n")
            return len(b["choices"][0]["token_ids"]) / 6
    """)
    batch = produce(policy, tiny_cfg, agent)
    calls, r = calls_of(tmp_path, "two_calls"), batch.rollouts
    assert sorted(calls) == list(range(P * G)) and batch.metrics["agent/calls_mean"] == 2.0
    assert batch.metrics["agent/segments_mean"] == 1.0 and batch.metrics["agent/turns_mean"] == 2.0
    for n, (a, b) in calls.items():
        prompt = r.prompt_ids[n // G]
        sampled_a, sampled_b = a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]
        # the second call's prompt is the first call's prompt and sampled tokens, then the new turn
        assert b["prompt_token_ids"][:len(a["prompt_token_ids"]) + len(sampled_a)] == a["prompt_token_ids"] + sampled_a
        width = int(r.attention_mask[n].sum())
        assert prompt + r.token_ids[n, :width].tolist() == b["prompt_token_ids"] + sampled_b
        trained = r.loss_mask[n] > 0
        assert r.token_ids[n][trained].tolist() == sampled_a + sampled_b  # never re-tokenized
        lps = [c["logprob"] for call in (a, b) for c in call["choices"][0]["logprobs"]["content"]]
        assert r.behaviour_logprobs[n][trained].tolist() == pytest.approx(lps, abs=1e-6)
        assert r.turn_ids[n][trained].tolist() == [0] * len(sampled_a) + [1] * len(sampled_b)
        assert batch.rewards_PGK[n // G, n % G, 0] == pytest.approx(len(sampled_b) / 6)
    assert batch.valid_PG.all() and not batch.failures


def test_an_agent_that_raises_hangs_or_returns_none_scores_none(policy, tiny_cfg, tmp_path):
    agent = agent_file(tmp_path, "flaky", """
        def run(url, example):
            k = index(url)
            if k == 4:
                return 1.0  # no call: nothing to train
            chat(url, [{"role": "user", "content": example.prompt}])
            if k == 0:
                raise RuntimeError("the agent broke")
            if k == 1:
                time.sleep(60)  # past timeout_s: abandoned
            if k == 2:
                return None
            return 1.0
    """)
    batch = produce(policy, tiny_cfg, agent, "scoring.on_error=mask", timeout_s=3)
    assert {f["index"]: f["status"] for f in batch.failures} == {0: "error", 1: "timeout", 2: "no_reward"}
    assert all(f["completion"].startswith("<|bos|>") for f in batch.failures)  # the transcript, specials kept
    assert "the agent broke" in batch.failures[0]["message"]
    assert batch.valid_PG.flatten().tolist() == [False, False, False, True, False, True]
    assert batch.metrics["reward/task/errors"] == 1 and batch.metrics["reward/task/timeouts"] == 1
    assert batch.metrics["agent/no_reward"] == 1 and batch.metrics["reward/invalid_frac"] == pytest.approx(3 / 6)
    assert batch.metrics["agent/no_call_frac"] == pytest.approx(1 / 6)
    assert batch.rollouts.loss_mask[4].sum() == 0 and batch.rollouts.loss_mask[3].sum() > 0


def test_a_call_that_does_not_extend_the_episode_starts_a_new_segment(policy, tiny_cfg, tmp_path):
    agent = agent_file(tmp_path, "fresh", """
        def run(url, example):
            a = chat(url, [{"role": "user", "content": example.prompt}])
            b = chat(url, [{"role": "user", "content": "=" + example.prompt}])  # a new history, not an extension
            with open(LOG, "a") as f:
                f.write(json.dumps({"n": index(url), "calls": [a, b]}) + "\\n")
            return 0.0
    """)
    batch = produce(policy, tiny_cfg, agent)
    r = batch.rollouts
    assert batch.metrics["agent/segments_mean"] == 2.0 and batch.metrics["agent/segments_dropped"] == 1.0
    for n, (_, b) in calls_of(tmp_path, "fresh").items():  # the last segment is trained, alone
        trained = r.loss_mask[n] > 0
        assert r.token_ids[n][trained].tolist() == b["choices"][0]["token_ids"]
        width = int(r.attention_mask[n].sum())
        assert r.prompt_ids[n // G] + r.token_ids[n, :width].tolist() == b["prompt_token_ids"] + \
            b["choices"][0]["token_ids"]


def test_episode_log_segments_branches_and_splices():
    log = EpisodeLog()
    log.add([1, 2], [Sample([7, 8, 0], [-0.1, -0.2, -0.3], True)], [[7, 8, 0]])
    log.add([1, 2, 7, 8, 0, 5], [Sample([9], [-0.4], False), Sample([6], [-0.5], False)], [[9], [6]])
    assert [s.ids for s in log.segments] == [[1, 2, 7, 8, 0, 5, 9], [1, 2, 7, 8, 0, 5, 6]]  # n = 2: a branch
    assert log.last == 1 and log.segments[0].turns[1].context_ids == [5]
    log.add([3], [Sample([4], [-0.6], True)], [[4]])
    assert len(log.segments) == 3 and log.kept.ids == [3, 4]
    # an answer sampled as [7, 8, 0] that a client sends back as text re-encoding to [78, 0]: the history that
    # reads [1, 2, 78, 0, ...] gets its sampled ids back
    log = EpisodeLog()
    log.add([1, 2], [Sample([7, 8, 0], [-0.1, -0.2, -0.3], True)], [[78, 0]])
    assert log.splice([1, 2, 78, 0, 5]) == [1, 2, 7, 8, 0, 5] and log.spliced == 1
    assert log.splice([1, 2, 7, 8, 0, 5]) == [1, 2, 7, 8, 0, 5] and log.spliced == 1  # exact already
    assert log.splice([1, 3]) == [1, 3]
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]


def test_a_bad_agent_spec_fails_at_load(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="driver_params.agent"):
        tiny_cfg("rollout.driver=agent", 'rollout.driver_params={agent = "no_colon"}')
    with pytest.raises(ConfigError, match="not found"):
        tiny_cfg("rollout.driver=agent", f'rollout.driver_params={{agent = "{tmp_path / "missing.py"}:run"}}')
    agent = agent_file(tmp_path, "nofn", "x = 1\n")
    with pytest.raises(ConfigError, match="no callable 'run'"):
        tiny_cfg("rollout.driver=agent", f'rollout.driver_params={{agent = "{agent}:run"}}')


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_recipe_trains_with_the_sampled_log_probs(staleness, tmp_path, quiet):
    cfg = load_config(ROOT / "recipes" / "agent_openai.toml",
                      [f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
                       "log.plot_groups=false", "checkpoint.every=0", "rollout.prompts_per_step=4",
                       f"rollout.max_staleness={staleness}"])
    assert train(cfg, console=quiet)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent/calls_mean"] == 2 and r["agent/turns_mean"] == 2 and math.isfinite(r["loss"]) for r in rows)
    # step 1's batch (and every batch of the synchronous run) was sampled by the weights the learner recomputes
    # its old log-probs with: the recorded tokens and log-probs are the trained ones, to float noise
    for r in rows[: 2 if staleness == 0 else 1]:
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-4) and r["offpolicy/mismatch_k3"] < 1e-6
