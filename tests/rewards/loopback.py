"""A scriptable HTTP server on 127.0.0.1 for the remote-reward tests: real sockets, real threads.

A test sets ``server.answer`` to a function of the request's JSON body that returns what to do: a
:class:`Reply` (status, raw body bytes, optional delay before answering, or a trickle of one byte per
``trickle_s``). The server records every request (path, headers, body) and the most requests it held
at once, and can be stopped (connections are refused) and started again on the same port.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    """What the server does with one request."""

    status: int = 200
    body: bytes = b"{}"
    delay_s: float = 0.0  # sleep before answering (a hang when past the client's timeout)
    trickle_s: float = 0.0  # > 0: send the body one byte at a time, this long apart
    headers: tuple[tuple[str, str], ...] = ()  # extra response headers, e.g. (("Retry-After", "1"),)


def as_json(status: int, obj: object, delay_s: float = 0.0) -> Reply:
    """A reply whose body is ``obj`` as JSON (``NaN`` written as Python's json writes it)."""
    return Reply(status, json.dumps(obj).encode(), delay_s)


class Loopback:
    """The server; ``answer(body, path) -> Reply`` decides each reply (it may raise: that is a 500)."""

    def __init__(self, answer: Callable[[object, str], Reply]) -> None:
        self.answer = answer
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen (on the same port as before, if any) and serve in a thread."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner._lock:
                    owner.in_flight += 1
                    owner.max_in_flight = max(owner.max_in_flight, owner.in_flight)
                try:
                    body = json.loads(raw)
                    owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    try:
                        reply = owner.answer(body, self.path)
                    except Exception as e:  # noqa: BLE001 - the scripted server's own bug: a 500
                        reply = Reply(500, f"answer raised {e!r}".encode())
                    time.sleep(reply.delay_s)
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply.body)))
                    for name, value in reply.headers:
                        self.send_header(name, value)
                    self.end_headers()
                    if reply.trickle_s:
                        for i in range(len(reply.body)):
                            self.wfile.write(reply.body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(reply.trickle_s)
                    else:
                        self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout): expected in the hang tests
                finally:
                    with owner._lock:
                        owner.in_flight -= 1

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        server.block_on_close = False
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def stop(self) -> None:
        """Stop listening: from now on connections are refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def rule(row: dict) -> float:
    """The test servers' reward: a number every test can recompute from the row it sent."""
    return len(row["completion"]) / 10 + (0.5 if str(row.get("answer")) in row["completion"] else 0.0)


def good(body: object, path: str) -> Reply:
    """Score every row by :func:`rule`."""
    return as_json(200, {"rewards": [rule(r) for r in body]})
