"""Long waits (waiting.py): a spinner on a terminal only, erased when the wait ends; nothing in pipes, off the main
thread, inside another wait, or with GGUFSPEC_PROGRESS=0."""

from __future__ import annotations

import io
import threading

import pytest

from ggufspec import waiting
from ggufspec.waiting import PROGRESS_ENV, waiting as wait_for


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and signals its first write."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        n = super().write(text)
        self.written.set()
        return n


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)


def test_a_terminal_shows_a_spinner_and_gets_a_clean_line_back() -> None:
    term = Terminal()
    with wait_for("loading model.gguf", stream=term, after=0) as wait:
        assert term.written.wait(timeout=60)  # its first frame (after=0: at once)
        wait.label = "loading model.gguf, still"
    drawn = term.getvalue()
    assert drawn.startswith("\r| loading model.gguf (0 s)")
    erase = "\r" + " " * max(len(line) for line in drawn.split("\r")[1:-2]) + "\r"
    assert drawn.endswith(erase), repr(drawn)  # the line is blank again, the cursor at its start


def test_a_pipe_gets_nothing() -> None:
    pipe = io.StringIO()  # isatty() is False: a pipe, a file, a test reading stderr
    with wait_for("loading model.gguf", stream=pipe, after=0) as wait:
        assert not wait.spinning
    assert pipe.getvalue() == ""


def test_a_request_thread_gets_nothing() -> None:
    """A server's requests run off the main thread: their prefills log lines, no spinner."""
    term, threads = Terminal(), []

    def request() -> None:
        with wait_for("decoding the prompt (5000 tokens)", stream=term, after=0) as wait:
            threads.append(wait.spinning)

    t = threading.Thread(target=request)
    t.start()
    t.join()
    assert threads == [False] and term.getvalue() == ""


def test_a_wait_inside_another_shows_nothing_of_its_own() -> None:
    outer, inner = Terminal(), Terminal()
    with wait_for("measuring", stream=outer, after=0):
        with wait_for("loading", stream=inner, after=0) as wait:
            assert not wait.spinning
    assert inner.getvalue() == ""
    with wait_for("loading", stream=inner, after=0) as wait:  # the outer one gone: free again
        assert wait.spinning


def test_the_environment_turns_it_off_or_on(monkeypatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not waiting.wanted(Terminal())
    monkeypatch.setenv(PROGRESS_ENV, "1")  # asked for: on any stream
    assert waiting.wanted(io.StringIO())


def test_show_false_draws_nothing() -> None:
    """As a model load does while llama.cpp's own log lines are on (--verbose)."""
    term = Terminal()
    with wait_for("loading", show=False, stream=term, after=0) as wait:
        assert not wait.spinning
    assert term.getvalue() == ""


def test_hidden_inside_the_block_only_unless_asked(monkeypatch) -> None:
    """`generate --json` hides it: what it prints is for a program to read. Only while it runs: a process that runs
    commands in turn (this test session runs generate --json in-process) shows the next one's waits."""
    assert waiting.wanted(Terminal())
    with waiting.hidden():
        assert not waiting.wanted(Terminal())
        monkeypatch.setenv(PROGRESS_ENV, "1")
        assert waiting.wanted(Terminal())
        monkeypatch.delenv(PROGRESS_ENV)
    assert waiting.wanted(Terminal())