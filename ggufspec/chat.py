"""Chat prompts: messages rendered with the Jinja chat template stored in the GGUF, then tokenized.

A template is code from a model file. It runs in a child process (`template_sandbox`) under a time limit, a memory
cap and a bound on the text it may return, so that a template that loops, recurses, raises or renders gigabytes
gives one clear error instead of a hang, a traceback or an exhausted machine; and a rendering can be cancelled.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TypedDict

import llama_cpp

from .errors import Cancelled, ContextLengthError, GGUFSpecError
from .vocab import Vocab

RENDER_SECONDS = 5.0  # a real template renders a long conversation in milliseconds
RENDER_MEMORY = 512 << 20  # bytes the child may allocate past its start-up
# The rendering a context could hold is bounded at this many characters a token, before the exact bound from the
# vocabulary's longest token (`Vocab.encode`), which costs a pass over the vocabulary: a token spells at most 81
# bytes in SmolLM2's vocabulary, and no vocabulary known here comes near 256.
RENDER_CHARS_PER_TOKEN = 256
MAX_RENDERERS = 8  # child processes kept, one per (template, BOS, EOS), the least recently used closed first


class Message(TypedDict):
    role: str
    content: str


class ChatRenderer:
    """One chat template, rendered in its own child process; thread-safe (one rendering at a time).

    The child starts when this object is made and is started again after a timeout, a cancellation or a crash.
    """

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "", seconds: float = RENDER_SECONDS) -> None:
        self.spec = {"template": template, "bos": bos_token, "eos": eos_token, "seconds": seconds, "memory": RENDER_MEMORY}
        self.seconds = seconds
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._start()

    def _start(self) -> None:
        self._proc = _take_spare() or _spawn()
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._replies), daemon=True).start()
        self._send(self.spec)

    @staticmethod
    def _read(proc: subprocess.Popen, replies: queue.Queue) -> None:
        """The child's replies into `replies`, then None when it is gone (this thread owns and closes its stdout)."""
        try:
            for line in proc.stdout:
                replies.put(json.loads(line))
        except (OSError, ValueError):
            pass
        finally:
            proc.stdout.close()
            replies.put(None)

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # the child died: its reader puts None, and the rendering reports it

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            self._proc = None

    def render(self, messages: list[Message], max_chars: int, cancelled: Callable[[], bool] | None = None) -> str:
        """The prompt text for `messages` with the generation prompt added.

        Raises GGUFSpecError when the template fails (its error named), takes longer than `seconds`, or renders
        nothing; ContextLengthError when it renders more than `max_chars` characters; Cancelled when `cancelled()`
        turns true first (checked every 50 ms)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            ident = next(self._ids)
            self._send({"id": ident, "messages": messages, "max_chars": max_chars})
            reply = self._wait(ident, cancelled)
        if reply is None:
            raise GGUFSpecError("the model's chat template crashed its renderer (it exhausted the memory or the "
                                "time it may use)")
        if "error" in reply:
            raise GGUFSpecError(f"the model's chat template failed: {reply['error']}")
        if "too_long" in reply:
            raise ContextLengthError(f"the chat template rendered {reply['too_long']} characters, more than the "
                                     f"{max_chars} that can fit the context")
        if not reply["text"]:
            raise GGUFSpecError("the model's chat template rendered an empty prompt for these messages")
        return reply["text"]

    def _wait(self, ident: int, cancelled: Callable[[], bool] | None) -> dict | None:
        """The child's reply to request `ident`, None if the child died; kills the child on timeout, cancellation
        or an exception here (Ctrl-C), since its state is then unknown."""
        deadline, done = time.monotonic() + self.seconds, False
        try:
            while True:
                try:
                    reply = self._replies.get(timeout=0.05)
                except queue.Empty:
                    if cancelled is not None and cancelled():
                        raise Cancelled("the request was cancelled while its chat template rendered") from None
                    if time.monotonic() > deadline:
                        raise GGUFSpecError(f"the model's chat template did not finish within {self.seconds:g} s "
                                            "(it may loop without end)") from None
                    continue
                if reply is None or reply["id"] == ident:
                    done = reply is not None
                    return reply
        finally:
            if not done:
                self._kill()

    def close(self) -> None:
        with self._lock:
            self._kill()


@cache
def builtin_template_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (llama_chat_builtin_templates: chatml, llama3, gemma, ...)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return tuple(sorted(name.decode() for name in names))


@dataclass(frozen=True)
class BuiltinTemplate:
    """One of llama.cpp's built-in chat templates, by name (`--chat-template chatml`, as llama-cli takes it).

    llama_chat_apply_template renders it: C++ code of llama.cpp's own, not a template from a model file, so it runs
    here, without ChatRenderer's sandbox, and takes the same `render` call."""

    name: str

    def render(self, messages: list[Message], max_chars: int, cancelled: Callable[[], bool] | None = None) -> str:
        """The prompt text for `messages` with the assistant's turn opened; errors as ChatRenderer.render's."""
        if any("\0" in m["role"] or "\0" in m["content"] for m in messages):  # C strings would end there
            raise GGUFSpecError(f"a message holds a NUL character, which llama.cpp's {self.name!r} template cannot "
                                "carry")
        chat = (llama_cpp.llama_chat_message * len(messages))(*(
            llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages))
        n = llama_cpp.llama_chat_apply_template(self.name.encode(), chat, len(messages), True, None, 0)
        if n < 0:
            raise GGUFSpecError(f"llama.cpp's {self.name!r} chat template cannot render these messages")
        buf = ctypes.create_string_buffer(n + 1)
        llama_cpp.llama_chat_apply_template(self.name.encode(), chat, len(messages), True, buf, n + 1)
        text = buf.raw[:n].decode("utf-8", errors="replace")
        if len(text) > max_chars:
            raise ContextLengthError(f"the chat template rendered {len(text)} characters, more than the "
                                     f"{max_chars} that can fit the context")
        return text


