"""Responses sampled from the frozen reference policy (posttrain/produce/ref_samples.py): once per prompt,
the same draw whatever batch the prompt comes in, and what PAR with `samples` and A*-PO read from them.
"""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config import ProduceSettings
from posttrain.errors import ConfigError
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.produce.drivers import score
from posttrain.produce.ref_samples import ReferenceRewards
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.tasks import make_task
from posttrain.train import rl


def _digit_share(prompt, completion, **_):
    # a graded stand-in reward: the untrained tiny model's responses differ in it
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


@pytest.fixture
def sampler(tmp_path, tiny_cfg, monkeypatch):
    monkeypatch.setitem(REWARDS._entries, "test_digit_share", _digit_share)
    cfg = tiny_cfg()
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, max_positions=48))
    tok = load_tokenizer(str(d))
    task = make_task(cfg.task.name, **cfg.task.params)

    def scorer(examples, rollouts):  # the run's scorer, with the graded stand-in reward
        return score([("test_digit_share", {})], task, examples, rollouts, ProduceSettings.of(cfg))

    ref = ReferenceRewards(HFEngine(load_model(str(d)), tok), tok, SamplingParams(max_new_tokens=6), 6, cfg.seed,
                           cfg.task.system_prompt, scorer, torch.tensor([1.0]))
    return ref, task.examples("train", 5, seed=1)


def test_each_prompt_is_sampled_once_and_draws_alike_in_any_batch(sampler):
    ref, examples = sampler
    first = ref(examples[:3], 6)
    assert first.shape == (3, 6) and ref.sampled == 3 and first.std() > 0
    again = ref([examples[2], examples[4], examples[0]], 4)  # two known prompts, one new; the first 4 of 6
    assert ref.sampled == 4
    torch.testing.assert_close(again[0], first[2, :4])
    torch.testing.assert_close(again[2], first[0, :4])
    fresh = ReferenceRewards(ref.engine, ref.tokenizer, ref.sampling, 6, ref.seed, ref.system_prompt, ref.score,
                             ref.weights_K)
    torch.testing.assert_close(fresh([examples[4], examples[2]], 6), torch.stack([ref.cache[examples[4].prompt],
                                                                                  first[2]]))
    with pytest.raises(ValueError, match="7 reference samples"):
        ref(examples[:1], 7)


def test_par_with_samples_centres_each_reward_on_the_reference_samples(tiny_cfg, quiet, tmp_path, monkeypatch):
    # r' = mean_m sigmoid(r - r_ref,m) over the M = 4 reference responses of the prompt (not its demonstration)
    monkeypatch.setitem(REWARDS._entries, "test_digit_share", _digit_share)
    seen, made = [], []
    real, real_for_run = rl.prepare, rl.ReferenceRewards.for_run

    def for_run(*args, **kwargs):  # the run's reference sampler, kept to read its cache
        made.append(real_for_run(*args, **kwargs))
        return made[-1]

    def spy(ctx, selector, batch, live, step):
        seen.append((batch, made[0]))
        return real(ctx, selector, batch, live, step)

    monkeypatch.setattr(rl.ReferenceRewards, "for_run", staticmethod(for_run))
    monkeypatch.setattr(rl, "prepare", spy)
    cfg = tiny_cfg("train.steps=2", 'reward=[{name="test_digit_share"}]', "eval.every=0", "eval.prompts=4",
                   'algorithm.shapers=[{name="par", params={samples=4}}]')
    rl.train(cfg, console=quiet)
    for batch, ref in seen:
        raw_PG = batch.rewards_PGK.sum(-1)
        refs = torch.stack([ref.cache[ex.prompt][:4] for ex in batch.examples])
        expected = torch.sigmoid(raw_PG.unsqueeze(-1) - refs.unsqueeze(1)).mean(-1)
        torch.testing.assert_close(batch.rewards_PG, expected)
        assert refs.std() > 0  # the references differ: M samples, not one demonstration
    assert seen[0][1].sampled == len({ex.prompt for b, _ in seen for ex in b.examples})
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


def test_reference_samples_with_lora_are_refused(tiny_cfg):
    with pytest.raises(ConfigError, match="reference samples"):
        tiny_cfg("model.lora.rank=4", 'algorithm.shapers=[{name="par", params={samples=4}}]')
