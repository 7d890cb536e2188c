"""The advantage inputs the loop computes on demand: CANON's metric and ProGRPO's prompt confidence
(hand-computed, against the trainer's teacher-forced log-probs, and as the loop feeds them)."""

import ast
import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import kl
from posttrain.config import ConfigError, LearnSettings
from posttrain.learn.critic import Critic, load_value_model
from posttrain.learn.learner import Learner
from posttrain.learn.logprobs import completion_logprobs, prompt_logprobs
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.prepare.providers import InputContext, StepInputs, prompt_confidence, provide, response_metric
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.train.loop_state import Phases
from posttrain.train.rl import train

ROOT = Path(__file__).resolve().parents[2]


class Bigram(torch.nn.Module):
    """A model whose next-token distribution depends on the current token only: P[cur, next]."""

    def __init__(self, probs):
        super().__init__()
        self.logp = torch.nn.Parameter(torch.log(torch.tensor(probs)))

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.logp[input_ids])


def test_response_metric_by_hand():
    ent = torch.tensor([[[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]]])
    mask = torch.tensor([[[1, 1, 0], [1, 0, 0], [0, 0, 0]]])
    # mean over the response tokens: (1 + 2) / 2, 3 / 1; an empty response counts 0
    assert response_metric("entropy", torch.tensor([[2, 1, 0]]), ent, mask).tolist() == [[1.5, 3.0, 0.0]]
    assert response_metric("length", torch.tensor([[2, 1, 0]]), None, mask).tolist() == [[2.0, 1.0, 0.0]]


def test_prompt_confidence_by_hand():
    # transitions of [0, 1, 2, 3, 1, 2]: .5, .25, .8, .1, .25. fraction .4 of 5 tokens -> the 2 lowest,
    # .1 and .25 -> c = sqrt(.1 * .25) = .158114. The shorter prompt [2, 3] (left-padded with 0) has
    # one transition, .8 -> c = .8 (ceil(.4 * 1) = 1 token; the padding is not counted)
    probs = [
        [0.1, 0.5, 0.2, 0.2],
        [0.25, 0.25, 0.25, 0.25],
        [0.1, 0.05, 0.05, 0.8],
        [0.3, 0.1, 0.3, 0.3],
    ]
    lp, mask = prompt_logprobs(Bigram(probs), [[0, 1, 2, 3, 1, 2], [2, 3]], pad_id=0, temperature=1.0)
    c = prompt_confidence(lp, mask, fraction=0.4)
    torch.testing.assert_close(c, torch.tensor([math.sqrt(0.1 * 0.25), 0.8]))


