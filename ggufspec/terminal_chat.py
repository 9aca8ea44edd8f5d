"""`ggufspec chat`: a multi-turn chat in the terminal over one engine, as llama-cli's conversation mode and mlx_lm.chat.

Every turn renders the whole conversation with the model's template; the engine reuses the KV cache of the common
prefix, so a turn prefills only its new tokens. A conversation that no longer fits loses its oldest turns.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

from .chat import Message
from .engine import GenerationResult, GenerationSettings, SpeculativeEngine
from .stats import Stats

COMMANDS = {"/help": "this list", "/reset": "forget the conversation", "/stats": "the last answer's stats line",
            "/exit": "quit (or Ctrl-D)"}
DRAFT_COLOUR, RESET = "\033[36m", "\033[0m"  # accepted draft tokens in cyan, as LM Studio highlights them


def use_colour(flag: bool | None, stream: TextIO) -> bool:
    """--color/--no-color when given; otherwise on for a terminal, off when NO_COLOR is set (no-color.org)."""
    if flag is not None:
        return flag
    return stream.isatty() and not os.environ.get("NO_COLOR")


@dataclass
class Conversation:
    """The messages of a chat: an optional system message, then alternating user and assistant turns."""

    system: str | None = None
    turns: list[Message] = field(default_factory=list)

    @property
    def messages(self) -> list[Message]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def fit(self, engine: SpeculativeEngine, room: int) -> tuple[list[int], int]:
        """The prompt's tokens once the oldest user/assistant pairs are dropped until it leaves `room` tokens in the
        context, and how many turns were dropped (the last user message always stays)."""
        dropped = 0
        tokens = engine.encode(self.messages)
        while len(self.turns) > 1 and len(tokens) + room > engine.n_ctx:
            del self.turns[:2]
            dropped += 2
            tokens = engine.encode(self.messages)
        return tokens, dropped


def run_chat(engine: SpeculativeEngine, settings: GenerationSettings, system: str | None, colour: bool,
             show_stats: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """Read lines from standard input until /exit or end of input; answer each with a streamed reply."""
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    conv = Conversation(system)
    last: GenerationResult | None = None
    room = min(settings.max_tokens, engine.n_ctx // 2)
    help_line = "  ".join(f"{c} {what}" for c, what in COMMANDS.items())
    print(f"{help_line}; Ctrl-C stops an answer.", file=err)
    if colour:
        print(f"{DRAFT_COLOUR}this colour{RESET}: draft tokens the target kept.", file=err)
    while True:
        try:
            line = input(">>> ")
            line.encode("utf-8")  # stdin's undecodable bytes come as surrogates, or as an error (by the locale)
        except EOFError:
            print(file=out)
            return
        except KeyboardInterrupt:  # as in a shell: drop the line, ask again
            print(file=out)
            continue
        except UnicodeError:
            print("(that line is not UTF-8 text: set the terminal to UTF-8 and type it again)", file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit", "/bye"):
                return
            if command in ("/help", "/?"):
                print(f"{help_line}; Ctrl-C stops an answer.", file=err)
            elif command == "/reset":
                conv.turns.clear()
                print("(conversation cleared)", file=err)
            elif command == "/stats":
                print(last.stats.line() if last else "(no answer yet)", file=err)
            else:
                print(f"unknown command {command}; {help_line}", file=err)
            continue
        conv.turns.append({"role": "user", "content": line})
        prompt, dropped = conv.fit(engine, room)
        if dropped:
            print(f"(context full: dropped the oldest {dropped} messages)", file=err)
        last = _answer(engine, prompt, settings, colour, out)
        conv.turns.append({"role": "assistant", "content": last.text})
        if last.stop_reason == "interrupted":
            print("(stopped)", file=err)
        elif last.stop_reason == "length":
            print("(context full)", file=err)
        elif last.stop_reason == "max_tokens":
            print(f"(cut at {settings.max_tokens} tokens: -n/--max-tokens)", file=err)
        if show_stats:
            print(last.stats.line(), file=err)


def _answer(engine: SpeculativeEngine, prompt: list[int], settings: GenerationSettings, colour: bool,
            out: TextIO) -> GenerationResult:
    """Stream one reply; Ctrl-C ends it early (the text so far is kept)."""
    before = engine.last_result
    try:
        for r in engine.stream(prompt, settings):
            if r.text:
                out.write(f"{DRAFT_COLOUR}{r.text}{RESET}" if colour and r.from_draft else r.text)
                out.flush()
    except KeyboardInterrupt:
        pass
    out.write("\n")
    out.flush()
    if engine.last_result is before:  # stopped before the first token (while measuring costs, say)
        return GenerationResult("", [], "interrupted", Stats())
    return engine.last_result
