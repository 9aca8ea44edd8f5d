"""Decoders in a child process: `DecoderProcess` holds LlamaCppDecoders, `IsolatedDecoder` is one of them as seen from
the parent, with the Decoder contract over a socket pair.

For models on llama.cpp's RPC devices. ggml-rpc aborts the process whose RPC server dies, stalls past its socket or
answers garbage; here that process is the child, and the parent gets an RPCError (with llama.cpp's message) from
the call that was waiting, within `timeout` seconds, while everything it holds (the text so far, a server's other
state) lives on. Every decoder on RPC devices shares one child, since an rpc-server serves one client (one
connection) at a time.

The parent keeps what needs no llama.cpp context: the vocabulary and metadata (a vocab-only load of the same file),
the options, and a mirror of the decoder's counters and token history, sent back with each call's result.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .decoder import DecoderOptions, LlamaCppDecoder
from .history import common_prefix
from .lockstep import DecodeSteps
from .errors import GGUFSpecError, RPCError
from .ggml_api import ABORT_CALLBACK, ggml
from .llama_log import without_build_paths
from .gguf_check import read_header
from .model import LlamaModel
from .rpc import Endpoint, check, parse_endpoints

# the decoder attributes that change with its calls, mirrored in the parent after each one (history: as a diff)
STATE = ("n_ctx", "n_ubatch", "kv_type", "kv_type_v", "decode_seconds", "n_decodes", "n_decoded_tokens",
         "n_batched_tokens", "last_batch", "n_shifts", "n_deferred", "shift_keep", "hold_seconds")
SETTABLE = ("shift_keep",)  # attributes the engine sets, forwarded to the child
STATIC = ("weight_buffers", "cpu_backend", "n_embd", "lane", "peers", "last_tick", "memory", "n_rs_seq")
LOAD_SECONDS = 600.0  # a load sends the weights over the network: bounded, but generously
_ABORTED = 70  # the child's exit status after llama.cpp's abort callback ran


class DecoderProcess:
    """A child process holding decoders (`open`), alive until `close` or until llama.cpp aborts it.

    `timeout`: the longest one call (a decode) may take before the child is taken for stalled, killed, and the
    call fails with RPCError. After a failure every decoder of this process raises it until `recover()` has started a
    fresh child and opened them again there (empty)."""

    def __init__(self, timeout: float = 60.0, endpoints: tuple[Endpoint, ...] = ()) -> None:
        self.timeout, self.endpoints = timeout, endpoints
        self.label = (f"RPC server{'s' if len(endpoints) > 1 else ''} {', '.join(map(str, endpoints))}" if endpoints
                      else "the decoders' process")
        self.failure: RPCError | None = None
        self.decoders: list[IsolatedDecoder] = []  # open ones, reopened by recover()
        self.recovering = self.closed = False
        self.round_trip = 0.0  # seconds: the endpoints' slowest handshake, when open_target made this process and
        # again at each recovery (a restarted server, a new tunnel: another link)
        self._lock = threading.Lock()  # one call at a time on the pipe
        self._stale: list[int | None] = []  # handles of calls whose replies the parent stopped waiting for (Ctrl-C)
        self._start()

    def _start(self) -> None:
        # a fresh interpreter: fork would copy llama.cpp's threads and locks mid-state, and multiprocessing's spawn
        # would run the caller's script again in the child where it lacks an `if __name__ == "__main__"` guard
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # imports as this process does
        self._proc = subprocess.Popen([sys.executable, "-m", "ggufspec.isolated", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._stale, self.failure = [], None

    @property
    def alive(self) -> bool:
        return self.failure is None and self._proc.poll() is None

    def open(self, path: str | os.PathLike, options: DecoderOptions) -> IsolatedDecoder:
        """Load a model in the child (RPCError where its servers fail, the child's own error otherwise)."""
        info = self.call(None, "open", (str(path), options), timeout=LOAD_SECONDS)
        d = IsolatedDecoder(self, info, path, options)
        self.decoders.append(d)
        return d

    def call(self, handle: int | None, name: str, args: tuple = (), kwargs: dict | None = None,
             timeout: float | None = None) -> Any:
        """Run decoder `handle`'s method `name` in the child; its result (for decoders: with their state)."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            status, value = self._exchange(handle, name, args, kwargs or {}, timeout or self.timeout)
        if status == "error":
            raise value
        return value

    def _exchange(self, handle: int | None, name: str, args: tuple, kwargs: dict, timeout: float) -> tuple[str, Any]:
        try:
            while self._stale:  # a late reply still changed its decoder: mirror that
                status, value = self._receive(self.timeout)
                late = self._stale.pop(0)
                if status == "ok" and late is not None:
                    next(d for d in self.decoders if d._handle == late)._mirror(value[1])
            self._conn.send((handle, name, args, kwargs))
            return self._receive(timeout)
        except KeyboardInterrupt:
            self._stale.append(handle)  # its reply comes later: drained before the next call
            raise

    def _receive(self, timeout: float) -> tuple[str, Any]:
        try:
            ready = self._conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self._end(kill=True)
            self._fail(f"no answer from {self.label} within {timeout:g} s (--rpc-timeout); gave up on them")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._end()
            self._fail(f"the process that talks to {self.label} ended (exit status {self._proc.returncode})")
        if reply[0] == "abort":
            self._end()
            self._fail(f"{self.label} failed: llama.cpp says {without_build_paths(reply[1].strip())!r}")
        return reply

    def _fail(self, why: str) -> None:
        self.failure = RPCError(why)
        self._conn.close()
        raise self.failure

    def recover(self) -> None:
        """A fresh child (the old one killed) with every open decoder loaded again, empty; RPCError if it fails.
        Until they are all back, `failure` stays set and other calls wait."""
        with self._lock:
            if self.closed:
                raise RPCError("these decoders are closed")
            failure = self.failure
            self._shutdown()
            self._start()
            self.failure = failure
            for d in self.decoders:
                status, value = self._exchange(None, "open", (str(d.path), d.asked), {}, LOAD_SECONDS)
                if status == "error":
                    raise value
                d._attach(value)
            self.failure = None

    def recover_when_back(self, interval: float = 1.0) -> None:
        """In a thread (one at a time): wait until every endpoint answers the handshake, then recover(), with
        `round_trip` measured by that handshake."""
        with self._lock:
            if self.recovering or self.failure is None:
                return
            self.recovering = True

        def attempt() -> None:
            try:
                while not self.closed:
                    try:
                        round_trips = check(self.endpoints, timeout=min(5.0, self.timeout))
                        self.round_trip = max(round_trips.values())  # before recover() lets requests in
                        self.recover()
                        return
                    except GGUFSpecError:  # not back yet (or failed again while loading): try again
                        time.sleep(interval)
            finally:
                self.recovering = False

        threading.Thread(target=attempt, name="ggufspec-rpc-recovery", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._shutdown()
            self.closed = True
            if self.failure is None:
                self.failure = RPCError("these decoders are closed")

    def _shutdown(self) -> None:
        if self._proc.poll() is None and self.failure is None:
            try:
                self._conn.send(None)  # the child frees its decoders and exits
            except (OSError, ValueError):
                pass
        self._end(wait=10)
        self._conn.close()

    def _end(self, kill: bool = False, wait: float = 5) -> None:
        """Wait up to `wait` seconds for the child to exit (after killing it), then kill it."""
        if kill:
            self._proc.kill()
        try:
            self._proc.wait(wait)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class IsolatedDecoder(DecodeSteps):
    """A LlamaCppDecoder living in a DecoderProcess: the same methods and attributes (arrays come back as copies,
    never views), and RPCError from any call once the child has failed.

    Closing it frees the child's decoder; closing the last decoder of a DecoderProcess ends that process."""

    def __init__(self, process: DecoderProcess, info: dict, path: str | os.PathLike, options: DecoderOptions) -> None:
        d = self.__dict__  # __setattr__ forwards SETTABLE names to the child
        d["process"], d["asked"] = process, options
        d["path"] = Path(path).expanduser().resolve()
        d["header"] = read_header(d["path"])
        d["model"] = LlamaModel(d["path"], d["header"], vocab_only=True, verbose=options.verbose)
        d["vocab"], d["n_vocab"] = d["model"].vocab, d["model"].n_vocab
        self._attach(info)

    def _attach(self, info: dict) -> None:
        """The child's decoder `info` describes (just opened): its handle, options and state, an empty history."""
        d = self.__dict__
        d["_handle"], d["options"], d["history"] = info["handle"], info["options"], []
        for name in STATIC:
            d[name] = info[name]
        self._mirror(info["state"])

    def _mirror(self, state: dict) -> None:
        keep, tail = state.pop("history")
        h = self.__dict__["history"]
        del h[keep:]
        h.extend(tail)
        self.__dict__.update(state)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        result, state = self.process.call(self._handle, name, args, kwargs)
        self._mirror(state)
        return result

    def __getattr__(self, name: str) -> Any:  # methods only: attributes were set in __init__ or by _mirror
        if name.startswith("_") or not callable(getattr(LlamaCppDecoder, name, None)):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in SETTABLE:
            raise AttributeError(f"{name} cannot be set on a decoder in another process")
        self._call("__setattr__", name, value)

    def metadata(self, key: str) -> str | None:
        return self.model.metadata(key)

    @property
    def kv_cache(self) -> str:
        return LlamaCppDecoder.kv_cache.fget(self)  # type: ignore[attr-defined]

    @property
    def shared(self) -> bool:
        return False

    def close(self) -> None:
        """Free the child's decoder; the last one of its DecoderProcess closes that too."""
        if self.__dict__.get("_handle") is None:
            return
        if self.process.alive:
            try:
                self.process.call(self._handle, "close")
            except GGUFSpecError:
                pass
        self.__dict__["_handle"] = None
        self.model.close()
        self.process.decoders.remove(self)
        if not self.process.decoders:
            self.process.close()

    def __enter__(self) -> IsolatedDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_target(path: str | os.PathLike, options: DecoderOptions, draft_path: str | os.PathLike | None = None,
                draft_options: DecoderOptions | None = None) -> tuple[IsolatedDecoder, IsolatedDecoder | None]:
    """The target (and the draft too, given draft_options) on options.rpc's servers, in one new DecoderProcess."""
    endpoints = parse_endpoints(options.rpc)
    round_trips = check(endpoints)  # before the child connects: an rpc-server answers one client at a time
    process = DecoderProcess(options.rpc_timeout, endpoints)
    process.round_trip = max(round_trips.values())
    try:
        target = process.open(path, options)
        draft = process.open(draft_path, draft_options) if draft_options is not None else None
    except BaseException:
        process.close()
        raise
    return target, draft


# --- the child --------------------------------------------------------------------------------

def _child_main(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _on_abort(conn)
    decoders: dict[int, LlamaCppDecoder] = {}
    sent: dict[int, list[int]] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            msg = None
        if msg is None:
            for d in decoders.values():
                d.close()
            os._exit(0)  # llama.cpp's RPC threads must not hold the exit up
        handle, name, args, kwargs = msg
        try:
            if handle is None:  # open
                path, options = args
                d = LlamaCppDecoder(path, options)
                handle = len(decoders) + 1
                decoders[handle], sent[handle] = d, []
                value: Any = {"handle": handle, "options": d.options, **{n: getattr(d, n) for n in STATIC},
                              "state": _state(d, sent[handle])}
            else:
                d = decoders[handle]
                result = getattr(d, name)(*args, **kwargs)
                value = (result, _state(d, sent[handle]))  # arrays pickle as copies, views included
            conn.send(("ok", value))
        except Exception as e:  # noqa: BLE001 - sent to the parent, raised there
            conn.send(("error", e if _picklable(e) else GGUFSpecError(str(e))))


def _state(d: LlamaCppDecoder, sent: list[int]) -> dict:
    h = d.history
    keep = common_prefix(sent, h)
    state = {n: getattr(d, n) for n in STATE}
    state["history"] = (keep, h[keep:])
    del sent[keep:]
    sent.extend(h[keep:])
    return state


def _picklable(e: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:  # noqa: BLE001
        return False


_abort_callback = None  # kept alive: llama.cpp holds the pointer


def _on_abort(conn: Connection) -> None:
    """llama.cpp's abort callback: tell the parent why, and end without SIGABRT (no core dump, no backtrace)."""
    global _abort_callback

    def report(message: bytes) -> None:
        try:
            conn.send(("abort", message.decode("utf-8", "replace")))
        finally:
            os._exit(_ABORTED)

    _abort_callback = ABORT_CALLBACK(report)
    ggml().ggml_set_abort_callback(_abort_callback)


if __name__ == "__main__":  # DecoderProcess's child: python -m ggufspec.isolated FD
    _child_main(Connection(int(sys.argv[1])))