def test_prompt_logprobs_equal_teacher_forced_completion_logprobs(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5=")]
    lp, mask = prompt_logprobs(model, prompts, pad_id=tok.pad_token_id, temperature=0.7)
    assert lp.shape == mask.shape == (2, max(map(len, prompts)) - 1)
    for i, p in enumerate(prompts):
        # the same log-probs as scoring p[1:] as a "completion" of the one-token prompt p[:1]
        ids = torch.tensor([p[1:]])
        ref, _ = completion_logprobs(model, [p[:1]], ids, torch.ones_like(ids), pad_id=tok.pad_token_id,
                                     temperature=0.7)
        n = len(p) - 1
        assert mask[i].sum() == n and mask[i, -n:].all()
        torch.testing.assert_close(lp[i, -n:], ref[0], atol=1e-5, rtol=1e-5)
        # and c(q) is exp(mean of the ceil(.2 n) lowest), computed by a loop
        low = sorted(ref[0].tolist())[: math.ceil(0.2 * n)]
        c = prompt_confidence(*prompt_logprobs(model, [p], pad_id=tok.pad_token_id, temperature=0.7), fraction=0.2)
        assert c.item() == pytest.approx(math.exp(sum(low) / len(low)), rel=1e-5)


@pytest.mark.parametrize("metric", ["entropy", "length"])
def test_loop_feeds_canon_the_chosen_metric(metric, tiny_cfg, quiet, advantage_calls, test_entries):
    seen = advantage_calls
    cfg = tiny_cfg("train.steps=1", "checkpoint.every=0", "rollout.prompts_per_step=4", "eval.prompts=4",
                   'reward=[{name="test_length"}]', 'algorithm.advantage="canon"',
                   f'algorithm.advantage_metric="{metric}"')
    train(cfg, console=quiet)
    (kw,) = seen
    assert kw["metric"].shape == (4, 4)
    if metric == "length":
        torch.testing.assert_close(kw["metric"], kw["lengths"])
    else:  # each response's mean token entropy (all samples are valid: mask = the response mask)
        m = kw["mask"].float()
        torch.testing.assert_close(kw["metric"], (kw["entropies"] * m).sum(-1) / m.sum(-1).clamp(min=1))
        assert (kw["metric"] > 0).all()


def test_loop_feeds_progrpo_the_prompts_confidence(tiny_cfg, quiet, advantage_calls, test_entries):
    seen = advantage_calls
    cfg = tiny_cfg("train.steps=1", "checkpoint.every=0", "rollout.prompts_per_step=4", "eval.prompts=4",
                   'reward=[{name="test_length"}]', 'algorithm.advantage="progrpo"')
    train(cfg, console=quiet)
    (kw,) = seen
    c = kw["prompt_confidence"]
    assert c.shape == (4,) and ((c > 0) & (c <= 1)).all()
    assert "entropies" not in kw or kw["entropies"] is None  # no entropy forward when nothing needs it


def test_inputs_are_not_parameters(tiny_cfg):
    with pytest.raises(ConfigError, match="advantage_metric"):
        tiny_cfg('algorithm.advantage="canon"', 'algorithm.advantage_params={metric="length"}')
    with pytest.raises(ConfigError, match=r"takes no metric.*\['canon'\]"):
        tiny_cfg('algorithm.advantage_metric="length"')
    with pytest.raises(ConfigError, match="advantage_metric"):
        tiny_cfg('algorithm.advantage="canon"', 'algorithm.advantage_metric="entrpy"')


def test_learner_inputs_do_not_depend_on_the_micro_batch_budget(tiny_cfg, tmp_path):
    # the inputs that are forward passes (the critic's values, the policy's entropies, its prompts' log-probs, the
    # reference's for the KL in the reward) come from the Learner, whose passes hold at most
    # train.micro_batch_tokens tokens: a budget of ~2 rows gives what one pass over the batch gives
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    model, tok, ref = load_model(str(d)).eval(), load_tokenizer(str(d)), load_model(str(d)).eval()
    with torch.no_grad():  # a reference that differs from the policy, a critic whose head says something
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    critic, _ = load_value_model(str(d))
    torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5=")]
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.9, n=2), seed=0)
    batch = SimpleNamespace(prompt_ids=prompts, rollouts=rollouts)
    step = StepInputs(batch, rollouts.loss_mask.float(), kl_coef=0.1)
    got = []
    for budget in (0, 2 * min(map(len, prompts)) + rollouts.token_ids.shape[1]):
        cfg = tiny_cfg(f"train.micro_batch_tokens={budget}", "rollout.temperature=0.9")
        phases = Phases.from_config(cfg)
        parts = replace(phases.prepare, inputs=("values", "entropies", "prompt_confidence", "token_rewards"),
                        kl_reward=partial(kl.estimate, "k1"))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        settings = LearnSettings.of(cfg)
        lrn = Learner(model, opt, None, phases.learn, settings, tok.pad_token_id, ref, Critic.around(critic, settings))
        got.append(provide(InputContext(parts, lrn), step))
    for name in ("values", "entropies", "prompt_confidence", "token_rewards"):
        torch.testing.assert_close(got[1][name], got[0][name], atol=1e-5, rtol=0)
        assert got[0][name].abs().sum() > 0, name
    assert got[0]["values"].shape == got[0]["entropies"].shape == (2, 2, rollouts.token_ids.shape[1])


def test_prepare_calls_no_model_and_samples_nothing():
    # the providers and prepare import no forward pass (those are the Learner's) and nothing of produce's but
    # its batch type (sampled inputs come with the batch) and the list of inputs the run provides (which both
    # phases read: produce samples some, prepare computes the rest)
    for path in sorted((ROOT / "posttrain" / "prepare").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posttrain."):
                names = {a.name for a in node.names}
                if node.module.startswith("posttrain.produce"):
                    assert names in ({"Batch"}, {"advantage_inputs"}), (path.name, node.module, names)
                assert node.module not in ("posttrain.learn.logprobs", "posttrain.learn.critic",
                                           "posttrain.learn.chunked"), (path.name, node.module)
