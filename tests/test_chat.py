"""`ggufspec chat` in a real pseudo-terminal (pexpect): turns, KV reuse, commands, colour, Ctrl-C, Ctrl-D."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pexpect
import pytest

from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.terminal_chat import DRAFT_COLOUR

STATS = re.compile(r"prompt (\d+) tok(?: \((\d+) cached\))? @")


def start(smollm2_path, *args: str, env: dict | None = None) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "ggufspec.cli", "chat", "-m", str(smollm2_path), "-c", "2048", *args],
                          env={**os.environ, **(env or {})}, encoding="utf-8", timeout=120, dimensions=(50, 200))
    child.expect(">>> ")
    return child


def ask(child: pexpect.spawn, line: str) -> str:
    """Send a line, return everything printed until the next prompt."""
    child.sendline(line)
    child.expect(">>> ")
    return child.before


def test_two_turns_stats_and_exit(smollm2_path) -> None:
    # vanilla drafts every step: `auto` (the default) rightly drafts nothing where its measured costs say a
    # draft cannot pay, as for this compute-bound 135M target on some CPUs here
    child = start(smollm2_path, "-d", str(smollm2_path), "--method", "vanilla", "-n", "24",
                  "--system", "Answer in one short sentence.")
    first = ask(child, "What is the capital of France?")
    assert "Paris" in first
    assert DRAFT_COLOUR in first  # a terminal: accepted draft tokens (the same model drafts) are coloured
    stats = ask(child, "/stats")
    m = STATS.search(stats)
    assert m and "tok/pass" in stats
    second = ask(child, "And what is the capital of Italy?")
    assert "Rome" in second
    turn2 = STATS.search(ask(child, "/stats"))
    # the whole first exchange came from the KV cache: only the new turn was prefilled
    assert turn2 and int(turn2.group(2) or 0) >= int(m.group(1))
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_answer_matches_generate_at_temperature_0(smollm2_path) -> None:
    child = start(smollm2_path, "-n", "20", "--no-color")
    answer = ask(child, "Name three colours.")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "\033[" not in answer
    with SpeculativeEngine.load(smollm2_path) as engine:
        ref = engine.generate([{"role": "user", "content": "Name three colours."}], GenerationSettings(max_tokens=20))
    assert ref.text.strip() and ref.text.strip().replace("\n", "\r\n") in answer


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(smollm2_path) -> None:
    child = start(smollm2_path, "-n", "2000", "--stats")
    child.sendline("Write a very long story about a dragon who learns to cook.")
    child.expect(r"cook\.\r\n")  # the terminal's echo of the line
    child.expect(r"\w+ \w+ \w+ \w+")  # the answer is streaming
    child.sendintr()
    child.expect(r"\(stopped\)")
    child.expect(">>> ")
    stats = STATS.search(child.before)
    assert stats, child.before
    after = ask(child, "/stats")
    assert "generated" in after
    # the chat still answers, and the interrupted turn is part of the conversation now
    child.sendline("What was the story about? One word.")
    child.expect(">>> ")
    assert STATS.search(child.before).group(2)  # reused the cache of the interrupted turn
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_no_color_env_and_unknown_commands(smollm2_path) -> None:
    child = start(smollm2_path, "-d", str(smollm2_path), "-n", "8", env={"NO_COLOR": "1"})
    answer = ask(child, "Hi!")
    assert "\033[" not in answer
    assert "unknown command /nope" in ask(child, "/nope")
    assert "conversation cleared" in ask(child, "/reset")
    child.sendeof()
    child.expect(pexpect.EOF)


def test_full_context_drops_the_oldest_turns(smollm2_path) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "ggufspec.cli", "chat", "-m", str(smollm2_path), "-c", "160", "-n", "40"],
                          encoding="utf-8", timeout=120)
    child.expect(">>> ")
    seen = ""
    for i in range(4):
        seen += ask(child, f"Tell me fact number {i} about the ocean.")
    assert "dropped the oldest" in seen
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_model_without_template_is_refused(tokenizer_fields, tiny_weights, tmp_path) -> None:
    from conftest import TINY
    from tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "plain.gguf", [f for f in tokenizer_fields if f.name != "tokenizer.chat_template"],
                           tiny_weights, TINY)
    child = pexpect.spawn(sys.executable, ["-m", "ggufspec.cli", "chat", "-m", str(path)], encoding="utf-8", timeout=60)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2 and "no chat template" in child.before


def test_banner_help_and_an_answer_cut_at_n(smollm2_path) -> None:
    child = pexpect.spawn(sys.executable, ["-m", "ggufspec.cli", "chat", "-m", str(smollm2_path), "-d", str(smollm2_path),
                                           "-c", "1024", "-n", "6"], encoding="utf-8", timeout=120, dimensions=(50, 200))
    child.expect(">>> ")
    banner = child.before
    assert (f"ggufspec chat: {smollm2_path.name} + {smollm2_path.name}, method auto" in banner
            and "Method(" not in banner), banner
    helped = ask(child, "/help")
    assert all(c in helped for c in ("/reset", "/stats", "/exit", "/help")) and "unknown command" not in helped
    assert "(cut at 6 tokens: -n/--max-tokens)" in ask(child, "Write a long poem about the sea.")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(smollm2_path) -> None:
    # piped input (a terminal's readline drops such bytes itself); by the locale, stdin decodes strictly or into
    # surrogates
    for lang in ("C.UTF-8", "C"):
        r = subprocess.run([sys.executable, "-m", "ggufspec.cli", "chat", "-m", str(smollm2_path), "-n", "4"],
                           input=b"caf\xe9\n/stats\nHi!\n/stats\n/exit\n", capture_output=True, timeout=120,
                           env={**os.environ, "LANG": lang, "LC_ALL": lang})
        err = r.stderr.decode()
        assert r.returncode == 0 and "Traceback" not in err, err
        assert "not UTF-8 text" in err and "(no answer yet)" in err  # refused, nothing answered
        assert STATS.search(err)  # the next line was answered
