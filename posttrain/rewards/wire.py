"""HTTP for the remote rewards (``http`` and ``llm_judge``'s OpenAI-compatible backend): one JSON POST
with a deadline per attempt, retries with exponential backoff, and a bounded fan-out of requests.

Standard library only (``http.client``): no dependency, and no proxy from the environment is used
(a reward server is usually a service next to the trainer). Redirects are not followed.

What a failure becomes is decided here, once, for both rewards (:class:`WireFailure` carries the
status the scoring path counts: ``"timeout"`` or ``"error"``):

- retried up to ``retries`` times, waiting ``backoff_s * 2**k`` (at most :data:`MAX_BACKOFF_S`) before
  retry ``k + 1``, or longer when the answer's ``Retry-After`` asks for it (still at most
  :data:`MAX_BACKOFF_S`): a refused or reset connection, an attempt past ``timeout_s``, HTTP 408, 429 and 5xx;
- not retried: any other status (a 4xx says the request is wrong; sending it again will not help), a
  body larger than :data:`MAX_BODY` bytes, a 2xx whose body is not JSON.

``timeout_s`` bounds a whole attempt (connect, send, the answer's last byte), not each socket read, so
a server that trickles bytes times out too.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from posttrain.errors import ConfigError

MAX_BODY = 64 << 20  # bytes of an answer read at most
MAX_BACKOFF_S = 30.0
RETRIED = frozenset({408, 429})  # and every 5xx
T = TypeVar("T")
R = TypeVar("R")


class WireFailure(Exception):
    """A request that failed for good: ``status`` is what the scoring path counts it as."""

    def __init__(self, status: Literal["timeout", "error"], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Transient(Exception):
    """One attempt failed in a way that a later attempt may not (retried)."""

    def __init__(self, status: Literal["timeout", "error"], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_url(key: str, url: object) -> str:
    """``url`` when it is an ``http://`` or ``https://`` URL with a host, else a :class:`ConfigError` naming ``key``."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{key} = {url!r}: expected an http:// or https:// URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{key} = {url!r}: the scheme must be http or https, not {parts.scheme or 'none'!r}")
    if not parts.hostname:
        raise ConfigError(f"{key} = {url!r}: no host (expected e.g. http://127.0.0.1:8000/score)")
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as e:
        raise ConfigError(f"{key} = {url!r}: bad port ({e})") from e
    return url


def check_keys(who: str, params: Mapping[str, object], names: Sequence[str]) -> None:
    """A :class:`ConfigError` listing the keys of ``params`` that are not in ``names`` (``who``: the reward)."""
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ConfigError(f"{who}'s params: unknown key(s) {unknown}; it takes {list(names)}")


