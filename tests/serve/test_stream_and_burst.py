"""``posttrain serve``'s streaming (``"stream": true`` read by the ``openai`` client as server-sent events, the
same tokens as the plain answer) and a hostile burst on loopback: 200 good requests and 50 malformed ones at
once, every good one answered with a completion, every bad one a 4xx JSON error, the server still up after.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.envs.tool_parsers import parse_calls
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.rollout import SamplingParams, make_engine
from posttrain.serve.protocol import Limits
from posttrain.serve.server import ServeApp, ServeSettings, start
from posttrain.serve.streaming import chunks

openai = pytest.importorskip("openai")

MAX_BODY = 32 << 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model on a free loopback port (no key), with a second engine over the same weights."""
    path = str(build_tiny(tmp_path_factory.mktemp("tiny") / "model", TinySpec(seed=5)))
    tok = load_tokenizer(path)
    settings = ServeSettings(model_name="tiny", limits=Limits(max_tokens=32, max_n=4), max_body=MAX_BODY,
                             batch_wait_s=0.02, tool_parser="compact")
    app = ServeApp(make_engine("hf", load_model(path).eval(), tok), tok, settings, context=256)
    server, _ = start(app, "127.0.0.1", 0)
    port = server.server_address[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    yield {"app": app, "port": port, "client": client, "tok": tok,
           "direct": make_engine("hf", load_model(path).eval(), tok)}
    server.shutdown()
    app.close()


def _raw(port: int, path: str, body: bytes, conn: http.client.HTTPConnection | None = None):
    """POST ``body``; returns ``(status, content type, raw body)``."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("Content-Type", ""), resp.read()
    if own:
        conn.close()
    return out


MESSAGES = [{"role": "user", "content": "4+5="}]


def test_chat_stream_is_read_by_the_openai_client_and_matches_the_plain_answer(served):
    client = served["client"]
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "seed": 3, "n": 2, "logprobs": True}
    plain = client.chat.completions.create(**kw).model_dump()
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    got = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in got) and len({c.id for c in got}) == 1
    assert got[-1].choices == [] and got[-1].usage.completion_tokens == plain["usage"]["completion_tokens"]
    assert got[0].model_dump()["prompt_token_ids"] == plain["prompt_token_ids"]
    for want in plain["choices"]:
        mine = [c.choices[0] for c in got if c.choices and c.choices[0].index == want["index"]]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == want["message"]["content"]
        assert [c.finish_reason for c in mine][-1] == want["finish_reason"]
        assert mine[0].model_dump()["token_ids"] == want["token_ids"]
        assert [t.logprob for t in mine[0].logprobs.content] == [t["logprob"] for t in want["logprobs"]["content"]]
    # the openai package's own accumulator rebuilds the whole answer from the chunks (its snapshot: the final
    # completion it parses refuses a choice cut at max_tokens)
    state = openai.lib.streaming.chat.ChatCompletionStreamState()
    for c in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(c)
    final = state.current_completion_snapshot
    assert [(ch.message.content, ch.finish_reason) for ch in final.choices] == \
        [(ch["message"]["content"], ch["finish_reason"]) for ch in plain["choices"]]


def test_completion_stream_matches_the_plain_answer(served):
    client = served["client"]
    kw = {"model": "tiny", "prompt": ["1+", "2*"], "max_tokens": 8, "seed": 9, "logprobs": 0}
    plain = client.completions.create(**kw).model_dump()
    got = list(client.completions.create(**kw, stream=True))
    assert {c.object for c in got} == {"text_completion"}
    for want in plain["choices"]:
        mine = [c.choices[0] for c in got if c.choices[0].index == want["index"]]
        assert "".join(c.text for c in mine) == want["text"]
        assert mine[-1].finish_reason == want["finish_reason"]
        assert mine[0].model_dump()["token_ids"] == want["token_ids"]
        assert mine[0].logprobs.token_logprobs == want["logprobs"]["token_logprobs"]


def test_the_raw_event_stream_and_keep_alive(served):
    port = served["port"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"messages": MESSAGES, "max_tokens": 4, "stream": True}).encode()
    status, ctype, raw = _raw(port, "/v1/chat/completions", body, conn)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [d["choices"][0]["finish_reason"] is not None for d in data] == [False, True]
    # the same connection answers the next request (the stream had a length)
    status, ctype, raw = _raw(port, "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 2})
                              .encode(), conn)
    assert status == 200 and ctype == "application/json" and json.loads(raw)["object"] == "chat.completion"
    conn.close()


@pytest.mark.parametrize(("extra", "param"), [({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
                                              ({"stream": True, "stream_options": []}, "stream_options"),
                                              ({"stream": True, "stream_options": {"include_usage": "y"}},
                                               "stream_options")])
def test_a_bad_stream_flag_is_a_400_naming_it(served, extra, param):
    status, ctype, raw = _raw(served["port"], "/v1/chat/completions",
                              json.dumps({"messages": MESSAGES, **extra}).encode())
    err = json.loads(raw)["error"]
    assert (status, ctype, err["param"], err["code"]) == (400, "application/json", param, "invalid_value")
    assert param in err["message"]


def test_a_bad_streamed_request_is_a_json_error_not_a_stream(served):
    status, ctype, raw = _raw(served["port"], "/v1/chat/completions",
                              json.dumps({"messages": MESSAGES, "stream": True, "max_tokens": 999}).encode())
    assert (status, ctype) == (400, "application/json")
    assert json.loads(raw)["error"]["code"] == "max_tokens_exceeded"
    with pytest.raises(openai.NotFoundError):
        list(served["client"].chat.completions.create(model="gpt-9", messages=MESSAGES, stream=True))


def test_streamed_tool_calls_carry_their_index(served):
    tok, direct = served["tok"], served["direct"]
    messages = [{"role": "user", "content": "7*6"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    texts = {s: direct.generate([ids], SamplingParams(max_new_tokens=8), seed=s).texts[0] for s in range(80)}
    seed = next((s for s, t in texts.items() if parse_calls("compact", t).calls), None)
    if seed is None:
        pytest.skip("no seed of 80 makes the tiny model write '=...'")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 8, "seed": seed, "tools": tools}
    plain = served["client"].chat.completions.create(**kw).choices[0]
    got = [c.choices[0] for c in served["client"].chat.completions.create(**kw, stream=True)]
    call = got[0].delta.tool_calls[0]
    assert (call.index, call.type, call.function.name) == (0, "function", "calculator")
    assert call.id.startswith("call_") and call.id != plain.message.tool_calls[0].id  # each answer's own id
    assert call.function.arguments == plain.message.tool_calls[0].function.arguments
    assert got[-1].finish_reason == "tool_calls"


def test_chunks_refuses_an_answer_it_cannot_stream():
    with pytest.raises(ValueError, match="'list'"):
        chunks({"object": "list", "data": []})


def _bad_requests(port: int) -> list[tuple[str, bytes, int, str]]:
    """(path, body, status, code) of 50 malformed requests, the kinds a hostile or broken client sends."""
    msg = {"messages": MESSAGES}
    kinds = [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/completions", b"\xff\xfe garbage", 400, "invalid_json"),
        ("/v1/chat/completions", b'"a string"', 400, "invalid_json"),
        ("/v1/chat/completions", json.dumps({**msg, "temperature": "hot"}).encode(), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({**msg, "n": 1.5}).encode(), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 7}]}).encode(), 400,
         "invalid_value"),
        ("/v1/completions", json.dumps({"prompt": {"x": 1}}).encode(), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({**msg, "pad": "x" * MAX_BODY}).encode(), 413, "request_too_large"),
        ("/v1/chat/completions", json.dumps({**msg, "max_tokens": 33}).encode(), 400, "max_tokens_exceeded"),
        ("/v1/completions", json.dumps({"prompt": "1", "max_tokens": 10**6}).encode(), 400, "max_tokens_exceeded"),
        ("/v1/chat/completions", json.dumps({**msg, "model": "gpt-9"}).encode(), 404, "model_not_found"),
        ("/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), 400, "missing_required_parameter"),
        ("/v1/completions", json.dumps({"model": "tiny"}).encode(), 400, "missing_required_parameter"),
        ("/v1/chat/completions", json.dumps({**msg, "stream": "yes"}).encode(), 400, "invalid_value"),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "invalid_value"),
    ]
    return [kinds[i % len(kinds)] for i in range(50)]


def _good(i: int) -> tuple[str, dict]:
    """The i-th good request: chat or completion, a few streamed, a few with n = 2, all 4 tokens."""
    if i % 4 == 3:
        return "/v1/completions", {"model": "tiny", "prompt": f"{i}+{i % 7}=", "max_tokens": 4,
                                   **({"stream": True} if i % 8 == 7 else {})}
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i % 50}*{i % 9}"}], "max_tokens": 4}
    if i % 10 == 0:
        body["stream"] = True
    if i % 10 == 5:
        body["n"] = 2
    return "/v1/chat/completions", body


def _completions_of(ctype: str, raw: bytes) -> list[list[int]]:
    """The token ids of every choice of an answer, plain JSON or an event stream."""
    if ctype.startswith("text/event-stream"):
        events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
        return [c["token_ids"] for e in events for c in e["choices"] if "token_ids" in c]
    return [c["token_ids"] for c in json.loads(raw)["choices"]]


def test_a_hostile_burst_of_200_good_and_50_malformed_requests(served):
    """250 requests released at once from 250 threads: the good ones (chat and completions, some streamed, some
    with n = 2) each get 200 and their completions, the bad ones each their own 4xx JSON error; the server answers
    after, and the good ones shared engine calls.
    """
    app, port = served["app"], served["port"]
    bad = _bad_requests(port)
    jobs = [("good", *_good(i)) for i in range(200)] + [("bad", p, b) for p, b, _, _ in bad]
    order = list(range(len(jobs)))
    order = order[::2] + order[1::2]  # good and bad interleaved in submission order
    gate = threading.Barrier(len(jobs))
    calls_before = app.batcher.calls

    def one(k: int) -> tuple[int, str, bytes]:
        kind, path, body = jobs[k]
        data = json.dumps(body).encode() if kind == "good" else body
        gate.wait(timeout=60)
        return _raw(port, path, data)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        answers = dict(zip(order, pool.map(one, order), strict=True))
    for k in range(200):
        status, ctype, raw = answers[k]
        assert status == 200, (jobs[k], raw[:300])
        want_n = jobs[k][2].get("n", 1)
        got = _completions_of(ctype, raw)
        assert len(got) == want_n and all(1 <= len(ids) <= 4 for ids in got), (jobs[k], raw[:300])
        assert ctype.startswith("text/event-stream") == bool(jobs[k][2].get("stream")), ctype
    for j, (_, _, status, code) in enumerate(bad):
        got_status, ctype, raw = answers[200 + j]
        assert ctype == "application/json", (bad[j][:1], raw[:200])
        assert (got_status, json.loads(raw)["error"]["code"]) == (status, code), (bad[j][1][:80], raw[:200])
    assert app.batcher.calls - calls_before < 100  # good requests shared engine calls
    assert app.batcher.thread.is_alive()
    status, _, raw = _raw(port, "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode())
    assert status == 200 and json.loads(raw)["choices"][0]["token_ids"]
    assert served["client"].models.list().data[0].id == "tiny"
