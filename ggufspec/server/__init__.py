"""`ggufspec serve`: an OpenAI-compatible HTTP server (FastAPI, uvicorn), a thin layer over an `EnginePool` (N slots).

- `api`: OpenAI's request and response shapes, and its error object.
- `boundary`: what a connection and a request must satisfy before any work is done for them (hosts, origins,
  content types, sizes, deadlines, the cap on connections), and the 500 with a request id.
- `worker`: the threads (one per slot of the engine pool, `--parallel`) that render, tokenize and generate the
  requests, up to one per slot at once, in arrival order, with the queue.
- `app`: the endpoints.

This module runs the whole: it listens, serves until SIGTERM or Ctrl-C, then cuts the generations in flight so that
every stream ends with a final chunk and `[DONE]`, and returns (the CLI exits 0 after SIGTERM, 130 after Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from ..engine import GenerationSettings, SpeculativeEngine
from ..pool import EnginePool
from ..errors import GGUFSpecError
from .app import create_app
from .boundary import BACKLOG, BoundedH11Protocol, Limits, log
from .worker import Worker

GRACEFUL_SECONDS = 5  # after a signal: how long streams (cut at their next token) may take to finish
_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

__all__ = ["Limits", "create_app", "serve"]


def serve(engine: EnginePool | SpeculativeEngine, settings: GenerationSettings, model_id: str, host: str, port: int,
          queue: int, api_key: str | None, limits: Limits, announce: Callable[[str], None]) -> None:
    """Run the server on `engine`'s slots (a SpeculativeEngine alone: one slot) until SIGTERM / SIGHUP (return) or
    Ctrl-C (KeyboardInterrupt); then stop generation and free the engine's worker threads (the caller closes the
    engine)."""
    _log_to_stderr()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise GGUFSpecError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    worker = Worker(engine, queue)
    app = create_app(worker, settings, model_id, limits, api_key)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http=functools.partial(BoundedH11Protocol, limits=limits),
                            backlog=BACKLOG, timeout_keep_alive=5, timeout_graceful_shutdown=GRACEFUL_SECONDS)
    server = _Server(config, on_signal=worker.cut_all)
    slots = f", {worker.parallel} slots of {worker.engine.n_ctx} tokens" if worker.parallel > 1 else ""
    announce(f"ggufspec: serving {model_id} on http://{host}:{port}/v1 ({worker.engine.describe(settings)}{slots}); "
             "Ctrl-C stops")
    try:
        asyncio.run(_run(server, sock))
    finally:
        worker.shutdown()
        sock.close()
    if server.signals:
        announce(f"ggufspec: stopped ({signal.Signals(server.signals[0]).name})")
    if signal.SIGINT in server.signals:
        raise KeyboardInterrupt


async def _run(server: _Server, sock: socket.socket) -> None:
    asyncio.get_running_loop().set_exception_handler(_quiet_exceptions())
    await server.serve(sockets=[sock])


class _Server(uvicorn.Server):
    """uvicorn's Server, with its signals: the first one cuts the generations in flight (so their streams end
    properly within the graceful timeout) and starts the shutdown; a second Ctrl-C forces it. Unlike uvicorn's own
    handling, the signal is not raised again afterwards (that made the process die by SIGTERM)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.signals: list[int] = []

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        self.on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _log_to_stderr() -> None:
    """ggufspec's server log: one line per event on stderr (one per request, see `boundary.request_line`); a
    request's 500 with its traceback, once. A task that uvicorn cancels at the end of the graceful timeout is not
    logged as an application error."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ggufspec: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO)
    logging.getLogger("uvicorn.error").addFilter(
        lambda r: not (r.exc_info and isinstance(r.exc_info[1], asyncio.CancelledError)))


def _quiet_exceptions() -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """The event loop's error handler: out of file descriptors, asyncio reports every failed accept(); report it
    once a minute instead (the cap on connections keeps it from happening in the first place)."""
    last: dict[str, float] = {}

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = context.get("message", "")
        if "out of system resource" in message:
            now = loop.time()
            if now - last.get(message, -60.0) >= 60.0:
                last[message] = now
                log.warning("%s: %s (more connections than this process may open; further reports muted for 60 s)",
                            message, context.get("exception"))
            return
        loop.default_exception_handler(context)

    return handle
