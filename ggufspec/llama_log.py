"""The callbacks ggufspec gives llama.cpp: its log (silent unless verbose, or routed to a capture), the model
loader's progress and the computation's abort check, through which Ctrl-C stops a load or a long batch.

llama.cpp keeps the C function pointers, so the ctypes callbacks live at module level forever (a collected
callback crashes later in unrelated code). Captures swap the Python sink only.

Python runs its Ctrl-C handler at the next Python code of the main thread, which during a llama.cpp call is one of
these callbacks: its KeyboardInterrupt could only be printed as "Exception ignored" and dropped, and the load or
batch would go on. So `interruptible()` holds Ctrl-C in a flag around such calls instead; the progress callback and
the abort check read it to stop llama.cpp, and the KeyboardInterrupt is raised once the call returns.
"""

from __future__ import annotations

import _signal  # signal's own functions, without signal.py's enum conversions (~20 us a token: a stream swaps twice)
import ctypes
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import llama_cpp

_state = threading.local()
_verbose = False
_callback = None
_held_interrupt = False  # Ctrl-C pressed inside interruptible(), not raised yet


# A path to one of llama.cpp's source files, as its asserts and aborts print __FILE__: the folder it was
# compiled in (a pip build's temp folder, a user's home) means nothing to whoever reads the message, and tells a
# client about the server's machine.
_SOURCE_PATH = re.compile(r"(?<![^\s'\"(])(?:[A-Za-z]:)?[^\s:'\"(]*[/\\]"  # a path, from a word's start
                          r"([^/\\\s:'\"]+\.(?:c|cc|cpp|cu|h|hpp|m|metal))\b")  # to a source file's name


def without_build_paths(text: str) -> str:
    """llama.cpp's `text` with each source file's path cut to its name: `/tmp/pip-wheel-x/.../ggml-rpc.cpp:566: ...`
    becomes `ggml-rpc.cpp:566: ...` (the file and line stay: they say where it failed)."""
    return _SOURCE_PATH.sub(r"\1", text)


def _sink() -> Callable[[str], None] | None:
    return getattr(_state, "sink", None)


@llama_cpp.llama_log_callback
def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    msg = text.decode("utf-8", errors="replace") if text else ""
    sink = _sink()
    if sink is not None:
        sink(msg)
    if _verbose:
        sys.stderr.write(msg)


@llama_cpp.llama_progress_callback
def load_progress(progress: float, user_data: ctypes.c_void_p) -> bool:
    """llama_model_params.progress_callback: False (stop loading) once Ctrl-C was pressed."""
    return not _held_interrupt


@llama_cpp.ggml_abort_callback
def abort_check(user_data: ctypes.c_void_p) -> bool:
    """llama_set_abort_callback's check, run by llama.cpp's CPU backend between graph nodes on the calling thread:
    True (abort the decode) once Ctrl-C was pressed. Calling into Python is what lets the signal handler run."""
    return _held_interrupt


NO_ABORT_CHECK = llama_cpp.ggml_abort_callback()  # a NULL function pointer: no check


def _hold(signum: int, frame: object) -> None:
    global _held_interrupt
    _held_interrupt = True


_MAIN = threading.main_thread().ident


class interruptible:
    """Around a llama.cpp call, or a wait for the decode thread's: Ctrl-C sets the flag the callbacks read (on any
    thread: the decode thread's abort check too) instead of raising inside one of them, and is raised as
    KeyboardInterrupt when the block ends. Only on the main thread with Python's own handler in place (a server
    installs its own); elsewhere, and nested, the block neither holds nor raises it. (A class, not a
    @contextmanager: a stream enters one for every token.)"""

    __slots__ = ("_swap",)

    def __enter__(self) -> None:
        self._swap = threading.get_ident() == _MAIN and _signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if self._swap:
            _signal.signal(signal.SIGINT, _hold)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        global _held_interrupt
        if not self._swap:
            return
        _signal.signal(signal.SIGINT, signal.default_int_handler)
        if _held_interrupt and kind is None:  # (an exception on its way out goes first, as from a try/finally)
            _held_interrupt = False
            raise KeyboardInterrupt


def interrupt_held() -> bool:
    """Whether Ctrl-C was pressed inside interruptible() and is held until its block ends."""
    return _held_interrupt


def install(verbose: bool = False) -> None:
    """Route llama.cpp's log through ggufspec (idempotent); `verbose` echoes it to stderr."""
    global _verbose, _callback
    _verbose = _verbose or verbose
    if _callback is None:
        _callback = _log
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


@contextmanager
def capture(sink: Callable[[str], None]) -> Iterator[None]:
    """Send llama.cpp log text produced on this thread to `sink` while the block runs."""
    install()
    previous = _sink()
    _state.sink = sink
    try:
        yield
    finally:
        _state.sink = previous