Template = str | BuiltinTemplate  # a Jinja template's text (the GGUF's, or --chat-template's) or a built-in one


def template_override(value: str) -> Template:
    """--chat-template's value, as llama.cpp takes it: one of its built-in names, or a Jinja template's text (one
    with `{%` or `{{`, rendered like a GGUF's). GGUFSpecError listing the names for anything else."""
    if value in builtin_template_names():
        return BuiltinTemplate(value)
    if "{%" in value or "{{" in value:
        return value
    names = ", ".join(builtin_template_names())
    raise GGUFSpecError(f"{value!r} is not one of llama.cpp's built-in chat templates ({names}) nor a Jinja template")


def _spawn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ggufspec.template_sandbox"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


_spare: subprocess.Popen | None = None  # a renderer process started ahead, waiting for its template
_spare_lock = threading.Lock()


def prestart() -> None:
    """Start a renderer process now, for the first ChatRenderer to take: its start-up (~0.25 s, importing the
    formatter) then overlaps with loading the model."""
    global _spare
    with _spare_lock:
        if _spare is None or _spare.poll() is not None:
            _spare = _spawn()


def _take_spare() -> subprocess.Popen | None:
    global _spare
    with _spare_lock:
        proc, _spare = _spare, None
    return proc if proc is not None and proc.poll() is None else None


_renderers: OrderedDict[tuple[str, str, str], ChatRenderer] = OrderedDict()
_renderers_lock = threading.Lock()


def renderer(template: Template | None, bos_token: str = "", eos_token: str = "") -> ChatRenderer | BuiltinTemplate:
    """The renderer of `template` (one child process per Jinja template, BOS and EOS, kept for the process's life;
    a built-in template renders itself)."""
    if not template:
        raise GGUFSpecError("this model has no chat template (tokenizer.chat_template); pass a plain prompt without "
                            "--chat, or name one with --chat-template.")
    if isinstance(template, BuiltinTemplate):
        return template
    key = (template, bos_token, eos_token)
    with _renderers_lock:
        r = _renderers.get(key)
        if r is None:
            r = _renderers[key] = ChatRenderer(template, bos_token, eos_token)
            while len(_renderers) > MAX_RENDERERS:
                _renderers.popitem(last=False)[1].close()
        _renderers.move_to_end(key)
        return r


def render_chat(template: Template | None, messages: list[Message], bos_token: str = "", eos_token: str = "",
                max_chars: int = 1 << 30) -> str:
    """The prompt text for `messages`; raises GGUFSpecError when the model has no usable template."""
    return renderer(template, bos_token, eos_token).render(messages, max_chars)


def special_texts(vocab: Vocab) -> tuple[str, str]:
    """The BOS and EOS texts a template writes as `bos_token` / `eos_token` (empty when the model has none)."""
    bos = vocab.piece(vocab.bos, special=True).decode("utf-8", "replace") if vocab.bos >= 0 else ""
    eos = vocab.piece(vocab.eos, special=True).decode("utf-8", "replace") if vocab.eos >= 0 else ""
    return bos, eos


def chat_tokens(vocab: Vocab, template: Template | None, messages: list[Message], n_ctx: int | None = None,
                cancelled: Callable[[], bool] | None = None) -> list[int]:
    """Token ids of `messages` in the chat template, with the BOS the GGUF asks for exactly once (whether or not
    the template writes it). With `n_ctx`, a conversation that cannot leave room for one token in it raises
    ContextLengthError as early as that can be known: from the number of messages (every message costs at least
    one token) before rendering, from the rendered length before tokenizing, then exactly."""
    if n_ctx is not None and len(messages) >= n_ctx:
        raise ContextLengthError.prompt(len(messages), n_ctx, at_least=True)
    bos, eos = special_texts(vocab)
    bounded = n_ctx is not None and vocab.pieces_cover_text
    max_chars = (n_ctx - 1) * RENDER_CHARS_PER_TOKEN if bounded else 1 << 30
    text = renderer(template, bos, eos).render(messages, max_chars, cancelled)
    return vocab.encode(text, add_special=not (bos and text.startswith(bos)), n_ctx=n_ctx)
