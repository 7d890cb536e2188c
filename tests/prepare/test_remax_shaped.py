"""ReMax's greedy baseline is rewarded like the samples: through the run's shapers, with its own inputs
(issue 15). The paper's b = r(x, y_greedy) uses the sample's reward function r; a shaped run's r is the
shaped one, so b is too (verl scores the greedy batch with the same ``reward_fn``). The produce phase
samples it (``collect.SAMPLED_INPUTS``) when the estimator requires ``baseline_rewards``, and the batch
carries it to prepare's provider."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from posttrain.algorithms import advantages, shaping
from posttrain.config import ConfigError
from posttrain.prepare.providers import PROVIDERS, StepInputs
from posttrain.produce.collect import SAMPLED_INPUTS, greedy_baseline, sample_inputs, shape_rewards
from posttrain.produce.drivers import ProduceContext
from posttrain.produce.parts import ProduceParts
from posttrain.rollout import Rollout, SamplingParams
from posttrain.tasks.base import Example
from posttrain.train.rl import train

OVERLONG = 'algorithm.shapers=[{name="overlong", params={max_length=6, buffer=2}}]'  # ramp from 4 to 6 tokens


def T(x: list) -> Tensor:
    """A float tensor."""
    return torch.tensor(x, dtype=torch.float32)


def rollout(prompts: list[list[int]], lengths: list[int], n: int) -> Rollout:
    """A rollout of ``n`` responses per prompt with the given token lengths (texts "x")."""
    width = max(lengths)
    mask = T([[1.0] * L + [0.0] * (width - L) for L in lengths])
    rows = len(lengths)
    return Rollout.single_turn(prompts, torch.ones(rows, width, dtype=torch.long), mask, torch.zeros(rows, width),
                               torch.ones(rows, dtype=torch.bool), ["x"] * rows, n=n)


@dataclass
class GreedyEngine:
    """Answers a greedy request with responses of fixed lengths."""

    lengths: list[int]
    pad_id: int = 0
    version: int = 0

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """The greedy responses (one per prompt)."""
        assert sampling.n == 1 and sampling.temperature == 0.0
        return rollout(prompts, self.lengths, n=1)


class ScoresOne(ProduceContext):
    """Every response's raw reward is 1 (one component, weight 1)."""

    def score(self, examples: list[Example], rollouts: Rollout) -> tuple[Tensor, Tensor, Tensor, dict, list[dict]]:
        """Raw rewards ``[P, n, 1]`` of ones, all valid and correct."""
        P = len(examples)
        ones = torch.ones(P, rollouts.n, dtype=torch.bool)
        return torch.ones(P, rollouts.n, 1), ones, ones, {}, []


def baseline(cfg: object, greedy_lengths: list[int]) -> tuple[Tensor, ProduceParts, ProduceContext]:
    """The greedy baseline the produce phase samples for two prompts whose greedy responses have these lengths."""
    parts = ProduceParts.from_config(cfg.algorithm)
    pc = ScoresOne(None, None, GreedyEngine(greedy_lengths), SamplingParams(max_new_tokens=6, n=2),
                   [("task", {})], T([1.0]), cfg)
    b, failed = greedy_baseline(pc, parts, SimpleNamespace(prompt_ids=[[1], [2]], examples=[None, None]))
    assert failed == []
    return b, parts, pc


@dataclass
class Prompts:
    """What the produce phase reads and writes of a batch to sample its inputs."""

    prompt_ids: list[list[int]]
    examples: list
    failures: list[dict] = field(default_factory=list)
    sampled_inputs: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class CountingEngine(GreedyEngine):
    """A greedy engine that records every request."""

    asked: list = field(default_factory=list)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """The greedy responses, recorded."""
        self.asked.append(sampling)
        return super().generate(prompts, sampling, seed)


