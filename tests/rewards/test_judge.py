"""The llm_judge reward: parsers, rubric rendering, a real tiny judge generating through the rollout
engine (what it generated is what was parsed), batching, the timeout, set-up errors and an RL run.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from posttrain.errors import ConfigError
from posttrain.models.load import ModelLoadError, encode_chat, load_tokenizer
from posttrain.models.tiny import PRINTABLE, TinySpec, build_tiny
from posttrain.rewards import score, score_batch
from posttrain.rewards.judge import (
    JudgeSettings,
    check,
    default_rubric,
    describe,
    judge_for,
    parse_regex,
    parse_score,
    parse_yes_no,
    render,
)
from posttrain.train.rl import train

SHORT = "Q:{prompt} A:{completion} R:{answer} ok?"  # a short rubric for the random judge
TEACH = "{prompt}{completion}?"  # the rubric the taught judge learned
TAUGHT = [("1+1=", "2", "Yes"), ("1+1=", "3", "No"), ("2+3=", "5", "Yes"), ("2+3=", "4", "No"),
          ("4+4=", "8", "Maybe")]


@pytest.fixture(scope="module")
def random_judge(tmp_path_factory):
    """A randomly initialised tiny causal LM: it writes garbage."""
    spec = TinySpec(alphabet=PRINTABLE, hidden_size=32, intermediate_size=64, num_layers=1, max_positions=512)
    return str(build_tiny(tmp_path_factory.mktemp("judge"), spec))


@pytest.fixture(scope="module")
def taught_judge(tmp_path_factory):
    """A tiny causal LM fine-tuned (SFT, a few hundred Adam steps) to answer TAUGHT's verdicts."""
    return teach(tmp_path_factory.mktemp("taught"), num_heads=4)


