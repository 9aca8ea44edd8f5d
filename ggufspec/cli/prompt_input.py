"""The one prompt of `ggufspec generate`: from PROMPT, -p or -f (`-`: standard input), with -e's escapes processed
as llama.cpp processes them, checked to be UTF-8 text."""

from __future__ import annotations

import sys
from typing import BinaryIO, Mapping

import click

from ..errors import GGUFSpecError


# -e/--escape: llama.cpp's string_process_escapes (common/common.cpp). A backslash before one of these gives its byte;
# before x and two hex digits, the byte they spell; before anything else (and at the end) it stays, as does that.
ESCAPES: Mapping[int, int] = {ord(k): ord(v) for k, v in (("n", "\n"), ("r", "\r"), ("t", "\t"), ("'", "'"),
                                                            ('"', '"'), ("\\", "\\"))}
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(data: bytes) -> bytes:
    """`data` with its escapes processed as llama.cpp's -e does (ESCAPES); bytes in, bytes out, since \\xNN may
    spell part of a UTF-8 character."""
    out, i = bytearray(), 0
    while i < len(data):
        c, nxt = data[i], data[i + 1] if i + 1 < len(data) else None
        if c != ord("\\") or nxt is None:
            out.append(c)
            i += 1
        elif nxt in ESCAPES:
            out.append(ESCAPES[nxt])
            i += 2
        elif nxt == ord("x") and len(data) > i + 3 and {data[i + 2], data[i + 3]} <= HEX_DIGITS:
            out.append(int(data[i + 2:i + 4], 16))
            i += 4
        else:
            out += data[i:i + 2]
            i += 2
    return bytes(out)


def escaped(text: str, where: str) -> str:
    """`text` with its escapes processed; a usage error when they spell bytes that are not UTF-8."""
    data = process_escapes(text.encode("utf-8", "surrogateescape"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{where}: with -e its escapes give byte 0x{data[e.start]:02x} at offset {e.start}, "
                               "which is not UTF-8 text.") from None


def prompt_text(argument: str | None, option: str | None, file: BinaryIO | None, escape: bool = False) -> str:
    """The one prompt given as PROMPT, -p or -f (`-` as PROMPT or FILE: standard input), its escapes processed with
    `escape` (-e), checked to be UTF-8 text (Python hands undecodable bytes of argv and stdin on as surrogates, which
    fail later, far from the input)."""
    given = [x for x in (argument, option, file) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give the prompt once: as PROMPT, -p TEXT or -f FILE." if given else
                               "no prompt: give it as PROMPT, -p TEXT or -f FILE (`-` reads standard input).")
    if argument == "-":
        data, where = sys.stdin.buffer.read(), "standard input"
    elif file is not None:
        data, where = file.read(), "standard input" if file.name in ("<stdin>", "-") else file.name
    else:
        text = argument if argument is not None else option
        data, where = text.encode("utf-8", "surrogateescape"), "the prompt"
    if escape:
        data, where = process_escapes(data), f"{where} (its escapes processed)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFSpecError(f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                            f"(convert it first, e.g. iconv -f LATIN1 -t UTF-8)") from None
    if not text.strip():
        raise click.UsageError("the prompt is empty.")
    return text
