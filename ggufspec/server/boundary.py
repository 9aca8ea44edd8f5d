"""The server's edge: what every connection and request must satisfy before any real work is done for it.

- **Browsers.** A web page the user visits can send requests to a server on the user's machine. Three rules keep it
  out (as Ollama's fix for DNS rebinding, and the CORS rules browsers follow): the `Host` header must name this
  machine (an IP address, `localhost`, the host name, or an `--allowed-host`), so a page on a rebinding domain is
  refused; a POST body must be `application/json`, which browsers send cross-origin only after a preflight that
  this server does not grant; and a request from another `Origin` is refused unless `--cors-origin` allows it.
- **Sizes.** A body larger than `--max-body` is refused with 413 from its `Content-Length`, before it is read, or as
  soon as a chunked body grows past it; JSON nested deeper than Python's parser goes, or holding unpaired UTF-16
  surrogates or a number that is not finite (NaN, Infinity: Python's parser takes them), is a 400.
- **Connections.** A connection that sends nothing is idle, whether new or after a response: it is closed after
  uvicorn's keep-alive bound (5 s; `--timeout` if shorter). A request's head and body must arrive within
  `--timeout` seconds of its first byte, and a response that the client stops reading is dropped after as long; at
  most `max_connections` stay open (sized under the process's file-descriptor limit), the oldest one that is not
  being answered closed to make room.
- **Errors.** Anything a handler did not expect is answered as a 500 with a request id, logged once with that id.
- **The request log.** One line per request on the server's log, as llama-server's: method, path, status, the
  tokens of the prompt and of the answer with the speed, the time taken, and for an error its code (and a 500's
  request id); a stream that fails after its 200 says so. /health and /slots answering 200 are not logged (polls).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import math
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .api import APIError

log = logging.getLogger("ggufspec.server")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON string may hold one only as half of a pair
NOTE = "ggufspec.note"  # the ASGI scope's key for what the app tells the request log
QUIET_PATHS = frozenset({"/health", "/slots"})  # polled: not logged when they answer 200, as in llama-server


@dataclass(frozen=True)
class Limits:
    """The server's bounds on clients (set from `ggufspec serve`'s options)."""

    max_body: int  # bytes of a request body
    timeout: float  # seconds for a request to arrive, and for a client to take a chunk of its response
    max_connections: int  # open at once
    allowed_hosts: frozenset[str] = frozenset()  # besides this machine's names; "*": any
    cors_origins: tuple[str, ...] = ()  # origins a browser may call from; "*": any


def default_max_body(n_ctx: int) -> int:
    """1 MiB, plus 64 bytes per token of context: a prompt that fills the context, escaped as JSON, fits."""
    return (1 << 20) + 64 * n_ctx


# Connections the kernel may hold before the server accepts them. asyncio accepts up to this many at a time, before
# the cap can close any (llama-server's HTTP library listens with 5).
BACKLOG = 32


def default_max_connections() -> int:
    """Connections the process can hold open: its file-descriptor limit (raised to the hard limit where allowed),
    less those already open, a margin for files and pipes, and room for the bursts asyncio accepts before the cap
    closes connections (a few BACKLOGs): past the limit, accept() fails and the listening socket stalls."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                soft = want
            except (ValueError, OSError):
                pass
    except ImportError:  # Windows: no descriptor limit of this kind
        return 1024
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    return max(8, min(4096, soft - in_use - 32 - 3 * BACKLOG))


# --- requests: hosts, origins, content types, sizes --------------------------------------------------------------

def _host_name(host_header: str) -> str:
    """The name in a Host header, without its port or an IPv6 address's brackets; lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@functools.cache
def _own_names() -> frozenset[str]:
    name = socket.gethostname().lower()
    return frozenset({"localhost", name, f"{name}.local"})


def host_allowed(host_header: str | None, allowed: Iterable[str] = ()) -> bool:
    """A Host header that names this machine: an IP address (a DNS rebinding attack needs a domain name),
    localhost or a *.localhost name, this machine's host name, or one of `allowed` ("*" allows any)."""
    if not host_header:
        return True  # HTTP/1.0 without Host: no browser sends that
    allowed = {a.lower() for a in allowed}
    name = _host_name(host_header)
    return ("*" in allowed or name in allowed or _is_ip(name) or name in _own_names()
            or name.endswith(".localhost"))


