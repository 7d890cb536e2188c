"""The ``http`` reward against a server on loopback that answers well, fails and recovers, hangs,
trickles, answers garbage or is gone; a burst under the concurrency bound; config errors; and RL runs,
one of which loses its reward server for two steps and gets it back.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.errors import ConfigError
from posttrain.rewards import score_batch
from posttrain.rewards.remote import check, describe
from posttrain.rewards.wire import retry_after
from posttrain.train.rl import train
from tests.rewards.loopback import Loopback, Reply, as_json, good, rule

PROMPTS = [f"{i}+1=" for i in range(10)]
COMPLETIONS = ["2", "33", "4x", "", "5555", "6", "77", "8", "9", "10"]
ANSWERS = [str(i + 1) for i in range(10)]


def rows(n: int = 10) -> list[dict]:
    return [{"prompt": p, "completion": c, "answer": a}
            for p, c, a in zip(PROMPTS, COMPLETIONS, ANSWERS, strict=True)][:n]


def scored(server: Loopback, n: int = 10, **params):
    """score_batch with the http reward on the first ``n`` samples, each with an ``answer`` field and the
    trainer's object fields (which must not be sent).
    """
    fields = [{"answer": a, "example": object(), "task": object()} for a in ANSWERS[:n]]
    return score_batch([("http", {"url": server.url + "/score", "backoff_s": 0.01, **params})],
                       PROMPTS[:n], COMPLETIONS[:n], fields)


@pytest.fixture
def server():
    s = Loopback(good)
    yield s
    s.stop()


def test_good_answers_in_batches_with_the_example_fields(server):
    report = scored(server, batch_size=4)
    assert report.values[0] == [rule(r) for r in rows()]  # e.g. "2" for answer "1": 0.1; "10" for "10": 0.7
    assert report.counts[0]["ok"] == 10 and not report.failures
    sent = [r["body"] for r in server.requests]
    assert sorted(len(b) for b in sent) == [2, 4, 4]  # 10 samples, batch_size 4
    assert sorted(json.dumps(r, sort_keys=True) for b in sent for r in b) == \
        sorted(json.dumps(r, sort_keys=True) for r in rows())  # prompt, completion, answer; no Python objects
    assert {r["path"] for r in server.requests} == {"/score"}


def test_500_is_retried_with_backoff_and_recovers(server):
    calls = []

    def flaky(body, path):
        calls.append(time.monotonic())
        return Reply(500, b"overloaded") if len(calls) <= 2 else good(body, path)

    server.answer = flaky
    report = scored(server, retries=2, backoff_s=0.05)
    assert report.values[0] == [rule(r) for r in rows()] and not report.failures
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1  # backoff_s * 2**k


def test_429_waits_as_long_as_retry_after_asks(server):
    calls = []

    def limited(body, path):
        calls.append(time.monotonic())
        return Reply(429, b"slow down", headers=(("Retry-After", "1"),)) if len(calls) == 1 else good(body, path)

    server.answer = limited
    report = scored(server, retries=1, backoff_s=0.01)
    assert report.values[0] == [rule(r) for r in rows()] and not report.failures
    assert calls[1] - calls[0] >= 1.0  # the server's 1 s, not the 0.01 s backoff


def test_retry_after_reads_seconds_and_dates():
    now = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
    assert retry_after("7") == 7.0
    assert retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now=now) == 30.0  # 30 s after now
    assert retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now=now) == 0.0  # in the past: no wait
    assert retry_after("soon") is None and retry_after(None) is None and retry_after(" ") is None


def test_500_past_the_retries_scores_none_counted_with_the_reason(server):
    server.answer = lambda body, path: Reply(503, b"down for maintenance")
    report = scored(server, retries=1, batch_size=5)
    assert report.values[0] == [None] * 10
    assert report.counts[0]["error"] == 10 and report.errors == [10]
    assert len(server.requests) == 4  # 2 requests x (1 + 1 retry)
    msg = report.failures[0]["message"]
    assert "HTTP 503" in msg and "down for maintenance" in msg and "after 2 attempt(s)" in msg
    assert report.failures[0]["completion"] == COMPLETIONS[0]


def test_4xx_is_not_retried(server):
    server.answer = lambda body, path: Reply(422, b'{"detail": "bad rows"}')
    report = scored(server, retries=3)
    assert report.values[0] == [None] * 10 and len(server.requests) == 1
    assert "HTTP 422" in report.failures[0]["message"] and "not retried" in report.failures[0]["message"]


def test_a_hang_past_the_timeout_scores_none_as_a_timeout(server):
    server.answer = lambda body, path: Reply(200, b'{"rewards": []}', delay_s=3.0)
    t0 = time.monotonic()
    report = scored(server, timeout_s=0.3, retries=1)
    took = time.monotonic() - t0
    assert report.values[0] == [None] * 10 and report.timeouts == [10]
    assert "timeout_s = 0.3" in report.failures[0]["message"] and len(server.requests) == 2
    assert took < 2.0  # two attempts of 0.3 s and a 0.01 s backoff, not the server's 3 s


def test_a_server_that_trickles_its_answer_times_out_too(server):
    server.answer = lambda body, path: Reply(200, json.dumps({"rewards": [0.0] * 10}).encode(), trickle_s=0.05)
    t0 = time.monotonic()
    report = scored(server, timeout_s=0.4, retries=0)
    assert report.timeouts == [10] and time.monotonic() - t0 < 1.5  # 63 bytes x 0.05 s would take 3 s


@pytest.mark.parametrize(("reply", "reason"), [
    (Reply(200, b"{not json"), "not JSON"),
    (as_json(200, [0.1, 0.2]), 'expected {"rewards": [...]}, got list'),
    (as_json(200, {"scores": [1.0] * 10}), "keys ['scores']"),
    (as_json(200, {"rewards": [1.0, 2.0]}), "returned 2 rewards for 10 samples"),
])
def test_malformed_answers_fail_their_samples_without_retries(server, reply, reason):
    server.answer = lambda body, path: reply
    report = scored(server, retries=2)
    assert report.values[0] == [None] * 10 and report.errors == [10] and len(server.requests) == 1
    assert reason in report.failures[0]["message"]


def test_entries_that_are_not_numbers_fail_alone(server):
    # "0.5" (a string), true, NaN, null, and numbers: the strings and bools are errors, NaN is nonfinite,
    # null is "could not score" (None, not a failure), the numbers are kept
    server.answer = lambda body, path: Reply(200, b'{"rewards": [1, "0.5", true, NaN, null, 0.25]}')
    report = scored(server, n=6)
    assert report.values[0] == [1.0, None, None, None, None, 0.25]
    c = report.counts[0]
    assert (c["ok"], c["error"], c["nonfinite"], c["none"]) == (2, 2, 1, 1)
    assert "rewards[1] = '0.5' is neither a number nor null" in report.failures[0]["message"]


def test_a_refused_connection_scores_none_and_the_server_can_come_back(server):
    server.stop()
    report = scored(server, retries=1)
    assert report.values[0] == [None] * 10 and report.errors == [10]
    assert "ConnectionRefused" in report.failures[0]["message"]
    server.start()
    assert scored(server).values[0] == [rule(r) for r in rows()]


def test_a_burst_of_200_is_answered_with_at_most_max_concurrency_in_flight(server):
    server.answer = lambda body, path: Reply(**{**vars(good(body, path)), "delay_s": 0.03})
    prompts = [f"{i}?" for i in range(200)]
    completions = [str(i * 7) for i in range(200)]
    fields = [{"answer": str(i % 10)} for i in range(200)]
    t0 = time.monotonic()
    report = score_batch([("http", {"url": server.url, "batch_size": 5, "max_concurrency": 8})], prompts,
                         completions, fields)
    want = [rule({"completion": c, "answer": f["answer"]}) for c, f in zip(completions, fields, strict=True)]
    assert report.values[0] == want and report.counts[0]["ok"] == 200
    assert len(server.requests) == 40
    assert 2 <= server.max_in_flight <= 8
    assert time.monotonic() - t0 < 40 * 0.03  # concurrent: well under one request after the other


def test_headers_env_as_json_or_lines_reaches_the_server_and_is_never_printed(server, monkeypatch):
    monkeypatch.setenv("RM_HEADERS", '{"Authorization": "Bearer s3cret", "X-Team": "rl"}')
    params = {"url": server.url, "headers_env": "RM_HEADERS"}
    line = describe(params)
    assert "s3cret" not in line and "2 header(s) from $RM_HEADERS" in line
    scored(server, headers_env="RM_HEADERS")
    assert server.requests[-1]["headers"]["Authorization"] == "Bearer s3cret"
    monkeypatch.setenv("RM_HEADERS", "Authorization: Bearer other\nX-Team: rl")
    scored(server, headers_env="RM_HEADERS")
    assert server.requests[-1]["headers"]["Authorization"] == "Bearer other"
    monkeypatch.setenv("RM_HEADERS", "no colon here")
    with pytest.raises(ConfigError, match="line 1 of \\$RM_HEADERS"):
        describe(params)
    monkeypatch.delenv("RM_HEADERS")
    with pytest.raises(ConfigError, match="RM_HEADERS is not set"):
        describe(params)
    report = scored(server, headers_env="RM_HEADERS")  # gone after start-up: every sample fails, no raise
    assert report.errors == [10] and "RM_HEADERS is not set" in report.failures[0]["message"]


@pytest.mark.parametrize(("params", "match"), [
    ({"url": "ftp://x/score"}, "scheme must be http or https, not 'ftp'"),
    ({"url": "127.0.0.1:8000"}, "scheme must be http or https"),
    ({"url": "http:///score"}, "no host"),
    ({"url": "http://h", "timeout_s": 0}, r"params.timeout_s = 0: expected a number > 0"),
    ({"url": "http://h", "batch_size": 0}, r"params.batch_size = 0: expected an integer > 0"),
    ({"url": "http://h", "max_concurrency": 1.5}, r"params.max_concurrency = 1.5: expected an integer > 0"),
    ({"url": "http://h", "retries": -1}, r"params.retries = -1: expected an integer >= 0"),
    ({"url": "http://h", "headers_env": ""}, "headers_env"),
    ({"url": "http://h", "retry": 1}, r"unknown key\(s\) \['retry'\]"),
    ({"timeout_s": 1}, "params.url is required"),
])
def test_bad_params_are_config_errors_naming_the_key(params, match):
    with pytest.raises(ConfigError, match=match):
        check(params)


def test_bad_params_fail_the_config_before_anything_loads(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"reward\[0\].params \(http\): http's params.url"):
        tiny_cfg('reward=[{name="http", params={url="file:///etc/passwd"}}]')
    assert not (tmp_path / "run").exists()


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_step_rl_run_with_the_http_reward(tiny_cfg, tmp_path, server):
    console = Console(record=True, width=300)
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "log.samples_every=1", "log.samples=32",
                   f'reward=[{{name="http", params={{url="{server.url}", batch_size=16, max_concurrency=2}}}}]')
    train(cfg, console=console)
    assert f"reward 'http': POST {server.url}, 16 samples a request" in console.export_text()
    rows_ = _metrics(tmp_path / "run")
    assert len(rows_) == 2 and all(r["reward/http/errors"] == 0 for r in rows_)
    assert len(server.requests) == 4  # 32 samples a step, 16 a request
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64
    for s in samples:  # every logged reward is what the server computed for that sample
        assert s["reward"] == pytest.approx(rule(s))
    assert not (tmp_path / "run" / "reward_failures.jsonl").exists()


def test_the_reward_server_goes_down_mid_run_and_comes_back(tiny_cfg, tmp_path, server):
    """After answering step 1 the server stops itself; a watcher restarts it once step 3 is in
    metrics.jsonl. Steps 2 and 3 log every sample as a failure, no step is lost, step 4 is scored again.
    """
    run = tmp_path / "run"

    def once_then_down(body, path):
        threading.Thread(target=server.stop, daemon=True).start()  # after this answer: refused
        server.answer = good
        return good(body, path)

    server.answer = once_then_down

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len(_metrics(run)) >= 3:
                server.start()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # scoring.workers = 0: forked reward workers would inherit this in-process server's listening socket
    # and keep it open after stop() (connections then hang instead of being refused)
    cfg = tiny_cfg("train.steps=4", "checkpoint.every=0", "scoring.on_error=mask", "scoring.workers=0",
                   f'reward=[{{name="http", params={{url="{server.url}", retries=1, backoff_s=0.05, timeout_s=5}}}}]')
    train(cfg, console=Console(quiet=True))
    watcher.join(timeout=5)
    rows_ = _metrics(run)
    assert [r["step"] for r in rows_] == [1, 2, 3, 4]
    errors = [r["reward/http/errors"] for r in rows_]
    assert errors == [0, 32, 32, 0]
    assert rows_[1]["reward/invalid_frac"] == 1.0 and rows_[3]["reward/invalid_frac"] == 0.0
    failures = [json.loads(line) for line in (run / "reward_failures.jsonl").read_text().splitlines()]
    assert sorted({f["step"] for f in failures}) == [2, 3] and len(failures) == 64
    assert all(f["reward"] == "http" and "Connection" in f["message"] for f in failures)
