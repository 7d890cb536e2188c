"""CRM / CRF (Wang et al. 2025, arXiv:2511.09158; catalog L195): R^ = R^o [1 + alpha c (s + d_q)]."""

import json
import math

import pytest

from posttrain.config import load_config
from posttrain.errors import ConfigError
from posttrain.rewards import REGISTRY, Outcome, score
from posttrain.rewards.conciseness import check, component_params, crf_reward, length_conciseness
from posttrain.train import rl
from tests.conftest import ROOT


def _answer_is_a(prompt, completion, **_):
    # a stand-in verifier: correct when the completion starts with "a"
    return float(completion.startswith("a"))


def _rm_stub(prompts, completions, **_):
    # a stand-in batched conciseness model (a CRM's logit): minus the length in whole hundreds of characters
    _rm_stub.calls += 1
    return [-float(len(c) // 100) for c in completions]


_rm_stub.batched = True
_rm_stub.calls = 0


@pytest.fixture
def stubs(monkeypatch):
    monkeypatch.setitem(REGISTRY._entries, "test_answer_is_a", _answer_is_a)
    monkeypatch.setitem(REGISTRY._entries, "test_rm_stub", _rm_stub)


def _crf(completions, **params):
    return crf_reward(["q"] * len(completions), completions, outcome="test_answer_is_a", **params)


def test_length_proxy_hand_computed():
    # c = clamp(1 - n / max_chars, 0.1, 1): 100/1000 -> 0.9, 400/1000 -> 0.6, 950/1000 -> 0.05 -> 0.1, "" -> 1
    for n, want in ((100, 0.9), (400, 0.6), (950, 0.1), (0, 1.0), (5000, 0.1)):
        assert length_conciseness("q", "x" * n, max_chars=1000) == pytest.approx(want)
    with pytest.raises(ValueError, match="max_chars"):
        length_conciseness("q", "x", max_chars=0)


def test_crf_hand_computed(stubs):
    # outcomes [1, 1, 0, 0] ("a..." is correct), lengths [100, 400, 100, 900] of max 1000 -> c [0.9, 0.6, 0.9, 0.1]
    # alpha = s = 1, d_q = 0: R^ = R^o (1 + c) = [1.9, 1.6, 0, 0]
    texts = ["a" * 100, "a" * 400, "b" * 100, "b" * 900]
    got = _crf(texts, conciseness_max_chars=1000)
    assert got == pytest.approx([1.9, 1.6, 0.0, 0.0])
    # alpha = 0.5, s = 0.2, d_q = 5 / 10 = 0.5: 1 + 0.5 * 0.9 * 0.7 = 1.315; 1 + 0.5 * 0.6 * 0.7 = 1.21
    got = _crf(texts, conciseness_max_chars=1000, alpha=0.5, s=0.2, difficulty_field="level", difficulty_scale=10.0,
               level=[5, 5, 5, 5])
    assert got == pytest.approx([1.315, 1.21, 0.0, 0.0])


def test_incorrect_answers_get_no_conciseness_credit(stubs):
    # the catalog's test (L195): an incorrect answer scores 0 for any c, alpha, s, d_q; an additive length bonus
    # r + alpha c would pay the shortest wrong answer the most
    for n in (0, 1, 10, 500, 5000):
        for alpha, s, d in ((1.0, 1.0, 0.0), (3.0, 0.5, 1.0), (0.1, 2.0, 0.3)):
            (r,) = _crf(["b" * n], conciseness_max_chars=1000, alpha=alpha, s=s, difficulty_field="d", d=[d])
            assert r == 0.0
    wrong = ["b", "b" * 500]
    additive = [0.0 + length_conciseness("q", t, max_chars=1000) for t in wrong]
    assert additive[0] > additive[1] > 0  # the additive form ranks a short wrong answer above a long one
    assert _crf(wrong, conciseness_max_chars=1000) == [0.0, 0.0]


def test_invariants(stubs):
    texts = ["a" * n for n in (10, 200, 600, 990)] + ["b" * n for n in (10, 990)]
    got = _crf(texts, conciseness_max_chars=1000, alpha=2.0, s=0.5)
    correct, wrong = got[:4], got[4:]
    # every correct answer outranks every wrong one (R^ >= R^o = 1 > 0), shorter correct answers score more,
    # and a correct answer's reward stays within [1 + alpha s 0.1, 1 + alpha s] = [1.1, 2]
    assert min(correct) > max(wrong)
    assert correct == sorted(correct, reverse=True)
    assert all(1.1 - 1e-9 <= r <= 2.0 + 1e-9 for r in correct)
    # alpha = 0 is the bare outcome
    assert _crf(texts, conciseness_max_chars=1000, alpha=0.0) == [1.0] * 4 + [0.0] * 2


def test_batched_conciseness_model_and_sigmoid(stubs):
    # a batched c (a CRM through reward_model) scores the whole batch in one call; its logit goes through the
    # sigmoid onto [0.1, 1]: lengths 1 and 200 -> logits 0, -2 -> c = 0.1 + 0.9 sigmoid(.) = 0.55, 0.207283
    # (sigmoid(-2) = 0.119203)
    _rm_stub.calls = 0
    got = _crf(["a", "a" * 200, "b"], conciseness="test_rm_stub", c_transform="sigmoid")
    assert _rm_stub.calls == 1
    c2 = 0.1 + 0.9 / (1 + math.exp(2.0))
    assert got == pytest.approx([1.55, 1.0 + c2, 0.0])
    assert c2 == pytest.approx(0.207283, abs=1e-6)
    # "clamp" keeps a logit of -2 at the floor 0.1
    assert _crf(["a" * 200], conciseness="test_rm_stub") == pytest.approx([1.1])


def test_a_failed_component_scores_none_with_its_reason(stubs, monkeypatch):
    def broken(prompt, completion, **_):
        raise RuntimeError("no verdict")

    monkeypatch.setitem(REGISTRY._entries, "test_broken", broken)
    got = crf_reward(["q", "q"], ["a", "b"], outcome="test_broken")
    assert all(isinstance(o, Outcome) and o.value is None and "no verdict" in o.message for o in got)
    # through the protected path the run goes on: both score None
    assert score("crf", ["q", "q"], ["a", "b"], params={"outcome": "test_broken"}, workers=0) == [None, None]
    with pytest.raises(ValueError, match="its own"):
        crf_reward(["q"], ["a"], conciseness="crf")
    with pytest.raises(ValueError, match="rename the field"):  # a dataset column named like a parameter
        crf_reward(["q"], ["a"], outcome="test_answer_is_a", s=[0.5])


def test_component_params_and_config_check(stubs):
    own, rest = component_params({"conciseness_max_chars": 8, "outcome_timeout_s": 2.0, "alpha": 1.0, "answer": [1]})
    assert own == {"outcome": {"timeout_s": 2.0}, "conciseness": {"max_chars": 8}}
    assert rest == {"alpha": 1.0, "answer": [1]}
    check({"outcome": "math", "conciseness_max_chars": 8})
    for bad, match in (({"outcome": "crf"}, "other than 'crf'"), ({"conciseness": "nope"}, "registered reward"),
                       ({"c_transform": "tanh"}, "c_transform"), ({"difficulty_scale": 0}, "difficulty_scale"),
                       ({"beta": 1.0}, "unknown parameter")):
        with pytest.raises(ValueError, match=match):
            check(bad)
    with pytest.raises(ConfigError, match="reward\\[0\\].params \\(crf\\)"):
        load_config(ROOT / "recipes" / "crf.toml", ['reward=[{name="crf", params={outcome="crf"}}]'])


def test_crf_recipe_smoke(tmp_path, quiet):
    # two GRPO steps of recipes/crf.toml on the tiny model: finite loss, and every logged reward is a CRF value
    cfg = load_config(ROOT / "recipes" / "crf.toml", [
        f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0", "eval.every=0"])
    rl.train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
