"""ReST-GRPO's partial-state prompts in the loop (rollout.driver = "partial_states"): which groups queue
prefixes, how later batches use them, what the rewards see, and resume."""

import json
import math

import pytest
import torch

from posttrain.algorithms import selection
from posttrain.config import ConfigError
from posttrain.produce.drivers import partial_states as partial
from posttrain.produce.drivers import with_prefixes
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rollout import Rollout
from posttrain.seeds import derive_seed
from posttrain.tasks import ArithmeticTask
from posttrain.train.rl import train

STEPS = ("task.params={digits=2, steps=true}", "rollout.max_new_tokens=10", "model.tiny.max_positions=64")


def test_push_queues_prefixes_of_eligible_base_groups_only(tiny_cfg):
    cfg = tiny_cfg("rollout.driver=partial_states", 'rollout.driver_params={separator=",", capacity=5}')
    task = ArithmeticTask(digits=2, steps=True)
    exs = [task.make_example(58, "+", 67), task.make_example(12, "+", 34), task.make_example(11, "+", 22),
           task.make_example(40, "+", 40)]
    prefixes = ["", "", "", "15,"]  # group 3 is itself a partial state
    r = torch.tensor([
        [0.0, 1.0, 0.0, 0.0],  # spread (std .433 >= .05), best 1.0 >= .9: eligible, best = sample 1
        [1.0, 1.0, 1.0, 1.0],  # no spread
        [0.5, 0.8, 0.0, 0.0],  # best .8 < .9
        [1.0, 0.0, 0.0, 0.0],  # eligible rewards, but a partial state: pushes nothing
    ])
    texts = ["x"] * 16
    texts[1] = "15,12,>521"  # pieces "15", "12", ">521": 3 prefixes, ceil(.5 * 3) = 2 drawn
    queue, pushed = partial.push([{"old": 1}] * 4, exs, prefixes, texts, r, cfg, step=3, batch=0)
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "rest", 3, 0, 0))
    ks = selection.rest_sample_prefixes(3, generator=gen).tolist()
    want = [["15,", "15,12,", "15,12,>521,"][k - 1] for k in ks]
    assert pushed == 2 and len(ks) == 2
    assert len(queue) == 5 and queue[0] == {"old": 1}  # capacity 5: the oldest three were dropped
    assert [q["prefix"] for q in queue[-2:]] == want
    assert partial.item_example(queue[-1]) == exs[0]


def test_take_the_oldest_up_to_the_share(tiny_cfg):
    cfg = tiny_cfg("rollout.driver=partial_states", "rollout.driver_params={share=0.5}", "rollout.prompts_per_step=8")
    taken, left = partial.take(list(range(10)), cfg)
    assert taken == [0, 1, 2, 3] and left == list(range(4, 10))  # floor(.5 * 8) = 4
    assert partial.take([7], cfg) == ([7], [])


def test_rewards_see_prefix_and_continuation():
    rollouts = Rollout.single_turn([[1], [2]], torch.zeros(4, 1), torch.ones(4, 1), torch.zeros(4, 1),
                                torch.ones(4, dtype=torch.bool), ["a", "b", "c", "d"], 2)
    assert with_prefixes(rollouts, ["", "P:"]).texts == ["a", "b", "P:c", "P:d"]
    assert with_prefixes(rollouts, ["", ""]) is rollouts


def test_partial_options_belong_to_the_driver(tiny_cfg):
    with pytest.raises(ConfigError, match=r"driver 'single_turn' has no option\(s\) \['share'\]"):
        tiny_cfg("rollout.driver_params={share=0.3}")
    with pytest.raises(ConfigError, match="rollout.driver_params.share"):
        tiny_cfg("rollout.driver=partial_states", "rollout.driver_params={share=1.5}")
    with pytest.raises(ConfigError, match=r"'rollout.partial_share' has moved: use rollout.driver_params.share"):
        tiny_cfg("rollout.partial_share=0.3")
    with pytest.raises(ConfigError, match="partial state adds a response prefix"):
        train(tiny_cfg("rollout.driver=partial_states", "rollout.max_new_tokens=20"))


def _long_ok(prompt, completion, **_):
    return float(len(completion) >= 6)  # varies within groups; the best scores 1 >= 0.9


def test_partial_states_in_the_loop(tiny_cfg, quiet, tmp_path, monkeypatch):
    seen = []

    def recorder(prompt, completion, **kw):
        seen.append((prompt, completion))
        return _long_ok(prompt, completion)

    monkeypatch.setitem(REWARDS._entries, "test_long_ok", recorder)
    takes = []
    take = partial.take

    def take_spy(queue, cfg):
        out = take(queue, cfg)
        takes.append(out[0])
        return out

    monkeypatch.setattr(partial, "take", take_spy)
    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", "scoring.workers=0", 'reward=[{name="test_long_ok"}]',
                   "rollout.driver=partial_states", 'rollout.driver_params={separator=","}', *STEPS)
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    assert rows[0]["selection/partial_groups"] == 0 and rows[0]["selection/partial_pushed"] > 0
    for r, t in zip(rows, takes, strict=True):
        assert r["selection/partial_groups"] == len(t) <= math.floor(0.5 * P)
    assert rows[1]["selection/partial_groups"] > 0
    # each taken item's group was scored on prefix + continuation, against the item's own question
    scored = seen[P * G : 2 * P * G]  # step 2's calls (the task verifier's run in the same order)
    step2 = takes[1]
    assert len(scored) == P * G and step2
    partial_rows = scored[(P - len(step2)) * G : P * G]  # the taken items come after the stream's prompts
    for j, item in enumerate(step2):
        for prompt, completion in partial_rows[j * G : (j + 1) * G]:
            assert prompt == item["example"]["prompt"] and completion.startswith(item["prefix"])


def test_resume_continues_the_queue(tiny_cfg, quiet, tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS._entries, "test_long_ok", _long_ok)
    common = ("checkpoint.every=1", "scoring.workers=0", 'reward=[{name="test_long_ok"}]',
              "rollout.driver=partial_states", 'rollout.driver_params={separator=","}', *STEPS)
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "full")), console=quiet)
    train(tiny_cfg("train.steps=2", *common, out=str(tmp_path / "cut")), console=quiet)
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)

    def rows(run):
        out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in out]

    a, b = rows(tmp_path / "full"), rows(tmp_path / "cut")
    assert a == b and sum(r["selection/partial_groups"] for r in a) > 0