def teach(root, num_heads: int) -> str:
    """Build a tiny LM in ``root`` and fine-tune it (150 Adam steps) to answer TAUGHT's verdicts."""
    spec = TinySpec(alphabet=PRINTABLE, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=num_heads,
                    max_positions=96)
    path = build_tiny(root, spec)
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = []
    for p, c, verdict in TAUGHT:
        prompt = encode_chat(tok, render(TEACH, p, c))
        rows.append((prompt, tok(verdict, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
        attn[i, : len(p) + len(t)] = 1
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~10 ms a step; two threads on a shared 2-core machine took ~0.8 s
    try:
        for _ in range(150):
            opt.zero_grad()
            model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path)
    return str(path)


class Recorder:
    """Wraps a judge's public engine: every generate call, its prompts and what it generated."""

    def __init__(self, engine) -> None:
        self.inner = engine
        self.pad_id, self.version = engine.pad_id, engine.version
        self.calls: list[tuple[list[list[int]], object, list[str]]] = []

    def generate(self, prompts, sampling, seed=None):
        out = self.inner.generate(prompts, sampling, seed)
        self.calls.append(([list(p) for p in prompts], sampling, list(out.texts)))
        return out

    def sync(self, weights, version) -> None:
        self.inner.sync(weights, version)


def recorded(monkeypatch, params) -> tuple[Recorder, JudgeSettings]:
    settings = JudgeSettings.of(params)
    judge = judge_for(settings)
    rec = Recorder(judge.engine)
    monkeypatch.setattr(judge, "engine", rec)
    return rec, settings


def test_parsers_on_hand_examples():
    assert parse_yes_no("Yes") == 1.0 and parse_yes_no("No") == 0.0
    assert parse_yes_no("  no.") == 0.0 and parse_yes_no("Answer: YES, it is") == 1.0
    assert parse_yes_no("No, wait: yes") == 0.0  # the first whole word yes/no decides
    assert parse_yes_no("nope; yesterday") is None and parse_yes_no("q#8f") is None
    assert parse_score("Score: 7/10", 0, 10) == pytest.approx(0.7)  # 7 of "7/10" (the /10 is consumed)
    assert parse_score("7 out of 10", 0, 10) == pytest.approx(0.7)
    assert parse_score("Rating: [[4]] (of 10; 9 would be great)", 1, 10) == pytest.approx(3 / 9)  # [[s]] wins
    assert parse_score("first 2, then 9.5", 0, 10) == pytest.approx(0.95)  # the last number
    assert parse_score("on a 1-10 scale: 6", 0, 10) == pytest.approx(0.6)  # "-10" is no negative number
    assert parse_score("Score: 11", 0, 10) is None  # out of range
    assert parse_score("no digits here", 0, 10) is None and parse_score("q#@f", 0, 10) is None
    import re

    grade = re.compile(r"GRADE=(\d)")
    assert parse_regex("GRADE=3 ... GRADE=4", grade, 0, 4) == 1.0  # the last match, (4 - 0) / (4 - 0)
    assert parse_regex("grade 3", grade, 0, 4) is None
    s = JudgeSettings(path="x", parse="regex", pattern=r"(\w+)", min_score=0, max_score=1)
    assert s.score("it is not a number") is None  # a match that is no number


def test_rubric_rendering_and_defaults():
    assert render(SHORT, "1+1=", "2", "2") == "Q:1+1= A:2 R:2 ok?"
    assert render(SHORT, "p", "c") == "Q:p A:c R: ok?"  # no answer: the empty string
    assert render("{{json}} {prompt}", "p", "c") == "{json} p"  # doubled braces are literal
    yes_no = default_rubric("yes_no", 0, 10)
    assert "Answer with one word: Yes or No." in yes_no
    text = render(default_rubric("score", 1, 5), "What is 2+2?", "4", "4")
    assert "scale of 1 to 5" in text and "[[N]]" in text and "What is 2+2?" in text
    assert JudgeSettings(path="x").the_rubric == default_rubric("score", 0, 10)


def test_bad_params_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"unknown placeholder.*\{question\}.*\{prompt\}"):
        JudgeSettings(path="x", rubric="Q: {question} A: {completion}")
    with pytest.raises(ConfigError, match="not a valid template"):
        JudgeSettings(path="x", rubric="a lone } brace")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_new_token'\]"):
        JudgeSettings.of({"path": "x", "max_new_token": 4})
    with pytest.raises(ConfigError, match="params.path is required"):
        JudgeSettings.of({"parse": "yes_no"})
    for params, key in (({"parse": "likert"}, "parse"), ({"parse": "regex"}, "pattern"),
                        ({"pattern": "(x)"}, "pattern"), ({"parse": "regex", "pattern": "("}, "pattern"),
                        ({"samples": 4}, "samples"), ({"min_score": 5, "max_score": 5}, "max_score"),
                        ({"engine": "sglang"}, "engine"), ({"engine_params": {"kv_cache_gib": 2}}, "engine_params"),
                        ({"max_new_tokens": 0}, "max_new_tokens"), ({"batch_size": 0}, "batch_size"),
                        ({"timeout_s": 0}, "timeout_s"), ({"dtype": "int8"}, "dtype")):
        with pytest.raises(ConfigError, match=f"llm_judge's params.{key}"):
            JudgeSettings.of({"path": "x", **params})


def test_what_the_engine_generated_is_what_the_parse_received(monkeypatch, random_judge):
    params = {"path": random_judge, "rubric": SHORT, "parse": "yes_no", "max_new_tokens": 8}
    rec, settings = recorded(monkeypatch, params)
    prompts, completions, answers = ["1+1=", "2+2=", "3+3=", "9+9=", "5+1="], ["2", "5", "6", "x", "66"], list("24686")
    report = score_batch([("llm_judge", params)], prompts, completions, [{"answer": a} for a in answers])
    assert len(rec.calls) == 1  # the whole batch in one engine.generate call
    sent, sampling, texts = rec.calls[0]
    tok = judge_for(settings).tokenizer
    assert sent == [encode_chat(tok, render(SHORT, p, c, a))
                    for p, c, a in zip(prompts, completions, answers, strict=True)]
    assert sampling.temperature == 0.0 and sampling.n == 1 and sampling.max_new_tokens == 8
    assert report.values[0] == [parse_yes_no(t) for t in texts]  # exactly what was generated, parsed
    n_none = sum(v is None for v in report.values[0])
    assert n_none > 0  # a random judge writes garbage...
    assert report.errors == [n_none] and report.counts[0]["none"] == 0  # ...counted as errors, never a silent 0
    quoted = [f["message"] for f in report.failures]
    assert all("unparseable judgement" in m for m in quoted)
    assert all(repr(texts[f["index"]])[:40] in f["message"] for f in report.failures)  # the judge's own text
    again = score_batch([("llm_judge", params)], prompts, completions, [{"answer": a} for a in answers])
    assert again.values == report.values and rec.calls[1][2] == texts  # greedy: deterministic
    zero = score("llm_judge", prompts, completions, params={**params, "unparsed": 0.0}, answer=answers)
    assert zero == [0.0 if v is None else v for v in report.values[0]]  # the paper's "anything else -> 0"


def test_samples_are_averaged_and_batch_size_splits_calls(monkeypatch, random_judge):
    params = {"path": random_judge, "rubric": SHORT, "parse": "regex", "pattern": r"(\d)", "min_score": 0,
              "max_score": 9, "max_new_tokens": 12, "temperature": 1.0, "samples": 3, "batch_size": 2, "seed": 3}
    rec, settings = recorded(monkeypatch, params)
    prompts, completions = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="], ["2", "4", "6", "8", "10"]
    values = score("llm_judge", prompts, completions, params=params, answer=list("2468") + ["10"])
    assert [len(p) for p, _, _ in rec.calls] == [2, 2, 1]  # batch_size = 2: three generate calls
    texts = [t for _, _, out in rec.calls for t in out]
    assert len(texts) == 15 and all(s.n == 3 for _, s, _ in rec.calls)
    for i, v in enumerate(values):
        parsed = [x for x in (settings.score(t) for t in texts[3 * i : 3 * i + 3]) if x is not None]
        assert v == (pytest.approx(sum(parsed) / len(parsed)) if parsed else None)


def test_a_taught_judge_says_yes_and_no_end_to_end(taught_judge):
    params = {"path": taught_judge, "rubric": TEACH, "parse": "yes_no", "max_new_tokens": 6}
    prompts, completions = [p for p, _, _ in TAUGHT], [c for _, c, _ in TAUGHT]
    report = score_batch([("llm_judge", params)], prompts, completions, [{} for _ in prompts])
    assert report.values == [[1.0, 0.0, 1.0, 0.0, None]]  # "Maybe" does not parse
    assert report.errors == [1] and "'Maybe'" in report.failures[0]["message"]


def test_a_slow_judge_times_out_the_batch_and_recovers(monkeypatch, random_judge):
    params = {"path": random_judge, "rubric": SHORT, "max_new_tokens": 60, "timeout_s": 0.3}
    judge = judge_for(JudgeSettings.of(params))
    forwards = []

    def slow(module, args):
        forwards.append(time.monotonic())
        time.sleep(0.05)

    handle = judge.model.get_input_embeddings().register_forward_pre_hook(slow, prepend=True)
    try:
        start = time.monotonic()
        report = score_batch([("llm_judge", params)], ["1+1=", "2+2="], ["2", "4"], [{}, {}])
        assert time.monotonic() - start < 1.5  # 60 forwards x 50 ms would take 3 s
        assert report.values == [[None, None]] and report.timeouts == [2] and report.errors == [0]
        assert "took longer than timeout_s = 0.3" in report.failures[0]["message"]
        time.sleep(0.5)  # the next forward pass raises (JudgeCancelled) in the judge's worker thread
        stopped_at = len(forwards)
        time.sleep(0.2)
        assert len(forwards) == stopped_at < 20  # the abandoned generation was stopped, not left running
    finally:
        handle.remove()
    ok = score_batch([("llm_judge", params)], ["1+1=", "2+2="], ["2", "4"], [{}, {}])
    assert ok.timeouts == [0]  # the judge works again
    # no worker thread outlives its call: one that ran torch's kernels and stayed alive slowed the main
    # thread's training ~1.4x for the rest of the process
    def judge_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("llm-judge")]

    for thread in judge_threads():
        thread.join(timeout=5)
    assert not judge_threads()


