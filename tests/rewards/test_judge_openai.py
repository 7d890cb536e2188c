"""``llm_judge`` with ``api_base``: the judge behind an OpenAI-compatible server. Against ``posttrain serve``
over the taught tiny judge (the same verdicts as the judge loaded here, the API key, a two-step RL run) and
against a scripted server on loopback (several judgements averaged, 5xx recovered, hangs, garbage, a
server that is gone), and the config errors.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from rich.console import Console

from posttrain.errors import ConfigError
from posttrain.models.load import load_model, load_tokenizer
from posttrain.rewards import score_batch
from posttrain.rewards.judge import check, describe, parse_yes_no
from posttrain.rollout import make_engine
from posttrain.serve.protocol import Limits
from posttrain.serve.server import ServeApp, ServeSettings, start
from posttrain.train.rl import train
from tests.rewards.loopback import Loopback, Reply, as_json
from tests.rewards.test_judge import TAUGHT, TEACH, teach

KEY = "judge-key-42"
PROMPTS, COMPLETIONS = [p for p, _, _ in TAUGHT], [c for _, c, _ in TAUGHT]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    return teach(tmp_path_factory.mktemp("taught"), num_heads=4)


@pytest.fixture(scope="module")
def served(taught):
    """``posttrain serve``'s app over the taught judge on a free loopback port, with an API key; the URL and
    the texts it generated, one list a request.
    """
    tok = load_tokenizer(taught)
    texts: list[list[str]] = []
    app = ServeApp(make_engine("hf", load_model(taught).eval(), tok), tok,
                   ServeSettings(model_name="judge", api_key=KEY, limits=Limits(max_tokens=16, max_n=4),
                                 batch_wait_s=0.01), context=96,
                   record=lambda req, samples: texts.append([tok.decode(s.token_ids, skip_special_tokens=True)
                                                              for s in samples]))
    server, _ = start(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", texts
    server.shutdown()
    app.close()


def judged(params: dict, n: int = len(PROMPTS)):
    return score_batch([("llm_judge", params)], PROMPTS[:n], COMPLETIONS[:n], [{} for _ in range(n)])


def test_the_served_judge_gives_the_local_judges_verdicts(served, taught, monkeypatch):
    served, _ = served
    monkeypatch.setenv("JUDGE_KEY", KEY)
    common = {"rubric": TEACH, "parse": "yes_no", "max_new_tokens": 6}
    local = judged({"path": taught, **common})
    remote = judged({"api_base": served, "model": "judge", "api_key_env": "JUDGE_KEY", "max_concurrency": 3,
                     **common})
    assert local.values == remote.values == [[1.0, 0.0, 1.0, 0.0, None]]  # "Maybe" does not parse
    assert remote.errors == [1] and "'Maybe'" in remote.failures[0]["message"]
    line = describe({"api_base": served, "model": "judge", "api_key_env": "JUDGE_KEY", **common})
    assert f"judge 'judge' at {served}/chat/completions, key from $JUDGE_KEY" in line and KEY not in line


def test_a_wrong_key_is_a_401_not_retried(served, monkeypatch):
    served, _ = served
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    report = judged({"api_base": served, "model": "judge", "api_key_env": "JUDGE_KEY", "retries": 3})
    assert report.values == [[None] * 5] and report.errors == [5]
    assert "HTTP 401" in report.failures[0]["message"] and "not retried" in report.failures[0]["message"]


def test_two_step_rl_run_with_the_served_judge(served, tiny_cfg, tmp_path, monkeypatch):
    served, texts = served
    before = len(texts)
    monkeypatch.setenv("JUDGE_KEY", KEY)
    console = Console(record=True, width=300)
    reward = (f'reward=[{{name="llm_judge", params={{api_base="{served}", model="judge", api_key_env="JUDGE_KEY", '
              f'rubric="{TEACH}", parse="yes_no", max_new_tokens=4, max_concurrency=8}}}}]')
    train(tiny_cfg("train.steps=2", "checkpoint.every=0", reward), console=console)
    assert "reward 'llm_judge': judge 'judge' at" in console.export_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward/llm_judge/mean"]) for r in rows)
    assert all(r["reward/llm_judge/timeouts"] == 0 for r in rows)
    failures = tmp_path / "run" / "reward_failures.jsonl"
    logged = [json.loads(line) for line in failures.read_text().splitlines()] if failures.exists() else []
    assert sum(r["reward/llm_judge/errors"] for r in rows) == len(logged)  # unparseable verdicts, each logged
    assert all("unparseable judgement" in f["message"] for f in logged)
    sent = texts[before:]
    assert len(sent) == 64  # one request a pair: 8 prompts x 4 samples x 2 steps
    # what the server generated decides the reward: the pairs whose text has no yes/no are the logged ones
    assert sum(parse_yes_no(t[0]) is None for t in sent) == len(logged)


def chat(*contents: str | None) -> dict:
    return {"choices": [{"index": i, "message": {"role": "assistant", "content": c}} for i, c in enumerate(contents)]}


@pytest.fixture
def fake():
    server = Loopback(lambda body, path: as_json(200, chat("Rating: [[7]]")))
    yield server
    server.stop()


def api(fake: Loopback, **extra) -> dict:
    return {"api_base": fake.url + "/v1", "model": "gpt-judge", "backoff_s": 0.01, **extra}


def test_the_request_and_several_judgements_averaged(fake):
    fake.answer = lambda body, path: as_json(200, chat("Rating: [[8]]", "7/10", "no idea"))
    report = judged(api(fake, system="Be strict.", temperature=0.7, samples=3, seed=5, max_new_tokens=9), n=2)
    assert report.values == [[pytest.approx(0.75)] * 2]  # (0.8 + 0.7) / 2; "no idea" does not parse
    req = fake.requests[0]
    assert req["path"] == "/v1/chat/completions" and "Authorization" not in req["headers"]
    body = req["body"]
    assert (body["model"], body["n"], body["seed"], body["max_tokens"], body["temperature"]) == \
        ("gpt-judge", 3, 5, 9, 0.7)
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert body["messages"][1]["role"] == "user" and PROMPTS[0] in body["messages"][1]["content"]


def test_5xx_is_retried_and_recovers_then_fails_past_the_retries(fake):
    seen = []

    def flaky(body, path):
        seen.append(1)
        return Reply(502, b"bad gateway") if len(seen) <= 2 else as_json(200, chat("Rating: [[10]]"))

    fake.answer = flaky
    assert judged(api(fake, retries=2), n=1).values == [[1.0]] and len(seen) == 3
    fake.answer = lambda body, path: Reply(500, b"boom")
    report = judged(api(fake, retries=1), n=2)
    assert report.values == [[None, None]] and report.errors == [2]
    assert "HTTP 500" in report.failures[0]["message"] and "after 2 attempt(s)" in report.failures[0]["message"]


def test_a_hung_judge_times_out_each_pair(fake):
    fake.answer = lambda body, path: Reply(200, json.dumps(chat("Rating: [[7]]")).encode(), delay_s=3.0)
    t0 = time.monotonic()
    report = judged(api(fake, timeout_s=0.3, retries=0, max_concurrency=5))
    assert report.values == [[None] * 5] and report.timeouts == [5]
    assert time.monotonic() - t0 < 2.0  # five pairs at once, each given up after 0.3 s


@pytest.mark.parametrize(("reply", "reason"), [
    (Reply(200, b"<html>oops</html>"), "not JSON"),
    (as_json(200, {"object": "chat.completion"}), "malformed answer"),
    (as_json(200, {"choices": []}), "malformed answer"),
    (as_json(200, {"choices": [{"message": {"content": 7}}]}), "content is not a string"),
    (as_json(200, chat("I cannot judge this")), "unparseable judgement"),
    (as_json(200, chat(None)), "unparseable judgement"),
])
def test_hostile_answers_fail_their_pair_with_the_reason(fake, reply, reason):
    fake.answer = lambda body, path: reply
    report = judged(api(fake), n=2)
    assert report.values == [[None, None]] and report.errors == [2]
    assert reason in report.failures[0]["message"]


def test_a_judge_server_that_is_gone(fake):
    fake.stop()
    report = judged(api(fake, retries=1), n=2)
    assert report.values == [[None, None]] and "ConnectionRefused" in report.failures[0]["message"]


@pytest.mark.parametrize(("params", "match"), [
    ({"api_base": "ftp://h/v1", "model": "m"}, "api_base = 'ftp://h/v1': the scheme must be http or https"),
    ({"api_base": "http://h/v1"}, "params.model = None: a judge behind api_base needs"),
    ({"api_base": "http://h/v1", "model": "m", "path": "x"}, r"\['path'\] do\(es\) not apply to a judge behind"),
    ({"api_base": "http://h/v1", "model": "m", "device": "cuda"}, r"\['device'\] do\(es\) not apply"),
    ({"path": "x", "model": "m"}, r"\['model'\] do\(es\) not apply to a judge loaded here"),
    ({"api_base": "http://h/v1", "model": "m", "max_concurrency": 0}, "max_concurrency = 0: expected an integer > 0"),
    ({"api_base": "http://h/v1", "model": "m", "retries": 1.5}, "retries = 1.5: expected an integer >= 0"),
    ({"model": "m"}, "params.path is required"),
])
def test_bad_params_are_config_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        check(params)


def test_a_missing_key_variable_stops_the_run_at_start_up(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="NO_SUCH_KEY is not set"):
        describe({"api_base": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "NO_SUCH_KEY"})