def test_the_batch_carries_the_baseline_when_the_estimator_requires_it(tiny_cfg):
    # sampled by the produce phase for an estimator whose required inputs name baseline_rewards (remax), read
    # off the batch by prepare's provider; nothing is sampled for one that does not (grpo)
    for advantage in ("grpo", "remax"):
        cfg = tiny_cfg(f'algorithm.advantage="{advantage}"', OVERLONG)
        engine = CountingEngine([5, 3])
        pc = ScoresOne(None, None, engine, SamplingParams(max_new_tokens=6, n=2), [("task", {})], T([1.0]), cfg)
        batch = Prompts([[1], [2]], [None, None])
        got = sample_inputs(pc, ProduceParts.from_config(cfg.algorithm), batch)
        if advantage == "grpo":
            assert got is batch and engine.asked == []
            with pytest.raises(ValueError, match="baseline_rewards are sampled by the produce phase"):
                PROVIDERS.get("baseline_rewards")(None, StepInputs(got, torch.ones(4, 6), 0.0), {})
            continue
        assert [(s.n, s.temperature) for s in engine.asked] == [(1, 0.0)]  # one greedy response a prompt
        # overlong from 4 to 6 tokens: greedy lengths [5, 3] -> b = [1 - 0.5, 1 - 0] (as below)
        torch.testing.assert_close(got.sampled_inputs["baseline_rewards"], T([0.5, 1.0]))
        provided = PROVIDERS.get("baseline_rewards")(None, StepInputs(got, torch.ones(4, 6), 0.0), {})
        torch.testing.assert_close(provided, T([0.5, 1.0]))


def test_greedy_baseline_carries_its_own_length_penalty(tiny_cfg):
    cfg = tiny_cfg('algorithm.advantage="remax"', OVERLONG)
    # overlong, L_max 6, buffer 2: penalty min(-(L - 4) / 2, 0). Greedy lengths [5, 3], raw rewards [1, 1]:
    # b = [1 - 0.5, 1 - 0] = [0.5, 1.0]  (unshaped before the fix: [1.0, 1.0])
    b, parts, pc = baseline(cfg, [5, 3])
    torch.testing.assert_close(b, T([0.5, 1.0]))
    # samples: prompt 0 lengths [4, 6] -> shaped [1 - 0, 1 - 1] = [1, 0]; prompt 1 lengths [3, 5] -> [1, 0.5]
    samples = rollout([[1], [2]], [4, 6, 3, 5], n=2)
    r = shape_rewards(pc, parts, [None, None], samples, torch.ones(2, 2), {}, None)
    torch.testing.assert_close(r, T([[1.0, 0.0], [1.0, 0.5]]))
    # A = r' - b' = [[1 - .5, 0 - .5], [1 - 1, .5 - 1]] = [[0.5, -0.5], [0, -0.5]]; the unshaped b = 1 gave
    # [[0, -1], [0, -0.5]]: the sample shorter than the greedy response did not beat it
    torch.testing.assert_close(advantages.compute("remax", r, baseline_rewards=b), T([[0.5, -0.5], [0.0, -0.5]]))


def test_greedy_response_like_a_sample_gets_the_samples_reward(tiny_cfg):
    # invariant: a greedy response with a sample's length and raw reward is that sample's shaped reward, so
    # that sample's advantage is 0, at every length on the ramp (3..6 tokens: penalty 0, 0, .5, 1)
    cfg = tiny_cfg('algorithm.advantage="remax"', OVERLONG)
    for L in (3, 4, 5, 6):
        b, parts, pc = baseline(cfg, [L, L])
        r = shape_rewards(pc, parts, [None, None], rollout([[1], [2]], [L, 2, L, 6], n=2), torch.ones(2, 2), {}, None)
        assert torch.allclose(advantages.compute("remax", r, baseline_rewards=b)[:, 0], torch.zeros(2)), L


