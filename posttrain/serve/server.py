"""``posttrain serve``'s HTTP side: an OpenAI-compatible API over a rollout engine, on the standard library's
``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-alive), nothing else to install.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (and ``GET /health``,
which needs no key and counts the engine calls made and the sequences they sampled). Each request is read
(at most ``max_body`` bytes: 413 past it), authenticated (with an API key, ``Authorization: Bearer KEY``:
401 without it), checked (``protocol.py``: 4xx with OpenAI's error body), and handed to the engine thread
(``batching.py``), which batches it with its neighbours. No request can stop the server: anything
unexpected is a 500 answer and the next request is served. A request with ``"stream": true`` is answered
the same, then sent as server-sent events (``streaming.py``).

``record``, when given, is called (on the HTTP thread) with every answered request's ``GenRequest`` and its
:class:`~posttrain.serve.protocol.Sample` s, before the answer goes out: the hook a trainer of outside
agents records the sampled tokens with.
"""

from __future__ import annotations

import hmac
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from posttrain.envs.tool_parsers import parser_for_tokenizer
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.serve.batching import Batcher, Job
from posttrain.serve.protocol import (
    APIError,
    GenRequest,
    Limits,
    Sample,
    cut_at_stop,
    parse_chat,
    parse_completion,
    tool_message,
)
from posttrain.serve.streaming import chunks, sse, stream_flags


@dataclass(frozen=True)
class ServeSettings:
    """How the server answers: the served model's name, the key, the bounds, the batching."""

    model_name: str
    api_key: str | None = None
    limits: Limits = Limits()
    max_body: int = 4 << 20  # bytes of one request body
    batch_wait_s: float = 0.005
    max_batch_rows: int = 64
    request_timeout_s: float = 600.0
    accept_any_model: bool = False  # answer whatever 'model' a request names (agents with a hard-coded name)
    tool_parser: str | None = None  # None: the one the chat template shows (tool_parsers.parser_for_tokenizer)
    seed: int = 0


