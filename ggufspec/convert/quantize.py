"""GGUF -> quantized GGUF through llama.cpp's own quantizer, reporting tensors that fell back to another type."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from gguf import GGMLQuantizationType, LlamaFileType

from ggufspec import llama_log
from ggufspec.outputs import (
    ENDING_SIGNALS, check_output_path, exit_code, output_problem, refuse_overwriting_inputs, remove_quietly,
    takes_default_action, temp_output, write_error,
)
from ggufspec.errors import ConversionError
from ggufspec.gguf_check import read_header

# --type name -> llama_ftype value, from gguf-py's copy of llama.h's enum llama_ftype
FTYPES: dict[str, int] = {
    ft.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower(): int(ft)
    for ft in LlamaFileType
    if ft.name.startswith(("MOSTLY_", "ALL_")) and not ft.name.endswith("_MOE")
}
# i-quants below 4 bits are unusable without an importance matrix, which this command does not take
_NEEDS_IMATRIX = {"iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "q2_k_s"}

_PROGRESS = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
# llama.cpp's fallback warning, in the current wording and in the older two-line one
_FALLBACK = re.compile(
    r"(?P<name>\S+)\s+- ncols\s+(?P<cols>\d+) not divisible by (?P<block>\d+) \(required for type\s+(?P<want>\w+)\)"
    r" -> falling back to\s+(?P<got>\w+)"
)
_FALLBACK_OLD = re.compile(
    r"tensor cols (?P<cols>\d+) x \d+ are not divisible by (?P<block>\d+), required for (?P<want>\w+)"
    r"\s*-\s*using fallback quantization (?P<got>\w+)"
)
# llama.cpp's refusal of an already quantized input without allow_requantize
_REQUANTIZE = re.compile(r"requantizing from type (?P<type>\S+) is disabled")


@dataclass(frozen=True)
class Fallback:
    """One tensor llama.cpp stored as `got` instead of `want`: its rows of `cols` values do not split into blocks
    of `block`."""

    name: str
    cols: int
    block: int
    want: str
    got: str

    def __str__(self) -> str:
        return (f"{self.name}: row length {self.cols} is not a multiple of {self.block} (needed by {self.want}), "
                f"stored as {self.got}")


def _values(xs: list[int]) -> str:
    return "/".join(str(x) for x in sorted(set(xs)))


def fallback_summary(fallbacks: list[Fallback]) -> str:
    """All fallbacks in one line, e.g. "180 tensors fell back to another type (166 q4_K -> q5_0, 14 q6_K -> q8_0):
    their row length (576) is not a multiple of the block size (256)"; "" for none."""
    if not fallbacks:
        return ""
    pairs = Counter((f.want, f.got) for f in fallbacks)
    n = len(fallbacks)
    detail = ", ".join(f"{k} {want} -> {got}" for (want, got), k in pairs.most_common())
    return (f"{n} tensor{'s' if n > 1 else ''} fell back to another type ({detail}): "
            f"{'their' if n > 1 else 'its'} row length ({_values([f.cols for f in fallbacks])}) is not a multiple "
            f"of the block size ({_values([f.block for f in fallbacks])})")


@dataclass
class QuantizeReport:
    """Result of one quantization: sizes, time, storage-type counts and the fallbacks with their reason."""

    out: Path
    in_bytes: int
    out_bytes: int
    seconds: float
    type_counts: dict[str, int]
    fallen_back: list[Fallback]

    @property
    def fallbacks(self) -> list[str]:
        """One line per tensor that fell back to another type: name, row length, block, wanted and stored type."""
        return [str(f) for f in self.fallen_back]

    @property
    def fallback_summary(self) -> str:
        """The fallbacks in one line ("" for none)."""
        return fallback_summary(self.fallen_back)

    @property
    def type_summary(self) -> str:
        return ", ".join(f"{t} x{n}" for t, n in sorted(self.type_counts.items(), key=lambda kv: -kv[1]))


def tensor_type(name: str) -> int:
    """ggml type id for a --output-type / --embedding-type name such as q8_0 or f16."""
    try:
        return int(GGMLQuantizationType[name.upper()])
    except KeyError:
        raise ValueError(f"unknown tensor type {name!r} (e.g. f32, f16, bf16, q8_0, q6_k, q4_k, q4_0)") from None


class _LogCapture:
    """Collects llama.cpp log text during a call and follows per-tensor progress lines."""

    def __init__(self, progress: Callable[[int, int], None] | None):
        self.text: list[str] = []
        self.progress = progress
        self.current = ""
        self.fallbacks: list[Fallback] = []
        self._pending = ""
        self._lock = threading.Lock()

    def _feed(self, s: str) -> None:
        with self._lock:
            self._pending += s
            while "\n" in self._pending:
                line, self._pending = self._pending.split("\n", 1)
                self._line(line)

    def _line(self, line: str) -> None:
        self.text.append(line)
        m = _PROGRESS.search(line)
        if m:
            self.current = m[3]
            if self.progress:
                self.progress(int(m[1]), int(m[2]))
        f = _FALLBACK.search(line)
        name = f["name"] if f else self.current
        if f is None and "fallback" in line:
            f = _FALLBACK_OLD.search(" ".join(self.text[-2:]))
        if f:
            self.fallbacks.append(Fallback(name, int(f["cols"]), int(f["block"]), f["want"], f["got"]))

    def __enter__(self) -> "_LogCapture":
        self._capture = llama_log.capture(self._feed)
        self._capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._capture.__exit__(*exc)
        if self._pending:
            self._line(self._pending)
            self._pending = ""