def test_a_pair_too_long_for_the_judge_fails_alone(random_judge):
    params = {"path": random_judge, "rubric": SHORT, "max_new_tokens": 8, "unparsed": 0.5}
    report = score_batch([("llm_judge", params)], ["1+1=", "2+2="], ["2", "4" * 600], [{}, {}])
    assert report.values[0][0] is not None and report.values[0][1] is None
    assert report.errors == [1] and "does not fit the judge's context of 512" in report.failures[0]["message"]


def test_describe_checks_and_loads_at_setup(tmp_path, random_judge):
    line = describe({"path": random_judge, "rubric": SHORT, "timeout_s": 5})
    assert "reward 'llm_judge': judge" in line and "context 512" in line and "timeout 5 s" in line
    with pytest.raises(ModelLoadError, match=r"^llm_judge's params.path: model path .* does not exist"):
        describe({"path": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"\{question\}"):
        describe({"path": random_judge, "rubric": "{question}"})
    check({"path": random_judge, "parse": "yes_no"})  # the load-free check, for config time
    with pytest.raises(ModelLoadError, match="llm_judge's params.path"):
        check({"path": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="params.samples"):
        check({"path": random_judge, "samples": 2})


def test_a_bad_judge_is_a_config_error_before_any_model_loads(tiny_cfg, tmp_path):
    missing = tmp_path / "no_judge"
    with pytest.raises(ConfigError, match=r"reward\[0\].params \(llm_judge\): llm_judge's params.path"):
        tiny_cfg("train.steps=2", "checkpoint.every=0", f'reward=[{{name="llm_judge", params={{path="{missing}"}}}}]')
    with pytest.raises(ConfigError, match="unknown placeholder"):
        tiny_cfg(f'reward=[{{name="llm_judge", params={{path="{tmp_path}", rubric="{{bogus}}"}}}}]')
    assert not (tmp_path / "run").exists()


def test_two_step_rl_run_with_the_judge(tiny_cfg, tmp_path, monkeypatch, taught_judge):
    params = {"path": taught_judge, "rubric": TEACH, "parse": "yes_no", "max_new_tokens": 4}
    rec, settings = recorded(monkeypatch, params)
    reward = f'reward=[{{name="llm_judge", params={{path="{taught_judge}", rubric="{TEACH}", parse="yes_no", ' \
             'max_new_tokens=4}}]'
    console = Console(record=True, width=300)
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "log.samples_every=1", "log.samples=32", reward)
    train(cfg, console=console)
    assert "reward 'llm_judge': judge" in console.export_text()
    assert [len(p) for p, _, _ in rec.calls] == [32, 32]  # one generate call per step: 8 prompts x 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["reward/llm_judge/mean"]) for r in rows)
    failures = tmp_path / "run" / "reward_failures.jsonl"
    logged = len(failures.read_text().splitlines()) if failures.exists() else 0
    assert sum(r["reward/llm_judge/errors"] for r in rows) == logged
    # every logged sample's reward is the parse of what the judge wrote for it (None -> 0, scoring.on_error)
    tok = judge_for(settings).tokenizer
    judged = {tuple(p): t for sent, _, texts in rec.calls for p, t in zip(sent, texts, strict=True)}
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64
    for s in samples:
        text = judged[tuple(encode_chat(tok, render(TEACH, s["prompt"], s["completion"], s["answer"])))]
        assert s["reward"] == (parse_yes_no(text) or 0.0)
