"""``posttrain serve`` on the tiny model over loopback: the ``openai`` client's chat, completion and model
calls, the exact tokens and log-probs against a direct engine call, bad requests answered 4xx without
stopping the server, and a burst of concurrent good and bad requests all answered.
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

openai = pytest.importorskip("openai")

KEY = "test-key-123"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny model served on a free loopback port (with an API key), and a second engine over the same
    weights for direct calls.
    """
    path = str(build_tiny(tmp_path_factory.mktemp("tiny") / "model", TinySpec(seed=3)))
    tok = load_tokenizer(path)
    engine = make_engine("hf", load_model(path).eval(), tok)
    direct = make_engine("hf", load_model(path).eval(), tok)
    settings = ServeSettings(model_name="tiny-test", api_key=KEY, limits=Limits(max_tokens=64, max_n=4),
                             max_body=64 << 10, batch_wait_s=0.02, tool_parser="compact")
    app = ServeApp(engine, tok, settings, context=256)
    server, _ = start(app, "127.0.0.1", 0)
    port = server.server_address[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield {"app": app, "port": port, "client": client, "tok": tok, "direct": direct, "path": path}
    server.shutdown()
    app.close()


def _raw(port: int, method: str, path: str, body: bytes | None = None, key: str | None = KEY,
         headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    conn.request(method, path, body=body, headers=h)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data


def _post(port: int, path: str, body: object, **kw) -> tuple[int, dict]:
    return _raw(port, "POST", path, json.dumps(body).encode(), **kw)


def test_models_and_chat_match_a_direct_engine_call(served):
    client, tok, direct = served["client"], served["tok"], served["direct"]
    assert [m.id for m in client.models.list().data] == ["tiny-test"]
    messages = [{"role": "system", "content": "1+1"}, {"role": "user", "content": "2*3="}]
    r = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=12, temperature=0.9,
                                       top_p=0.95, seed=7, n=2, logprobs=True)
    raw = r.model_dump()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert raw["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    want = direct.generate([raw["prompt_token_ids"]], SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95,
                                                                     n=2), seed=7)
    for i, choice in enumerate(raw["choices"]):
        keep = want.loss_mask[i] > 0
        assert choice["token_ids"] == want.token_ids[i][keep].tolist()
        got = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert got == pytest.approx(want.behaviour_logprobs[i][keep].tolist(), abs=1e-5)
        assert choice["message"]["content"] == want.texts[i]
        assert choice["finish_reason"] == ("stop" if bool(want.finished[i]) else "length")
    assert r.usage.completion_tokens == sum(len(c["token_ids"]) for c in raw["choices"])


def test_completions_with_token_ids_and_stop(served):
    client, tok, direct = served["client"], served["tok"], served["direct"]
    r = client.completions.create(model="tiny-test", prompt="12+3=", max_tokens=20, seed=11, logprobs=0,
                                  temperature=1.0)
    choice = r.model_dump()["choices"][0]
    ids = tok("12+3=", add_special_tokens=True)["input_ids"]
    assert choice["prompt_token_ids"] == ids
    want = direct.generate([ids], SamplingParams(max_new_tokens=20, temperature=1.0), seed=11)
    keep = want.loss_mask[0] > 0
    assert choice["token_ids"] == want.token_ids[0][keep].tolist()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.behaviour_logprobs[0][keep].tolist(), abs=1e-5)
    text = want.texts[0]
    stop = next((c for c in text[1:] if c in "0123456789+*="), None)
    if stop is None:
        pytest.skip(f"the sampled text {text!r} has no character to stop at")
    cut = client.completions.create(model="tiny-test", prompt=[ids], max_tokens=20, seed=11, stop=[stop])
    c = cut.model_dump()["choices"][0]
    assert c["text"] == text[: text.index(stop)]
    assert c["finish_reason"] == "stop"
    assert stop in tok.decode(c["token_ids"], skip_special_tokens=True)
    assert c["token_ids"] == choice["token_ids"][: len(c["token_ids"])]