@contextmanager
def _signals_end_process(tmp: Path) -> Iterator[None]:
    """While llama_model_quantize runs, Ctrl-C, SIGTERM and SIGHUP delete `tmp` and end the process at once: exit
    130 with "interrupted" for Ctrl-C, 128 + the signal with "terminated" for the others (143 for SIGTERM).

    The C call cannot be cancelled, and Python runs signal handlers only inside llama.cpp's log callback, where
    ctypes prints and drops the exception (the quantizer went on and the command exited 0), or after the call
    returns, minutes later for a big model. Only on the main thread, and only for signals whose handler is the
    default one (Python's for SIGINT; SIG_DFL or `temp_output`'s for the others, see `takes_default_action`);
    the previous handlers come back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = [s for s in ENDING_SIGNALS if takes_default_action(s)]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        ours.append(signal.SIGINT)

    def stop(signum: int, frame: object) -> None:
        remove_quietly(tmp)  # llama.cpp may still hold it open: the data goes with the process
        try:
            sys.stderr.write("\ninterrupted\n" if signum == signal.SIGINT else "\nterminated\n")
            sys.stderr.flush()
        finally:
            os._exit(130 if signum == signal.SIGINT else exit_code(signum))

    previous = {s: signal.getsignal(s) for s in ours}
    for s in ours:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _failure(inp: Path, out: Path, tmp: Path, qtype: str, log: _LogCapture, rc: int) -> ConversionError:
    """The error for llama_model_quantize returning `rc` != 0: an already quantized input (llama.cpp's own words,
    "requantizing from type q4_1 is disabled", name neither the cause nor the option that overrides it); about the
    output folder when it cannot take the file; else about the input, with llama.cpp's last error line.

    llama.cpp reports a failed write only as "basic_ios::clear", with no reason and no hint that the output, not
    the input, is at fault: `output_problem` asks the folder.
    """
    requant = next((m for m in map(_REQUANTIZE.search, log.text) if m), None)
    if requant is not None:
        return ConversionError(
            f"{inp} is already quantized ({requant['type']}): quantizing it again to {qtype} loses more quality "
            f"than quantizing its f16/bf16/f32 original would. Pass --allow-requantize to do it anyway "
            f"(as llama-quantize --allow-requantize), or quantize the original"
        )
    problem = output_problem(tmp)
    if problem is not None:
        return write_error(out, problem)
    detail = next((ln for ln in reversed(log.text) if "error" in ln.lower() or "failed" in ln.lower()), "")
    return ConversionError(f"{inp}: llama.cpp could not quantize to {qtype} ({detail.strip() or f'code {rc}'})")


def quantize(
    inp: Path,
    out: Path,
    qtype: str,
    threads: int = 0,
    output_type: str | None = None,
    embedding_type: str | None = None,
    allow_requantize: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Quantize GGUF `inp` to `out` as `qtype` (a llama.cpp ftype name); atomic: temp file, then rename.

    An input whose weights are already quantized is refused (a ConversionError naming its type and
    --allow-requantize) unless `allow_requantize`.

    `out` must not be `inp` or a link to it, and its folder must take a file; an unwritable or full output folder
    is reported as such (`write_error`), not as a fault of the input. llama.cpp's quantizer cannot be cancelled:
    Ctrl-C, SIGTERM or SIGHUP during it (on the main thread, with the default handlers) deletes the temp file and
    ends the process (exit 130, or 128 + the signal).
    """
    import llama_cpp

    inp, out = Path(inp), Path(out)
    name = qtype.lower()
    if name not in FTYPES:
        raise ConversionError(f"unknown quantization type {qtype!r}; choose one of {', '.join(FTYPES)}")
    if name in _NEEDS_IMATRIX:
        raise ConversionError(f"{qtype} needs an importance matrix, which `ggufspec quantize` does not take; use llama-quantize")
    read_header(inp)
    check_output_path(out)
    refuse_overwriting_inputs(out, [inp])

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads if threads > 0 else (os.cpu_count() or 1)
    params.ftype = FTYPES[name]
    params.allow_requantize = allow_requantize
    if output_type:
        params.output_tensor_type = tensor_type(output_type)
    if embedding_type:
        params.token_embedding_type = tensor_type(embedding_type)

    start = time.perf_counter()
    with temp_output(out) as tmp:  # creates the temp file: an unwritable folder fails here, before llama.cpp
        with _LogCapture(progress) as log, _signals_end_process(tmp):
            rc = llama_cpp.llama_model_quantize(str(inp).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise _failure(inp, out, tmp, qtype, log, rc)
    seconds = time.perf_counter() - start
    counts = Counter(GGMLQuantizationType(t.type).name for t in read_header(out).tensors)
    return QuantizeReport(out, inp.stat().st_size, out.stat().st_size, seconds, dict(counts), log.fallbacks)
