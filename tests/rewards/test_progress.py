"""The progress advantage step scorer (`algorithm.step_reward = "progress"`): the per-step sum of
beta * log pi_RL / pi_ref by hand, checked against plain forwards of both models, and a run with it."""

import json
import math

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.rewards.progress import ProgressScorer, progress, step_progress
from posttrain.train.rl import train


def test_step_progress_by_hand():
    # catalog 3.11: one 2-token step, (pi_RL, pi_ref) = (0.6, 0.3) and (0.5, 0.5), beta 1: log 2 + 0 = 0.693147
    lr = torch.tensor([math.log(0.6 / 0.3), math.log(0.5 / 0.5)])
    assert step_progress(lr, [2]) == pytest.approx([0.693147], abs=1e-6)
    # three tokens in two steps [0, 2) and [2, 3), beta 0.5: 0.5 * (0.1 + 0.2) = 0.15 and 0.5 * -0.4 = -0.2
    assert step_progress(torch.tensor([0.1, 0.2, -0.4]), [2, 3], beta=0.5) == pytest.approx([0.15, -0.2])
    assert step_progress(torch.tensor([0.3]), []) == []


def _two_models(tmp_path):
    ref = build_tiny(tmp_path / "ref", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1, seed=0))
    pol = build_tiny(tmp_path / "pol", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1, seed=1))
    return str(pol), str(ref)


def test_scores_are_the_step_sums_of_the_two_models_log_ratios(tmp_path):
    pol, ref = _two_models(tmp_path)
    got = progress("85+76=", "15,12>521", policy=pol, reference=ref, separator=",", beta=2.0)
    tok = load_tokenizer(pol)
    prompt = encode_chat(tok, "85+76=")
    ids = prompt + list(tok("15,12>521", add_special_tokens=False)["input_ids"])
    n = len(prompt)

    def token_logp(path):
        with torch.no_grad():
            logits = load_model(path)(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    lr = (token_logp(pol) - token_logp(ref))[n - 1 :]  # the 9 response tokens (char-level)
    want = [2.0 * float(lr[:3].sum()), 2.0 * float(lr[3:9].sum())]  # steps "15," and "12>521"
    assert got == pytest.approx(want, abs=1e-5) and len(got) == 2
    assert any(abs(x) > 1e-3 for x in got)  # two different models disagree
    # a model against itself makes no progress; a response without steps has none
    assert progress("85+76=", "15,12>521", policy=ref, reference=ref, separator=",") == pytest.approx([0.0, 0.0])
    assert progress("85+76=", "", policy=pol, reference=ref, separator=",") == []


def test_batched_scores_equal_one_by_one(tmp_path):
    pol, ref = _two_models(tmp_path)
    prompts, completions = ["85+76=", "21+43=", "5+5=", "99+1="], ["15,12>521", "4,", "", "10,9,1>001"]
    one = [progress(p, c, policy=pol, reference=ref, separator=",") for p, c in zip(prompts, completions, strict=True)]
    batched = ProgressScorer(pol, ref).score(prompts, completions, ",", beta=1.0, batch_size=3)
    assert [len(x) for x in batched] == [2, 1, 0, 3]
    for a, b in zip(one, batched, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_models_with_different_vocabularies_are_refused(tmp_path):
    pol, _ = _two_models(tmp_path)
    other = build_tiny(tmp_path / "other", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1, alphabet="ab"))
    with pytest.raises(Exception, match="vocabulary"):
        ProgressScorer(pol, str(other))


def test_training_with_progress_step_rewards(tiny_cfg, quiet, tmp_path):
    pol, ref = _two_models(tmp_path)
    common = ("task.params={digits=2, steps=true}", "rollout.max_new_tokens=10",
              'algorithm.shapers=[{name="prm_delta"}]', 'algorithm.step_reward="progress"', "checkpoint.every=0",
              "eval.prompts=4")
    with pytest.raises(ConfigError, match="fails on a training example's demonstration: TypeError"):
        train(tiny_cfg(*common), console=quiet)  # no policy / reference
    params = f'algorithm.step_reward_params={{policy="{pol}", reference="{ref}", separator=","}}'
    train(tiny_cfg("train.steps=2", *common, params), console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if r["step_reward/mean"] is not None]
    assert scored and all(r["step_reward/errors"] == 0 for r in scored)