def test_tool_calls_are_parsed_when_the_request_has_tools(served):
    client, tok, direct = served["client"], served["tok"], served["direct"]
    messages = [{"role": "user", "content": "7*6"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    texts = {s: direct.generate([ids], SamplingParams(max_new_tokens=8), seed=s).texts[0] for s in range(80)}
    call_seed = next((s for s, t in texts.items() if parse_calls("compact", t).calls), None)
    if call_seed is None:
        pytest.skip("no seed of 80 makes the tiny model write '=...'")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=8, seed=call_seed,
                                       tools=tools).choices[0]
    assert r.finish_reason == "tool_calls"
    assert r.message.tool_calls[0].function.name == "calculator"
    expr = texts[call_seed].strip()[1:].strip()
    assert json.loads(r.message.tool_calls[0].function.arguments) == ({"expression": expr} if expr else {})
    for extra in ({}, {"tools": tools, "tool_choice": "none"}):  # no tools, or told not to call: plain text
        plain = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=8, seed=call_seed,
                                               **extra)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == texts[call_seed]
    # the call goes back as history: an assistant turn with tool_calls, then the tool's result
    history = [*messages, r.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id":
               r.message.tool_calls[0].id, "content": "42"}]
    follow = client.chat.completions.create(model="tiny-test", messages=history, max_tokens=4, seed=1, tools=tools)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (json.dumps({"model": "tiny-test"}).encode(), 400, "missing_required_parameter"),
    (json.dumps({"messages": "hi"}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "temperature": "hot"}).encode(), 400,
     "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "n": 99}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "max_tokens": 10**9}).encode(), 400,
     "max_tokens_exceeded"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "stream": "yes"}).encode(), 400,
     "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "top_logprobs": 3}).encode(), 400,
     "unsupported_parameter"),
    (json.dumps({"messages": [{"role": "user", "content": "1"}], "model": "gpt-9"}).encode(), 404,
     "model_not_found"),
    (json.dumps({"messages": [{"role": "user", "content": "1" * 300}]}).encode(), 400, "context_length_exceeded"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD)
def test_a_malformed_request_is_a_4xx_and_the_server_goes_on(served, body, status, code):
    got, data = _raw(served["port"], "POST", "/v1/chat/completions", body)
    assert (got, data["error"]["code"]) == (status, code), data
    assert set(data["error"]) >= {"message", "type", "code"}
    assert served["client"].models.list().data[0].id == "tiny-test"


def test_key_size_routes_and_completion_fields(served):
    port = served["port"]
    ok = {"messages": [{"role": "user", "content": "1"}], "max_tokens": 2}
    assert _post(port, "/v1/chat/completions", ok, key=None)[0] == 401
    assert _post(port, "/v1/chat/completions", ok, key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    assert _raw(port, "POST", "/v1/chat/completions", b"x" * (65 << 10))[0] == 413
    assert _raw(port, "GET", "/v1/nothing")[0] == 404
    assert _raw(port, "GET", "/v1/chat/completions")[0] == 405
    assert _post(port, "/v1/completions", {"prompt": [[1, 10**6]]})[1]["error"]["code"] == "invalid_value"
    assert _post(port, "/v1/completions", {"prompt": "1", "logprobs": 3})[1]["error"]["code"] == \
        "unsupported_parameter"
    status, data = _post(port, "/v1/completions", {"prompt": ["1+", "2*"], "n": 2, "max_tokens": 3})
    assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][0]["prompt_token_ids"] != data["choices"][2]["prompt_token_ids"]
    health = _raw(port, "GET", "/health", key=None)  # no key needed; counts the engine's calls and rows
    assert health[0] == 200 and health[1]["status"] == "ok"
    assert health[1]["engine_calls"] == served["app"].batcher.calls >= 1
    assert health[1]["engine_rows"] >= health[1]["engine_calls"] + 3  # the last call alone sampled 4 rows


