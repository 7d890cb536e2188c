"""The process reward model step scorer (`algorithm.step_reward = "prm"`): step boundaries, the
score read at each step's last token (checked against a plain forward), and a run with it."""

import json

import pytest
import torch
from transformers import AutoModelForTokenClassification

from posttrain.config import ConfigError
from posttrain.models import TinySpec, build_tiny, encode_chat, load_tokenizer
from posttrain.rewards.prm import ProcessRewardModel, prm, split_after
from posttrain.train.rl import train


def test_split_after_by_hand():
    assert split_after("15,12>521", ",") == [3, 9]  # "15," then "12>521"
    assert split_after("a,b,", ",") == [2, 4]
    assert split_after("x\n\ny\n", "\n") == [2, 5]  # the empty line is not a step
    assert split_after("", ",") == [] and split_after(" ,", ",") == []


def make_prm(tmp_path, labels):
    base = build_tiny(tmp_path / "base", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    torch.manual_seed(0)  # the new head's initialisation
    model = AutoModelForTokenClassification.from_pretrained(str(base), num_labels=labels)
    out = tmp_path / f"prm{labels}"
    model.save_pretrained(out)
    load_tokenizer(str(base)).save_pretrained(out)
    return str(out), model.eval()


@pytest.mark.parametrize("labels", [1, 2])
def test_scores_are_read_at_each_steps_last_token(tmp_path, labels):
    path, model = make_prm(tmp_path, labels)
    tok = load_tokenizer(path)
    got = prm("85+76=", "15,12>521", path=path, separator=",")
    ids = encode_chat(tok, "85+76=") + list(tok("15,12>521", add_special_tokens=False)["input_ids"])
    n = len(encode_chat(tok, "85+76="))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    at = [n + 3 - 1, n + 9 - 1]  # char-level: "15," ends at response char 3, "12>521" at 9
    if labels == 1:
        want = torch.sigmoid(logits[at, 0])
    else:
        want = torch.softmax(logits[at], -1)[:, 1]
    assert got == pytest.approx(want.tolist(), abs=1e-6) and len(got) == 2
    assert prm("85+76=", "", path=path, separator=",") == []


def test_a_head_of_three_is_refused(tmp_path):
    path, _ = make_prm(tmp_path, 3)
    with pytest.raises(Exception, match="1 or 2"):
        ProcessRewardModel(path)


def test_training_with_a_prm(tiny_cfg, quiet, tmp_path):
    path, _ = make_prm(tmp_path, 1)
    common = ("task.params={digits=2, steps=true}", "rollout.max_new_tokens=10",
              'algorithm.shapers=[{name="prm_clip"}]', 'algorithm.step_reward="prm"', "checkpoint.every=0",
              "eval.prompts=4")
    with pytest.raises(ConfigError, match="fails on a training example's demonstration: TypeError"):
        train(tiny_cfg(*common), console=quiet)  # no path
    cfg = tiny_cfg("train.steps=2", *common, f'algorithm.step_reward_params={{path="{path}", separator=","}}')
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if r["step_reward/mean"] is not None]  # null: no response wrote a step
    assert scored and all(0 < r["step_reward/mean"] < 1 and r["step_reward/errors"] == 0 for r in scored)


def test_batched_scores_equal_one_by_one(tmp_path):
    from posttrain.rewards.steps import score_steps

    path, _ = make_prm(tmp_path, 1)
    prompts = ["85+76=", "21+43=", "5+5=", "99+1="]
    completions = ["15,12>521", "4,", "", "10,9,1>001"]  # different lengths, one without steps
    one = [prm(p, c, path=path, separator=",") for p, c in zip(prompts, completions, strict=True)]
    batched = ProcessRewardModel(path).score(prompts, completions, ",", batch_size=3)
    assert [len(x) for x in batched] == [2, 1, 0, 3]
    for a, b in zip(one, batched, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    values, mask, errors = score_steps("prm", {"path": path, "separator": ","}, prompts, completions, [{}] * 4)
    assert errors == 0 and mask.sum(1).tolist() == [2, 1, 0, 3]
    assert values[0, :2].tolist() == pytest.approx(one[0], abs=1e-5)
