"""The child process `chat.ChatRenderer` renders chat templates in: a template comes from a model file, and a
hostile or broken one may loop, recurse, raise anything, or build strings until the machine runs out of memory.

Here it can only fail: its address space is capped (where the OS enforces RLIMIT_AS), a watchdog ends the process
when one rendering outlives its time or the parent goes away, and every error comes back as a message. The
rendering itself is llama-cpp-python's `Jinja2ChatFormatter` (a sandboxed Jinja environment), exactly as before.

Protocol, one JSON object per line: the parent first sends {"template", "bos", "eos", "seconds", "memory"}; then
{"id", "messages", "max_chars"} per rendering, answered by {"id", "text"}, {"id", "too_long": n} or {"id", "error"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def _cap_memory(extra_bytes: int) -> None:
    """Cap the address space at what it is now plus `extra_bytes` (Linux; elsewhere RLIMIT_AS is not enforced)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (now + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, OSError, ValueError):
        pass


class _Watchdog(threading.Thread):
    """Ends the process when a rendering runs past its time (the parent kills it too; this covers a parent that
    is gone or stuck) or when the parent process is gone."""

    def __init__(self, seconds: float) -> None:
        super().__init__(daemon=True)
        self.seconds, self.started_at, self.parent = seconds, None, os.getppid()

    def run(self) -> None:
        while True:
            time.sleep(0.2)
            started = self.started_at
            if os.getppid() != self.parent or (started is not None and time.monotonic() - started > self.seconds + 1):
                os._exit(3)


def _describe(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "it needs more memory than a chat template may use"
    if isinstance(e, RecursionError):
        return "it recurses too deeply"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is the parent's to handle
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # ~0.2 s: before the spec, so a spare child waits ready

    line = sys.stdin.readline()
    if not line:
        return  # a spare child its parent never used
    spec = json.loads(line)

    _cap_memory(spec["memory"])
    watchdog = _Watchdog(spec["seconds"])
    watchdog.start()
    formatter, compile_error = None, None
    try:
        formatter = Jinja2ChatFormatter(spec["template"], spec["eos"], spec["bos"], add_generation_prompt=True)
    except BaseException as e:  # a syntax error, or anything else a template's compilation raises
        compile_error = _describe(e)
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict = {"id": request["id"]}
        if formatter is None:
            reply["error"] = compile_error
        else:
            watchdog.started_at = time.monotonic()
            try:
                text = formatter(messages=request["messages"]).prompt
                if len(text) > request["max_chars"]:
                    reply["too_long"] = len(text)
                else:
                    reply["text"] = text
            except BaseException as e:  # whatever the template raises is its error, reported, never fatal here
                reply["error"] = _describe(e)
            finally:
                text = None
                watchdog.started_at = None
        try:
            out = json.dumps(reply)
        except MemoryError:
            out = json.dumps({"id": request["id"], "error": _describe(MemoryError())})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