def test_a_burst_of_good_and_bad_requests_is_all_answered_in_batches(served):
    app, port = served["app"], served["port"]
    calls_before = app.batcher.calls
    good = {"messages": [{"role": "user", "content": "3+4"}], "max_tokens": 6, "temperature": 1.0}
    bad = [b"{", json.dumps({"messages": []}).encode(), json.dumps({"prompt": 3}).encode()]

    def one(i: int) -> tuple[str, int]:
        if i % 7 in (3, 6):  # 20 malformed among 70
            return "bad", _raw(port, "POST", "/v1/completions" if i % 2 else "/v1/chat/completions",
                               bad[i % 3])[0]
        status, data = _post(port, "/v1/chat/completions", good)
        assert status == 200, data
        assert len(data["choices"][0]["token_ids"]) >= 1
        return "good", status

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(one, range(70)))
    assert sum(k == "good" for k, _ in results) == 50 and all(s == 200 for k, s in results if k == "good")
    assert all(400 <= s < 500 for k, s in results if k == "bad") and len(results) == 70
    assert app.batcher.calls - calls_before < 50  # some requests shared an engine call
    assert threading.active_count() < 200
    assert served["client"].models.list().data[0].id == "tiny-test"


def test_concurrent_seeded_requests_each_get_their_own_draw(served):
    """A request with a seed never shares a batch: under concurrency each still gets its direct-call tokens."""
    port, tok, direct = served["port"], served["tok"], served["direct"]
    ids = tok("7+8=", add_special_tokens=True)["input_ids"]

    def one(seed: int) -> list[int]:
        status, data = _post(port, "/v1/completions", {"prompt": ids, "max_tokens": 10, "seed": seed})
        assert status == 200, data
        return data["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(one, range(8)))
    for seed, tokens in enumerate(got):
        want = direct.generate([ids], SamplingParams(max_new_tokens=10), seed=seed)
        assert tokens == want.token_ids[0][want.loss_mask[0] > 0].tolist()
    assert len({tuple(t) for t in got}) > 1


def test_the_serve_command_loads_a_run_checkpoint_and_answers(served, tmp_path):
    """``posttrain serve RUN_DIR`` in a subprocess: the run's latest checkpoint, a free port, the key from the
    environment; Ctrl-C (SIGINT) ends it with status 0.
    """
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(served["path"], ckpt)
    env = {**os.environ, "POSTTRAIN_SERVE_API_KEY": "k2"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "posttrain.cli", "serve", str(tmp_path / "run"),
                                 "--port", "0", "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while "/v1" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "at http://127.0.0.1:" in text, text
        port = int(text.split("at http://127.0.0.1:")[1].split("/")[0])
        assert _raw(port, "GET", "/v1/models", key="k2")[1]["data"][0]["id"] == str(tmp_path / "run")
        assert _raw(port, "GET", "/v1/models", key=KEY)[0] == 401
        status, data = _post(port, "/v1/completions", {"prompt": "1+1=", "max_tokens": 3, "seed": 0}, key="k2")
        assert status == 200 and data["choices"][0]["token_ids"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0, log.read_text()


def test_a_lora_checkpoint_is_served_as_its_merged_policy(served, tmp_path, quiet):
    """A LoRA run's checkpoint (adapter + tokenizer, no config.json) is served as base + adapter, merged."""
    pytest.importorskip("peft")
    import torch

    from posttrain.cli import build_parser
    from posttrain.config.model import LoraSettings
    from posttrain.models.load import load_merged
    from posttrain.models.lora import apply_lora
    from posttrain.serve.command import build_app

    base = served["path"]
    peft_model = apply_lora(load_model(base), LoraSettings(rank=4, alpha=8.0), base)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    ckpt = tmp_path / "lora_run" / "checkpoints" / "step_000001"
    peft_model.save_pretrained(ckpt, safe_serialization=True)
    served["tok"].save_pretrained(ckpt)
    app = build_app(build_parser().parse_args(["serve", str(ckpt.parent.parent), "--device", "cpu"]), quiet)
    try:
        ids = served["tok"]("5*5=", add_special_tokens=True)["input_ids"]
        got = app.completion({"prompt": ids, "max_tokens": 12, "seed": 4, "logprobs": 0})["choices"][0]
        merged = make_engine("hf", load_merged(ckpt).eval(), served["tok"])
        want = merged.generate([ids], SamplingParams(max_new_tokens=12), seed=4)
        keep = want.loss_mask[0] > 0
        assert got["token_ids"] == want.token_ids[0][keep].tolist()
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want.behaviour_logprobs[0][keep].tolist(), abs=1e-5)
        x = torch.tensor([ids])  # the adapter matters: the served policy is not the base
        assert not torch.allclose(load_model(base)(x).logits, merged.model(x).logits, atol=1e-3)
    finally:
        app.close()