class ServeApp:
    """The API over ``engine`` and ``tokenizer``: request bodies in, response bodies out (no HTTP here)."""

    def __init__(self, engine: RolloutEngine, tokenizer: object, settings: ServeSettings,
                 record: Callable[[GenRequest, list[Sample]], None] | None = None, context: int | None = None) -> None:
        self.engine, self.tokenizer, self.settings, self.record = engine, tokenizer, settings, record
        self.context = context or int(getattr(engine, "max_positions", 1 << 30))
        self.parser = settings.tool_parser or parser_for_tokenizer(tokenizer)
        self.batcher = Batcher(engine, wait_s=settings.batch_wait_s, max_rows=settings.max_batch_rows,
                               seed=settings.seed)
        self.created = int(time.time())

    def models(self) -> dict:
        """``GET /v1/models``."""
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model",
                                            "created": self.created, "owned_by": "posttrain"}]}

    def generate(self, req: GenRequest) -> list[Sample]:
        """Sample the request's prompts through the engine thread; checks the model name and the context."""
        if req.model and req.model != self.settings.model_name and not self.settings.accept_any_model:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                           f"{self.settings.model_name!r} (GET /v1/models)", "model", "model_not_found")
        longest = max(len(p) for p in req.prompts)
        room = self.context - longest
        if room < 1:
            raise APIError(400, f"the prompt has {longest} tokens and the model's context is {self.context}: no room "
                           "for a completion", "messages" if req.kind == "chat" else "prompt",
                           "context_length_exceeded")
        max_tokens = min(req.max_tokens or min(self.settings.limits.max_tokens, room), room)
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n)
        batchable = req.seed is None and longest + max_tokens <= self.context
        job = Job(req.prompts, sampling, req.seed, batchable)
        try:
            future = self.batcher.submit(job)
        except queue.Full:
            raise APIError(503, "the server is busy (too many queued requests); retry later", None, "overloaded",
                           "server_error") from None
        try:
            samples = future.result(timeout=self.settings.request_timeout_s)
        except ValueError as e:  # the engine refused the input (a prompt it cannot take)
            raise APIError(400, f"the engine refused the request: {e}", None, "invalid_value") from None
        except TimeoutError:
            future.cancel()  # still queued: it will not run; already running: its answer is dropped
            raise APIError(504, f"no answer within {self.settings.request_timeout_s} s (the engine is busy)", None,
                           "timeout", "server_error") from None
        req.max_tokens = max_tokens
        return samples

    def _finish(self, req: GenRequest, s: Sample) -> tuple[str, Sample, str]:
        text, s, stopped = cut_at_stop(self.tokenizer, s, req.stop)
        return text, s, "stop" if (stopped or s.finished) else "length"

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]  # type: ignore[attr-defined]

    def chat(self, body: dict) -> dict:
        """``POST /v1/chat/completions``."""
        req = parse_chat(body, self.tokenizer, self.settings.limits)
        samples = self.generate(req)
        choices, kept = [], []
        for i, s in enumerate(samples):
            text, s, reason = self._finish(req, s)
            kept.append(s)
            content, calls = tool_message(text, self.parser) if req.tools and req.parse_tools else (text, None)
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"], reason = calls, "tool_calls"
            lp = None
            if req.logprobs:
                lp = {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                                  for t, v in zip(self._token_texts(s.token_ids), s.logprobs, strict=True)]}
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": lp,
                            "token_ids": s.token_ids})
        return self._answer(req, kept, "chat.completion", "chatcmpl", choices)

    def completion(self, body: dict) -> dict:
        """``POST /v1/completions``: prompt-major choices, ``n`` for each prompt."""
        req = parse_completion(body, self.tokenizer, self.settings.limits)
        samples = self.generate(req)
        choices, kept = [], []
        for i, s in enumerate(samples):
            text, s, reason = self._finish(req, s)
            kept.append(s)
            lp = None
            if req.logprobs:
                tokens = self._token_texts(s.token_ids)
                offsets = [len(self.tokenizer.decode(s.token_ids[:k], skip_special_tokens=False))  # type: ignore
                           for k in range(len(s.token_ids))]
                lp = {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": lp,
                            "token_ids": s.token_ids, "prompt_token_ids": req.prompts[i // req.n]})
        return self._answer(req, kept, "text_completion", "cmpl", choices)

    def _answer(self, req: GenRequest, samples: list[Sample], obj: str, prefix: str, choices: list[dict]) -> dict:
        if self.record is not None:
            self.record(req, samples)
        completion = sum(len(s.token_ids) for s in samples)
        prompt = sum(len(p) for p in req.prompts)
        answer = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                  "model": self.settings.model_name, "choices": choices,
                  "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}}
        if req.kind == "chat":
            answer["prompt_token_ids"] = req.prompts[0]
        return answer

    def close(self) -> None:
        """Stop the engine thread."""
        self.batcher.close()


ROUTES = {("GET", "/v1/models"): "models", ("POST", "/v1/chat/completions"): "chat",
          ("POST", "/v1/completions"): "completion"}


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (the server's ``app`` answers them)."""

    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a client may take to send a request (a stalled one loses its thread, not the server)
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """Quiet: one line per request would drown a training run's console."""

    def _send(self, status: int, body: dict, close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_events(self, events: list[dict]) -> None:
        """A ``stream: true`` answer: server-sent events, all at once (``streaming.py``), with a length so the
        connection stays open.
        """
        data = sse(events)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise APIError(411, "a POST needs a Content-Length header (chunked bodies are not read)", None,
                           "length_required")
        if int(length) > self.server.app.settings.max_body:
            raise APIError(413, f"the request body is {length} bytes; this server reads at most "
                           f"{self.server.app.settings.max_body}", None, "request_too_large")
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object; got {type(body).__name__}", None,
                           "invalid_json")
        return body

    def _authorized(self) -> bool:
        key = self.server.app.settings.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    def _handle(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        read_body = method == "POST"
        try:
            if method == "GET" and path == "/health":
                b = self.server.app.batcher
                self._send(200, {"status": "ok", "engine_calls": b.calls, "engine_rows": b.rows})
                return
            route = ROUTES.get((method, path))
            if route is None:
                known = any(p == path for _, p in ROUTES)
                raise APIError(405 if known else 404, f"{method} {path} is not a route here; routes: "
                               + ", ".join(f"{m} {p}" for m, p in ROUTES), None,
                               "method_not_allowed" if known else "not_found")
            if not self._authorized():
                raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)", None,
                               "invalid_api_key", "authentication_error")
            app = self.server.app
            if route == "models":
                self._send(200, app.models())
                return
            body = self._body()
            read_body = False
            stream, include_usage = stream_flags(body)  # checked before sampling: a bad flag costs no engine time
            answer = app.chat(body) if route == "chat" else app.completion(body)
            if stream:
                self._send_events(chunks(answer, include_usage))
            else:
                self._send(200, answer)
        except APIError as e:  # an unread body cannot be skipped safely: close the connection after the answer
            self._send(e.status, e.body(), close=read_body)
        except Exception as e:  # noqa: BLE001 - a bug answers 500; the server keeps serving
            self._send(500, APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error",
                                     "server_error").body(), close=True)

    def do_GET(self) -> None:
        """``GET`` routes."""
        self._handle("GET")

    def do_POST(self) -> None:
        """``POST`` routes."""
        self._handle("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # a burst of connections waits in the kernel's backlog, not refused

    def __init__(self, address: tuple[str, int], app: ServeApp) -> None:
        self.app = app
        super().__init__(address, Handler)


def start(app: ServeApp, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Bind ``host:port`` (port 0: a free one, read back from ``server.server_address``) and serve in a
    daemon thread; stop with ``server.shutdown()`` then ``app.close()``.
    """
    server = _Server((host, port), app)
    thread = threading.Thread(target=server.serve_forever, name="posttrain-serve-http", daemon=True)
    thread.start()
    return server, thread


__all__ = ["Handler", "ServeApp", "ServeSettings", "start"]