def check_positive(key: str, value: object, *, integer: bool, zero: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` unless ``value`` is a positive number (an integer when
    ``integer``; 0 allowed when ``zero``).
    """
    kind = (int,) if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value > 0 or (zero and value == 0))
    if not ok:
        want = ("an integer" if integer else "a number") + (" >= 0" if zero else " > 0")
        raise ConfigError(f"{key} = {value!r}: expected {want}")


def headers_from_env(key: str, name: str | None) -> dict[str, str]:
    """The extra headers held by environment variable ``name`` (``None``: none).

    The variable holds either a JSON object of header names to string values
    (``{"Authorization": "Bearer sk-..."}``) or one ``Name: value`` header a line. An unset or empty
    variable, or one that parses as neither, is a :class:`ConfigError` naming ``key`` and the variable
    (never its value: it holds secrets).
    """
    if name is None:
        return {}
    raw = os.environ.get(name, "")
    if not raw.strip():
        raise ConfigError(f"{key} = {name!r}: the environment variable {name} is not set (or empty); it should "
                          'hold the extra headers, as JSON ({"Authorization": "Bearer ..."}) or "Name: value" lines')
    if raw.lstrip().startswith("{"):
        try:
            parsed = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{key}: ${name} starts with '{{' but is not JSON ({e.__class__.__name__})") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()):
            raise ConfigError(f"{key}: ${name} must map header names to string values")
        return dict(parsed)
    out = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        name_, sep, value = line.partition(":")
        if not sep or not name_.strip() or any(c.isspace() for c in name_.strip()):
            raise ConfigError(f"{key}: line {n} of ${name} is not a 'Name: value' header (nor is the value JSON)")
        out[name_.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class Endpoint:
    """Where and how to POST: the URL, extra headers, the limit of one attempt and the retry policy."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.5


def _attempt(ep: Endpoint, body: bytes) -> tuple[int, bytes, float | None]:
    """One POST; returns (status, body, the answer's ``Retry-After`` in seconds or ``None``). Raises
    :class:`_Transient` for what a retry may cure.
    """
    parts = urlsplit(ep.url)
    deadline = time.monotonic() + ep.timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=left(), context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=left())
    try:
        conn.connect()
        sock = conn.sock  # kept: the connection lets go of it once the response says it will close
        conn.request("POST", target, body=body, headers={"Content-Type": "application/json",
                                                         "Accept": "application/json", **ep.headers})
        sock.settimeout(left())
        resp = conn.getresponse()
        chunks, size = [], 0
        while True:
            sock.settimeout(left())
            chunk = resp.read1(1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_BODY:
                raise WireFailure("error", f"POST {ep.url}: the answer is larger than {MAX_BODY} bytes")
            chunks.append(chunk)
        return resp.status, b"".join(chunks), retry_after(resp.getheader("Retry-After"))
    except TimeoutError:  # socket.timeout is TimeoutError
        raise _Transient("timeout", f"no complete answer within timeout_s = {ep.timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise _Transient("error", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    finally:
        conn.close()


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait by a ``Retry-After`` header: delay-seconds or an HTTP date; ``None`` when absent or
    unreadable (a date in the past waits 0).
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _snippet(body: bytes) -> str:
    return repr(body[:200].decode("utf-8", "replace")) + ("..." if len(body) > 200 else "")


def post_json(ep: Endpoint, payload: object, *, sleep: Callable[[float], None] = time.sleep) -> object:
    """POST ``payload`` as JSON to ``ep.url`` and return the parsed JSON answer (any 2xx).

    Raises:
        WireFailure: when it failed for good (see the module docstring); the message names the URL, what
            went wrong and how many attempts were made.

    """
    body = json.dumps(payload, default=_jsonable).encode()
    last: _Transient | None = None
    asked: float | None = None  # the last answer's Retry-After: waited instead of a shorter backoff
    for k in range(ep.retries + 1):
        if k:
            sleep(min(max(ep.backoff_s * 2 ** (k - 1), asked or 0.0), MAX_BACKOFF_S))
        try:
            status, answer, asked = _attempt(ep, body)
        except _Transient as e:
            last, asked = e, None
            continue
        if status >= 500 or status in RETRIED:
            last = _Transient("error", f"HTTP {status}: {_snippet(answer)}")
            continue
        if not 200 <= status < 300:
            hint = " (redirects are not followed: give the final URL)" if 300 <= status < 400 else ""
            raise WireFailure("error", f"POST {ep.url}: HTTP {status}{hint}: {_snippet(answer)} (not retried)")
        try:
            return json.loads(answer)
        except ValueError as e:
            raise WireFailure("error", f"POST {ep.url}: the answer is not JSON ({e}): {_snippet(answer)}") from None
    assert last is not None
    raise WireFailure(last.status, f"POST {ep.url}: {last.message} (after {ep.retries + 1} attempt(s))")


def _jsonable(value: object) -> object:
    """JSON for what ``json`` cannot write itself: arrays and tensors as lists, anything else as its ``str``."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


def fan_out(fn: Callable[[T], R], items: Sequence[T], max_concurrency: int) -> list[R]:
    """``[fn(x) for x in items]`` with at most ``max_concurrency`` calls running at once (threads that end
    with the call); ``fn`` must not raise.
    """
    if len(items) <= 1 or max_concurrency <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(max_concurrency, len(items)), thread_name_prefix="posttrain-remote") as pool:
        return list(pool.map(fn, items))