def origin_allowed(origin: str, host_header: str | None, cors_origins: Iterable[str]) -> bool:
    """A request's Origin is this server itself, or an origin `--cors-origin` names ("*": any)."""
    origins = set(cors_origins)
    if "*" in origins or origin in origins:
        return True
    return bool(host_header) and origin.split("://", 1)[-1].lower() == host_header.strip().lower()


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


class Boundary:
    """ASGI middleware, outside the app: the checks a request passes on its headers alone, and one place where an
    unexpected error becomes a 500 with a request id (logged once) instead of a traceback per request."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        note: dict[str, Any] = {}
        scope[NOTE] = note
        status = 0

        async def send_marked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                note["error"] = refusal
                return await refusal.response()(scope, receive, send_marked)
            try:
                await self.app(scope, receive, send_marked)
            except Exception as e:
                if note.get("logged") is not e:  # the app's handler answered and logged it, then Starlette raised it
                    err = note["error"] = server_error(e, f"{scope['method']} {scope['path']}")
                    if not status:
                        await err.response()(scope, receive, send_marked)
        finally:
            if not (status == 200 and scope["path"] in QUIET_PATHS):
                log.info("%s", request_line(scope["method"], scope["path"], status, note, time.perf_counter() - t0))

    def refusal(self, scope: Scope) -> APIError | None:
        """The error a request gets from its method and headers alone, if any."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not host_allowed(host, self.limits.allowed_hosts):
            return APIError(403, f"Host {host!r} is not this machine: requests through other names are refused "
                                 "(DNS rebinding); start the server with --allowed-host NAME to allow one",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin and not origin_allowed(origin, host, self.limits.cors_origins):
            return APIError(403, f"requests from web pages at {origin} are refused: start the server with "
                                 f"--cors-origin {origin} to allow them", code="origin_not_allowed")
        if scope["method"] == "POST":
            if not is_json(headers.get("content-type")):
                return APIError(415, "the request body must be JSON, sent with Content-Type: application/json",
                                code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.limits.max_body):
                return too_large(self.limits.max_body)
        return None


def server_error(e: Exception, where: str | None = None) -> APIError:
    """A failure nobody expected: logged once, with its traceback and a new request id; a 500 that names the id."""
    ident = uuid.uuid4().hex[:12]
    log.error("request %s%s failed: %s", ident, f" ({where})" if where else "", e, exc_info=e)
    return APIError(500, f"internal error (request {ident}; the server log has the details)", code="internal_error",
                    kind="server_error", headers={"X-Request-Id": ident})


def note_of(scope: Scope) -> dict[str, Any]:
    """What the app tells the request log about a request: `prompt_tokens`, `stats` (a finished generation's),
    `error` (the APIError it was answered with, or that ended its stream), `left` (its client went away), `logged`
    (the unexpected exception already answered and logged)."""
    return scope.setdefault(NOTE, {})


def request_line(method: str, path: str, status: int, note: dict[str, Any], seconds: float) -> str:
    """The request log's line, e.g. `POST /v1/chat/completions 200: prompt 31 tokens (12 cached), 24 generated at
    85.2 tok/s, 412 ms` or `POST /v1/completions 400: unsupported_parameter (n), 2 ms`."""
    parts = []
    error = note.get("error")
    if isinstance(error, APIError):
        what = error.code or error.kind
        what += f" ({error.param})" if error.param else ""
        ident = (error.headers or {}).get("X-Request-Id")
        what += f", request {ident}" if ident else ""
        parts.append(what if error.status == status else f"the stream failed with {error.status} {what}")
    stats = note.get("stats")
    if stats is not None:
        parts.append(f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached), {stats.generated_tokens} "
                     f"generated at {stats.generation_tps:.1f} tok/s")
    elif "prompt_tokens" in note:
        parts.append(f"prompt {note['prompt_tokens']} tokens")
    if note.get("left"):
        parts.append("the client left")
    parts.append(f"{seconds * 1e3:.0f} ms")
    return f"{method} {path} {status or '-'}: {', '.join(parts)}"


