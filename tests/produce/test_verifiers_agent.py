"""``verifiers`` (v1) environments as outside agents (posttrain/produce/drivers/verifiers_agent.py): a taskset, its
``@vf.reward`` and an in-process harness built in code run through verifiers' own ``Env`` and interception server
against the episode's URL on a server over a real tiny policy; the episode's reward is the rubric's, both calls
are trained, a failed verifiers episode scores None with its errors logged, and recipes/agent_verifiers.toml
trains two steps with the sampler's and the learner's log-probs agreeing.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from posttrain.config import ProduceSettings, load_config
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.produce.drivers.verifiers_agent import pick_task
from posttrain.rollout import SamplingParams, make_engine
from posttrain.tasks import ArithmeticTask
from posttrain.tasks.base import Example
from posttrain.train.rl import train

pytest.importorskip("verifiers.v1")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
TASK = ArithmeticTask(digits=2, ops="+", reverse=True)  # tiny.toml's task
P, G = 2, 2

# A taskset module written per test: LOG records what each episode saw; FAIL names the episodes whose harness
# (index % 4 == 1) or reward (index % 4 == 2) raises. The episode's index is read from the model client's base URL
# (.../episodes/s<step>b<batch>e<n>/v1), which is posttrain's, behind verifiers' interception.
TASKSET = '''
import json
import verifiers.v1 as vf
from openai import AsyncOpenAI
from posttrain.produce.drivers import verifiers_agent

LOG, FAIL = {log!r}, {fail!r}
INDEX = {{}}  # trace id -> episode index

def index(url):
    return int(url.rsplit("/episodes/", 1)[1].split("/")[0].rsplit("e", 1)[1])

class D(vf.TaskData):
    answer: str = ""

class T(vf.Task[D, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def reply_len(self, trace: vf.Trace) -> float:
        n = INDEX[trace.id]
        if FAIL and n % 4 == 2:
            raise ValueError("the reward broke")
        return len(trace.last_reply) / 100 + n

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(D(prompt="placeholder", answer="0"), self.config.task)]

class H(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        n = index(ctx.client.base_url)
        INDEX[trace.id] = n
        if FAIL and n % 4 == 1:
            raise RuntimeError("the harness broke")
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=60)
        msgs = [{{"role": "user", "content": data.prompt}}]
        a = await client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=6)
        msgs += [{{"role": "assistant", "content": a.choices[0].message.content}}, {{"role": "user", "content": "="}}]
        b = await client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=6)
        with open(LOG, "a") as f:
            f.write(json.dumps({{"n": n, "prompt": data.prompt, "answer": data.answer,
                                 "reply": b.choices[0].message.content}}) + "\\n")
        return vf.ProgramResult(0, "", "")

__all__ = ["S", "H"]
run = verifiers_agent.agent(__name__)
'''


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    spec = TinySpec(alphabet=TASK.alphabet, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    max_positions=64, seed=1)
    path = str(build_tiny(tmp_path_factory.mktemp("tiny") / "model", spec))
    tok = load_tokenizer(path)
    return tok, make_engine("hf", load_model(path).eval(), tok)


def produce(policy, tiny_cfg, tmp_path: Path, name: str, fail: bool):
    """One generation batch of the agent driver over a verifiers taskset written to ``tmp_path``."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(TASKSET.format(log=str(tmp_path / f"{name}.jsonl"), fail=fail)))
    tok, engine = policy
    cfg = tiny_cfg("rollout.driver=agent", f"rollout.prompts_per_step={P}", f"rollout.group_size={G}",
                   f'rollout.driver_params={{agent = "{path}:run", timeout_s = 60}}', "scoring.on_error=mask")
    ctx = ProduceContext(TASK, tok, engine, SamplingParams(n=G, max_new_tokens=6, temperature=1.0),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    batch, _ = DRIVERS.get("agent")(ctx, None, 1, 0, 0)
    log = tmp_path / f"{name}.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return batch, {r["n"]: r for r in rows}


def test_the_episode_scores_the_rubric_reward_and_trains_both_calls(policy, tiny_cfg, tmp_path):
    batch, seen = produce(policy, tiny_cfg, tmp_path, "vf_ok", fail=False)
    assert sorted(seen) == list(range(P * G)) and not batch.failures and batch.valid_PG.all()
    for n, row in seen.items():
        example = batch.examples[n // G]
        # the taskset's task, with posttrain's example written over its data
        assert (row["prompt"], row["answer"]) == (example.prompt, example.answer)
        # the rubric's reward, read back: the last reply's length / 100 plus the episode's index
        assert batch.rewards_PGK[n // G, n % G, 0].item() == pytest.approx(len(row["reply"]) / 100 + n)
    assert batch.metrics["agent/calls_mean"] == 2.0 and batch.metrics["agent/turns_mean"] == 2.0
    assert batch.metrics["agent/segments_mean"] == 1.0 and batch.rollouts.loss_mask.sum(1).gt(0).all()


def test_a_failed_verifiers_episode_scores_none_and_the_batch_goes_on(policy, tiny_cfg, tmp_path):
    batch, seen = produce(policy, tiny_cfg, tmp_path, "vf_bad", fail=True)
    by_index = {f["index"]: f for f in batch.failures}
    assert sorted(by_index) == [1, 2] and {f["status"] for f in batch.failures} == {"error"}
    assert "the harness broke" in by_index[1]["message"] and "the reward broke" in by_index[2]["message"]
    assert by_index[1]["completion"] == "(no call)" and "<|bos|>" in by_index[2]["completion"]  # transcripts
    assert batch.valid_PG.flatten().tolist() == [True, False, False, True]
    assert batch.metrics["reward/task/errors"] == 2 and batch.metrics["reward/invalid_frac"] == pytest.approx(0.5)
    assert sorted(seen) == [0, 2, 3]


def test_pick_task_prefers_the_same_prompt_then_writes_the_example_over_the_first():
    import verifiers.v1 as vf

    class D(vf.TaskData):
        answer: str = ""
        a: int = 0

    class T(vf.Task[D, vf.State, vf.TaskConfig]):
        pass

    tasks = [T(D(prompt="1+1", answer="2")), T(D(prompt="2+2", answer="4"))]
    assert pick_task(tasks, Example("2+2", "x", "")) is tasks[1]
    picked = pick_task(tasks, Example("3+4", "7", "", fields={"a": 3, "b": 4}))
    assert (picked.data.prompt, picked.data.answer, picked.data.a) == ("3+4", "7", 3)
    with pytest.raises(ValueError, match="yields no task"):
        pick_task([], Example("1", "1", ""))


def test_the_recipe_trains_two_steps_with_the_sampled_log_probs(tmp_path, quiet):
    cfg = load_config(ROOT / "recipes" / "agent_verifiers.toml",
                      [f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
                       "log.plot_groups=false", "checkpoint.every=0", "rollout.prompts_per_step=4"])
    assert train(cfg, console=quiet)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent/calls_mean"] == 2 and r["reward/invalid_frac"] == 0 and math.isfinite(r["loss"])
               for r in rows)
    for r in rows:  # synchronous: the recorded tokens and log-probs are the trained ones, to float noise
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-4) and r["offpolicy/mismatch_k3"] < 1e-6