def test_a_corrected_remax_keeps_the_factor_a(tiny_cfg):
    # noisy_verifier_backward (fp .1, fn .2): R^ = (R - .1) / .7, 1 -> 9/7, 0 -> -1/7. Greedy raw 1 -> b = 9/7;
    # samples [1, 0] -> [9/7, -1/7]: A = [0, -10/7] = (1 / .7) x the uncorrected [0, -1]
    cfg = tiny_cfg('algorithm.advantage="remax"',
                   'algorithm.shapers=[{name="noisy_verifier_backward", params={fp_rate=0.1, fn_rate=0.2}}]')
    b, parts, pc = baseline(cfg, [3, 3])
    torch.testing.assert_close(b, T([9 / 7, 9 / 7]))
    r = shape_rewards(pc, parts, [None, None], rollout([[1], [2]], [3, 3, 3, 3], n=2), T([[1, 0], [1, 0]]), {}, None)
    torch.testing.assert_close(advantages.compute("remax", r, baseline_rewards=b), T([[0.0, -10 / 7]] * 2))


@pytest.mark.parametrize("shaper, why", [("rank", "ranks each response against the rest of its group"),
                                         ("traac_length", "reads the group's pass rate")])
def test_config_rejects_a_group_shaper_with_remax(tiny_cfg, shaper, why):
    with pytest.raises(ConfigError, match=rf"shapers\[0\]: '{shaper}' {why}.*'remax' subtracts the shaped reward"):
        tiny_cfg('algorithm.advantage="remax"', f'algorithm.shapers=[{{name="{shaper}"}}]')
    assert tiny_cfg('algorithm.advantage="grpo"', f'algorithm.shapers=[{{name="{shaper}"}}]')  # fine elsewhere


def test_every_shaper_is_classified_for_an_outside_baseline():
    # a new shaper must say whether it shapes one response on its own (else remax rejects it, generically)
    for name in shaping.names():
        why = shaping.baseline_unshapable(name, "remax")
        assert (why is None) == (name in shaping.PER_RESPONSE), name
        assert shaping.baseline_unshapable(name, "grpo") is None
        if name not in shaping.PER_RESPONSE:  # and a rejected one says why
            assert "is not known to shape a response" not in (why or ""), name


def test_remax_with_overlong_trains_on_shaped_baselines(tiny_cfg, quiet, tmp_path, test_entries, monkeypatch):
    # 2 steps, test_length reward (characters), overlong ramp from 2 to 6 tokens (buffer 4): the baseline of
    # each prompt, r - A in samples.jsonl, is len(greedy text) + min(-(L_greedy - 2) / 4, 0)
    greedy: list[Rollout] = []
    real = SAMPLED_INPUTS["baseline_rewards"]

    def recording(ctx: ProduceContext, parts: ProduceParts, batch: object) -> tuple[Tensor, list[dict]]:
        engine = ctx.engine

        class Recorder:
            pad_id, version = engine.pad_id, engine.version

            def generate(self, prompts: list, sampling: SamplingParams, seed: int | None = None) -> Rollout:
                greedy.append(engine.generate(prompts, sampling, seed))
                return greedy[-1]

        return real(replace(ctx, engine=Recorder()), parts, batch)

    monkeypatch.setitem(SAMPLED_INPUTS, "baseline_rewards", recording)
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", 'algorithm.advantage="remax"',
                   'reward=[{name="test_length"}]',
                   'algorithm.shapers=[{name="overlong", params={max_length=6, buffer=4}}]',
                   "rollout.prompts_per_step=4", "log.samples_every=1", "log.samples=16")
    train(cfg, console=quiet)
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(T([m["loss"], m["optim/grad_norm"]])).all() and m["optim/grad_norm"] > 0 for m in metrics)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(greedy) == 2 and len(samples) == 32
    penalised = 0
    for step, g in enumerate(greedy, start=1):
        lengths = g.lengths.float()
        expected = T([len(t) for t in g.texts]) + torch.clamp(-(lengths - 2) / 4, max=0.0)
        penalised += int((lengths > 2).sum())
        rows = [s for s in samples if s["step"] == step]
        b = T([s["reward"] - s["advantage"] for s in rows]).view(4, 4)  # prompt-major, G = 4
        torch.testing.assert_close(b, expected[:, None].expand(4, 4), atol=1e-4, rtol=0)
    assert penalised > 0  # some greedy response was on the ramp, so an unshaped baseline would differ