def too_large(limit: int) -> APIError:
    # Connection: close, so that the server does not read the rest of a body it refused.
    return APIError(413, f"the request body is larger than this server takes ({limit} bytes; --max-body)",
                    code="request_too_large", headers={"Connection": "close"})


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, read up to `limit` bytes (413 past it), parsed (400 if it is not JSON, nests too
    deep, or holds an unpaired surrogate or a number that is not finite, naming its field)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer; uvicorn drops it
        raise APIError(400, "the client disconnected before sending its whole body") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request needs a JSON body")
    non_finite: list[float] = []
    try:
        data = json.loads(raw, parse_float=functools.partial(_float, non_finite),
                          parse_constant=functools.partial(_float, non_finite))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if non_finite:
        raise _non_finite_error(data)
    if _SURROGATE_ESCAPE.search(raw):  # a pair decodes to one character; an unpaired half stays and fails later
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), "
                                "which is not text") from None
    return data


def _float(seen: list[float], text: str) -> float:
    """json.loads's hook for a number with a fraction or exponent, and for NaN, Infinity and -Infinity (which
    Python's parser accepts, and JSON has not): the float, noted in `seen` when it is not finite (1e999 too)."""
    value = float(text)
    if not math.isfinite(value):
        seen.append(value)
    return value


def _non_finite_error(data: Any) -> APIError:
    """The 400 for a body holding a non-finite number, naming the first one's field as `parse` does (`a.0.b`)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            param = ".".join(map(str, path)) or None
            return APIError(400, f"{param or 'the request body'}: {json.dumps(value)} is not a finite number (JSON "
                                 "has no NaN or Infinity; a number too large for a float becomes Infinity)",
                            param=param)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((path + (k,), v) for k, v in reversed(list(items)))
    return APIError(400, "the request body holds a number that is not finite")


# --- connections -------------------------------------------------------------------------------------------

class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines and a cap on open connections (see the module's docstring).

    uvicorn closes idle keep-alive connections after a response; this adds what it lacks against slow or idle
    clients: the same idle bound for a new connection until its first byte, a deadline for each request's head and
    body from its first byte, one for a stalled write, and the cap."""

    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.opened = time.monotonic()
        self._read_deadline = None  # TimerHandle while a request is arriving
        self._write_deadline = None  # TimerHandle while the transport's buffer is full

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # idle until its first byte, as after a response: uvicorn's keep-alive timer, which data_received cancels
        # (the request's --timeout starts there); a client that never sends a byte held the connection 60 s
        self.timeout_keep_alive_task = self.loop.call_later(min(self.timeout_keep_alive, self.limits.timeout),
                                                            self.timeout_keep_alive_handler)
        open_ = [c for c in self.connections if isinstance(c, BoundedH11Protocol) and not c.transport.is_closing()]
        if len(open_) > self.limits.max_connections:
            self._make_room(open_)

    def data_received(self, data: bytes) -> None:
        if self._read_deadline is None and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm_read()  # the first byte of a request: the connection's first, or one after a response
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read()
        self._disarm_write()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_deadline is None:
            self._write_deadline = self.loop.call_later(self.limits.timeout, self._drop)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _arm_read(self) -> None:
        self._disarm_read()
        self._read_deadline = self.loop.call_later(self.limits.timeout, self._drop)

    def _disarm_read(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm_write(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def _drop(self) -> None:
        """Past a deadline: close the connection (a request being read or answered sees its client gone)."""
        if not self.transport.is_closing():
            self.transport.abort()

    def serving(self) -> bool:
        """A whole request has arrived and its response is not finished."""
        return self.cycle is not None and not self.cycle.response_complete and self.conn.their_state is h11.DONE

    def _make_room(self, open_: list[BoundedH11Protocol]) -> None:
        """Over the cap: close the oldest open connection not being answered (idle, or still sending its request);
        when every other one is being answered, refuse this one with a 503."""
        idle = [c for c in open_ if c is not self and not c.serving()]
        if idle:
            min(idle, key=lambda c: c.opened)._drop()
            return
        body = b"too many connections are open; retry later"
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
                             b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()
