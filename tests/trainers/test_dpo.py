"""The DPO-family trainer (`posttrain dpo`): file pairs, task pairs, the step-1 loss, config errors, resume.

INPO and Ra-DPO (extra inputs) are in test_dpo_methods.py."""

import json
import math

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.data import DataError
from posttrain.models.load import encode_chat
from posttrain.rollout import Rollout
from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
from posttrain.run.setup import open_run
from posttrain.seeds import derive_seed
from posttrain.tasks import make_task
from posttrain.trainers.dpo import dpo_train
from posttrain.trainers.dpo_pairs import read_pairs, task_pairs

FIELDS = "dpo.fields={prompt='q', chosen='good', rejected='bad'}"


def rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_file_pairs_raise_the_preference_for_chosen(tiny_cfg, quiet, tmp_path, pairs_file):
    cfg = tiny_cfg("dpo.pairs=file", f'dpo.path="{pairs_file}"', FIELDS, "dpo.steps=20", "dpo.lr=1e-3",
                   "dpo.warmup_steps=0", "dpo.batch_size=8", "checkpoint.every=0")
    summary = dpo_train(cfg, console=quiet)
    r = rows(tmp_path / "run")
    # step 1: policy == reference, so m_w = m_l = 0, h = 0 and the dpo loss is -log sigmoid(0) = log 2
    assert r[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert r[0]["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-5)  # (accuracy counts h > 0: noise at h = 0)
    margins = [x["dpo/reward_margin"] for x in r]
    assert all(b > a for a, b in zip(margins, margins[1:], strict=False)), margins  # every step widens the margin
    assert r[-1]["dpo/accuracy"] == 1.0 and r[-1]["dpo/loss"] < 0.5
    assert r[-1]["dpo/chosen_logratio"] > r[-1]["dpo/rejected_logratio"]
    assert r[-1]["dpo/pairs"] == 5 and summary["pairs_used"] == 100 and summary["steps"] == 20
    assert (tmp_path / "run" / "checkpoints" / "step_000020" / "model.safetensors").exists()


def test_other_losses_train_from_a_csv(dpo_pairs, tiny_cfg, quiet, tmp_path):
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected\n" + "\n".join(f"{p['q']},{p['good']},{p['bad']}" for p in dpo_pairs))
    for loss in ("ipo", "cpl"):
        cfg = tiny_cfg("dpo.pairs=file", f'dpo.path="{csv}"', f"dpo.loss={loss}", "dpo.steps=3",
                       "checkpoint.every=0", out=str(tmp_path / loss))
        dpo_train(cfg, console=quiet)
        assert all(math.isfinite(x["dpo/loss"]) for x in rows(tmp_path / loss))
    # ipo at h = 0: (0 - 1/(2*0.1))^2 = 25
    assert rows(tmp_path / "ipo")[0]["dpo/loss"] == pytest.approx(25.0, abs=1e-3)


def test_read_pairs_names_a_missing_column(tiny_cfg, tmp_path, pairs_file):
    opened = open_run(tiny_cfg(), False)
    pairs = read_pairs(str(pairs_file), opened.tokenizer, fields={"prompt": "q", "chosen": "good", "rejected": "bad"})
    eos = opened.tokenizer.eos_token_id
    assert len(pairs) == 5 and pairs[0].chosen[-1] == eos and pairs[0].rejected[-1] == eos
    assert opened.tokenizer.decode(pairs[0].chosen[:-1]) == "64"
    with pytest.raises(DataError, match="'prompt'.*'prompt'.*missing"):
        read_pairs(str(pairs_file), opened.tokenizer)


class ScriptedEngine:
    """Returns fixed texts per prompt (tokenized, EOS-terminated) instead of sampling."""

    def __init__(self, tokenizer, texts_per_prompt):
        self.tok, self.texts = tokenizer, texts_per_prompt

    def generate(self, prompts, sampling, seed=None):
        flat = [t for ts in self.texts for t in ts]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in flat]
        width = max(map(len, ids))
        ids_NT = torch.tensor([x + [self.tok.pad_token_id] * (width - len(x)) for x in ids])
        mask_NT = torch.tensor([[1.0] * len(x) + [0.0] * (width - len(x)) for x in ids])
        return Rollout.single_turn(prompts, ids_NT, mask_NT, torch.zeros_like(mask_NT),
                                   torch.ones(len(ids), dtype=torch.bool), flat, sampling.n)


def test_task_pairs_rule(tiny_cfg):
    opened = open_run(tiny_cfg(), False)
    tok, task = opened.tokenizer, make_task("arithmetic", digits=2, ops="+", reverse=True)
    exs = task.examples("train", 3, seed=0)  # answers "09", "301", "86"
    scripted = [["1", "09", "7"], ["2", "3"], ["86", "86"]]  # correct at index 1; none correct; all correct
    pairs, stats = task_pairs(ScriptedEngine(tok, scripted), tok, task, exs[:1], group_size=3, max_new_tokens=6)
    assert [tok.decode(pairs[0].chosen[:-1]), tok.decode(pairs[0].rejected[:-1])] == ["09", "1"]
    for i, expect in ((1, ["301", "2"]), (2, None)):  # no correct sample -> the demonstration is chosen
        got, stats = task_pairs(ScriptedEngine(tok, [scripted[i]]), tok, task, exs[i : i + 1], group_size=2,
                                max_new_tokens=6)
        assert ([tok.decode(got[0].chosen[:-1]), tok.decode(got[0].rejected[:-1])] if got else None) == expect
    assert stats["dpo/pair_prompts"] == 0.0  # all correct: no pair


def test_task_pairs_from_the_tiny_policy_are_valid(tiny_cfg, quiet, tmp_path):
    cfg = tiny_cfg("dpo.steps=2", "dpo.prompts_per_refresh=16", "dpo.group_size=4", "dpo.eval_every=2",
                   "dpo.eval_prompts=8", "checkpoint.every=0")
    dpo_train(cfg, console=quiet)
    r = rows(tmp_path / "run")
    assert r[0]["dpo/pair_prompts"] > 0.5 and "eval/pass@1" in r[1]
    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    tok = open_run(tiny_cfg(out=str(tmp_path / "other")), False).tokenizer
    exs = task.examples("train", 16, seed=derive_seed(0, "dpo-pairs", 0))  # the prompts of the refresh at step 0
    by_ids = {tuple(encode_chat(tok, ex.prompt)): ex for ex in exs}
    pool = load_trainer_state(latest_checkpoint(tmp_path / "run" / "checkpoints"))["loop"]["pool"]
    checked = 0
    for prompt_ids, chosen, rejected in pool:
        ex = by_ids[tuple(prompt_ids)]
        text = [tok.decode(c, skip_special_tokens=True) for c in (chosen, rejected)]
        assert task.verify(text[0], ex) == 1.0 and task.verify(text[1], ex) == 0.0, text
        checked += 1
    assert checked >= 3


def test_config_errors(tiny_cfg):
    with pytest.raises(ConfigError, match=r"unknown preference loss 'dpoo'.*choices.*'ipo'"):
        tiny_cfg("dpo.loss=dpoo")
    with pytest.raises(ConfigError, match=r"has no parameter\(s\) \['alpha'\]"):
        tiny_cfg("dpo.loss_params={alpha=1.0}")
    with pytest.raises(ConfigError, match="dpo.path go together"):
        tiny_cfg("dpo.pairs=file")
    with pytest.raises(ConfigError, match="unknown target"):
        tiny_cfg("dpo.fields={question='q'}")


def test_resume_continues_the_same_run(tiny_cfg, quiet, tmp_path):
    # task pairs rebuilt at steps 0 and 3: the resumed run must reuse the saved pool, then rebuild
    common = ("dpo.prompts_per_refresh=8", "dpo.group_size=4", "dpo.refresh_every=3", "dpo.batch_size=4",
              "checkpoint.every=1")
    dpo_train(tiny_cfg("dpo.steps=4", *common, out=str(tmp_path / "full")), console=quiet)
    dpo_train(tiny_cfg("dpo.steps=2", *common, out=str(tmp_path / "cut")), console=quiet)
    summary = dpo_train(tiny_cfg("dpo.steps=4", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)
    assert summary["steps"] == 4

    def strip(run):
        return [{k: v for k, v in x.items() if not k.startswith("time/")} for x in rows(run)]

    full, cut = strip(tmp_path / "full"), strip(tmp_path / "cut")
    assert [x["step"] for x in cut] == [1, 2, 3, 4] and "dpo/pair_prompts" in cut[3]
    for a, b in zip(full, cut, strict=True):
        assert a.keys() == b.keys()
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a), (a, b)
