"""Long waits shown on a terminal: a spinner on stderr while a model loads, `auto` measures this machine's costs or a
long prompt is decoded, so that a run is never silent for long before its first token.

Contract: nothing is written for a wait shorter than SHOW_AFTER seconds, nor where stderr is not a terminal (pipes,
files, tests that parse stderr), nor off the main thread (a server's request threads log lines instead), nor inside
hidden() (`generate --json`); GGUFSPEC_PROGRESS=0 turns the spinner off, =1 shows it on any stream (on request). A
shown spinner is erased when the wait ends, so the text that follows starts on a clean line. One spinner at a time:
a wait inside another shows nothing of its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

SHOW_AFTER = 2.0  # seconds of silence that are fine; longer waits get the spinner
PROGRESS_ENV = "GGUFSPEC_PROGRESS"
FRAMES = "|/-\\"
TICK = 0.2  # seconds between frames

_showing = threading.Lock()  # held by the spinner on screen: one at a time
_hidden = 0  # hidden() blocks around now: none inside them unless asked


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """No spinner inside the block, unless GGUFSPEC_PROGRESS=1 asks for it (`generate --json`: what it prints is for
    a program to read). Scoped, not for the rest of the process: a process that runs commands in turn (a test
    session, a notebook) shows the next one's waits again."""
    global _hidden
    _hidden += 1
    try:
        yield
    finally:
        _hidden -= 1


def wanted(stream: TextIO) -> bool:
    """Whether a wait may show a spinner on `stream`: GGUFSPEC_PROGRESS says so ("1" yes, "0" no), else only where
    not inside hidden(), on the main thread, and where `stream` is a terminal."""
    forced = os.environ.get(PROGRESS_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    if _hidden or threading.current_thread() is not threading.main_thread():
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class Wait:
    """One wait's spinner: `label` (which may change while it runs, e.g. a try's number) and the seconds so far,
    drawn on one line of `stream` after `after` seconds, every TICK seconds, until stop() erases it."""

    def __init__(self, label: str, stream: TextIO | None = None, after: float = SHOW_AFTER) -> None:
        self.label, self.stream, self.after = label, stream or sys.stderr, after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0  # characters drawn on the line so far, erased by stop()

    @property
    def spinning(self) -> bool:
        """Whether this wait runs a spinner: True from a start() that the rules allowed (see the module's contract)
        until stop(), even before its first frame is drawn (`after` seconds in); False for a wait that shows
        nothing (a pipe, another thread, inside another wait, show=False, hidden())."""
        return self._thread is not None

    def start(self, show: bool = True) -> Wait:
        """Start the spinner's thread where `show` and wanted() allow it and no other spinner is on screen."""
        if show and wanted(self.stream) and _showing.acquire(blocking=False):
            self._thread = threading.Thread(target=self._run, name="ggufspec-wait", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop drawing and erase what was drawn; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        if self._width:
            self._write("\r" + " " * self._width + "\r")
        _showing.release()

    def _run(self) -> None:
        t0 = time.monotonic()
        if self._stop.wait(self.after):
            return
        frame = 0
        while not self._stop.is_set():
            line = f"{FRAMES[frame % len(FRAMES)]} {self.label} ({time.monotonic() - t0:.0f} s)"
            self._write("\r" + line.ljust(self._width))
            self._width = max(self._width, len(line))
            frame += 1
            self._stop.wait(TICK)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal: the wait goes on without its spinner
            pass


@contextlib.contextmanager
def waiting(label: str, show: bool = True, stream: TextIO | None = None, after: float = SHOW_AFTER) -> Iterator[Wait]:
    """A spinner labelled `label` for the duration of the block (see the module's contract); `show` False: none
    (e.g. while llama.cpp's own log lines are on). Yields the Wait, whose label the block may update."""
    wait = Wait(label, stream, after).start(show)
    try:
        yield wait
    finally:
        wait.stop()
