"""What a target pass and a draft token cost on this machine: measured, cached per machine, corrected in use.

On CPUs the target's cost for a batch of n tokens is far from n times one token, and it depends
on the CPU as much as on the weight type (llama.cpp repacks Q4_0 and Q8_0 for small batches: a
4-token batch measured here at 1.6 decodes on one machine and 2.6 on an AVX2-only one), so the
best draft length is found by measuring, not assumed.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import llama_cpp

from .decoder import Decoder, LlamaCppDecoder
from .errors import GGUFSpecError
from .outputs import temp_output

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

# Costs are learned per context size: up to this many cached tokens, twice as many, four times... (past 256
# cached tokens llama.cpp's CPU flash attention decodes a batch with other kernels than one token: measured
# on the Xeon here, a 4-token batch cost 1.29 decodes after 32 tokens of context and 1.89 after 500)
CONTEXT_SIZE = 256
# Long batches measured for prompt lookup's long guesses (where the text copies its context): the draft
# lengths they hold are one less. At most llama.cpp's CPU micro-batch (decoder.CPU_UBATCH), so one pass.
LONG_BATCHES = (16, 32, 64)


@dataclass
class CostModel:
    """verify[n-1]: seconds for the target to decode n tokens with all logits; draft: one draft token;
    long_verify[i]: a batch of long_sizes[i] tokens (sizes past verify's; between them, interpolated)."""

    verify: list[float]
    draft: float
    long_sizes: list[int] = field(default_factory=list)
    long_verify: list[float] = field(default_factory=list)

    def copy(self) -> CostModel:
        """An independent copy, of the same class (a subclass may price or learn differently)."""
        return replace(self, verify=list(self.verify), long_sizes=list(self.long_sizes),
                       long_verify=list(self.long_verify))

    @property
    def k_long(self) -> tuple[int, ...]:
        """The long draft lengths whose batches were measured."""
        return tuple(n - 1 for n in self.long_sizes)

    def batch_seconds(self, n: int) -> float:
        """Seconds for a batch of n tokens: measured, interpolated between measured sizes, or scaled from the largest."""
        if n <= len(self.verify) or not self.long_sizes:
            return self.verify[min(n, len(self.verify)) - 1]
        sizes, secs = [len(self.verify), *self.long_sizes], [self.verify[-1], *self.long_verify]
        if n >= sizes[-1]:
            return secs[-1] * n / sizes[-1]
        i = bisect.bisect_left(sizes, n)
        return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])

    @staticmethod
    def expected_tokens(k: int, acceptance: float | Sequence[float]) -> float:
        """Tokens a step with k drafts commits; acceptance[i]: chance draft i is kept once judged
        (a single number: the same at every position; a short list: its last entry for the positions after it)."""
        if isinstance(acceptance, (int, float)):
            a = [acceptance] * k
        else:
            a = list(acceptance[:k]) + [acceptance[-1]] * (k - len(acceptance)) if acceptance else [0.0] * k
        tokens = kept = 1.0
        for x in a:  # plain Python: called several times a step, where numpy's call overhead would show
            kept *= x
            tokens += kept
        return tokens

    def step_seconds(self, k: int, free: bool = False) -> float:
        """Drafting k tokens (free: they cost nothing, as prompt lookup's) and verifying them."""
        return k * (0.0 if free else self.draft) + self.batch_seconds(k + 1)

    def expected_rate(self, k: int, acceptance: float | Sequence[float], free: bool = False) -> float:
        """Committed tokens per second with k drafts."""
        return self.expected_tokens(k, acceptance) / self.step_seconds(k, free)

    def best_k(self, acceptance: float | Sequence[float], k_max: int, k_min: int = 0, free: bool = False,
               longer: Sequence[int] = ()) -> int:
        """The draft length in k_min..k_max (or among `longer`) with the most expected tokens per second."""
        return max([*range(k_min, k_max + 1), *longer], key=lambda k: self.expected_rate(k, acceptance, free))

    def observe(self, n_verify: int, verify_s: float, draft_decodes: int, draft_s: float, weight: float = 0.2) -> None:
        """Move toward what one step really cost: the batch size seen at `weight`, the others at half of it
        (after a plain step: every size and the draft at `weight`), the draft at `weight` per decode.

        A model measured while the machine was busy (or cached from another load) corrects itself in use.
        Plain steps scale every cost alike: they slow down as the context grows (the draft's too), and
        taking that as batches or drafts getting relatively cheaper would switch drafting on where it
        does not pay.
        """
        if verify_s > 0 and n_verify > len(self.verify) and self.long_sizes:  # only the nearest long size learns
            i = min(range(len(self.long_sizes)), key=lambda i: abs(self.long_sizes[i] - n_verify))
            self.long_verify[i] *= (verify_s / self.batch_seconds(n_verify)) ** weight
        elif verify_s > 0:
            n = min(n_verify, len(self.verify)) - 1
            ratio = verify_s / self.verify[n]
            others = weight if n == 0 else weight / 2
            self.verify = [v * ratio ** (weight if i == n else others) for i, v in enumerate(self.verify)]
            if n == 0 and not draft_decodes:
                self.draft *= ratio ** weight
        if draft_decodes:
            self.draft += (1 - (1 - weight) ** draft_decodes) * (draft_s / draft_decodes - self.draft)


class ContextCosts:
    """A CostModel per context size (up to CONTEXT_SIZE cached tokens, up to twice that, ...), each
    learning from the steps taken at its size: a batch attends to the whole context, so what a long
    prompt teaches must not price a short one. A size first used starts from the next smaller one."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self._by_size: dict[int, CostModel] = {0: base}

    def at(self, n_ctx: int) -> CostModel:
        size = (max(n_ctx - 1, 0) // CONTEXT_SIZE).bit_length()
        if size not in self._by_size:
            smaller = self._by_size[max(s for s in self._by_size if s < size)]
            self._by_size[size] = smaller.copy()
        return self._by_size[size]


def measure(target: LlamaCppDecoder, draft: Decoder | None, k_max: int, repeats: int = 5,
            long_sizes: Sequence[int] = LONG_BATCHES, long_repeats: int = 2) -> tuple[CostModel, float]:
    """Time target batches of 1..k_max+1 tokens (and of `long_sizes` that fit) and one draft token after a
    short context; resets both.

    Rounds interleave all sizes, so a busy spell hits every one; each time is the fastest round's (long
    batches take part in the first `long_repeats` rounds: each costs as much as many short ones).
    Also returns the spread (slowest / fastest round, worst short size): large when the machine was busy.
    """
    ctx = list(range(100, 132))
    decoders = [target] + ([draft] if draft is not None else [])
    for d in decoders:
        d.sync(ctx)
        d.feed([7])  # warm-up
        d.rollback_to(len(ctx))
    room = min(target.n_ctx - len(ctx) - 1, target.options.micro_batch)  # one micro-batch, inside the context
    longs = [n for n in long_sizes if k_max + 1 < n <= room]
    sizes = [(target, n) for n in range(1, k_max + 2)] + ([(draft, 1)] if draft is not None else [])
    sizes += [(target, n) for n in longs]
    times: list[list[float]] = [[] for _ in sizes]
    for r in range(repeats):
        for i, ((d, n), out) in enumerate(zip(sizes, times)):
            if r >= long_repeats and i >= len(sizes) - len(longs):
                continue
            t0 = time.perf_counter()
            d.feed(list(range(200, 200 + n)))
            out.append(time.perf_counter() - t0)
            d.rollback_to(len(ctx))
    for d in decoders:
        d.rollback_to(0)
    best = [min(t) for t in times]
    short = len(sizes) - len(longs)
    spread = max(max(t) / min(t) for t in times[:short])
    model = CostModel(best[: k_max + 1], best[k_max + 1] if draft is not None else 0.0, longs, best[short:])
    return model, spread


MAX_SPREAD = 1.5  # a measurement noisier than this is used for this run but not cached


def costs_path() -> Path:
    return Path(os.environ.get("GGUFSPEC_CACHE", Path.home() / ".cache" / "ggufspec")) / "costs.json"


def cached_measure(target: LlamaCppDecoder, draft: LlamaCppDecoder | None, k_max: int) -> CostModel:
    """measure(), remembered per model files, thread settings, CPU and llama.cpp build in
    ~/.cache/ggufspec/costs.json (a home shared by different machines must not share their costs).

    A cached entry is used only when check_costs passes it: a bad one is reported on stderr, measured again and
    written over, so what the cache holds never makes a run fail."""
    path = costs_path()
    key = json.dumps([_identity(target), _identity(draft) if draft else None, k_max, LONG_BATCHES, machine()])
    entry = read_entry(path, key, lambda value: check_costs(value, k_max))
    if entry is not None:
        return CostModel(**entry)
    model, spread = measure(target, draft, k_max)
    if spread > MAX_SPREAD:
        return model
    write_table(path, {key: asdict(model)})
    return model


def check_costs(entry: object, k_max: int) -> str | None:
    """What is wrong with a cached CostModel (as asdict wrote it) for draft lengths up to k_max; None if nothing is.

    verify: k_max + 1 seconds; draft: seconds or 0 (no draft model); long_sizes: what measure() takes of
    LONG_BATCHES (the sizes past verify's, up to those that fit), with one long_verify time each (both may be
    missing). Seconds are finite floats above 0: prices divide by them and interpolate between the sizes."""
    if not isinstance(entry, dict):
        return f"expected an object, found {_json_type(entry)}"
    unknown = sorted(set(entry) - {"verify", "draft", "long_sizes", "long_verify"})
    if unknown:
        return f"unknown fields: {', '.join(unknown)}"
    verify, draft = entry.get("verify"), entry.get("draft")
    sizes, secs = entry.get("long_sizes", []), entry.get("long_verify", [])
    longs = [n for n in LONG_BATCHES if n > k_max + 1]
    if not (isinstance(verify, list) and len(verify) == k_max + 1 and all(map(_seconds, verify))):
        return f"verify: expected {k_max + 1} positive numbers"
    if not (type(draft) is float and math.isfinite(draft) and draft >= 0):
        return "draft: expected a number >= 0"
    if not (isinstance(sizes, list) and sizes == longs[:len(sizes)]):
        return f"long_sizes: expected the first sizes of {longs}"
    if not (isinstance(secs, list) and len(secs) == len(sizes) and all(map(_seconds, secs))):
        return f"long_verify: expected {len(sizes)} positive numbers, one per long size"
    return None


def _seconds(x: object) -> bool:
    """A time as measure() writes one: a float, finite (json reads NaN and Infinity too) and above 0."""
    return type(x) is float and math.isfinite(x) and x > 0


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for notices."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def notice(message: str) -> None:
    """One line on stderr about the cache (the run goes on)."""
    print(f"ggufspec: {message}", file=sys.stderr)


def read_entry(path: Path, key: str, check: Callable[[object], str | None]) -> Any:
    """The value at `key` in the table at `path`; None when it is missing or `check` (what is wrong with a value,
    or None) rejects it, which a notice on stderr then says: the caller measures again and writes over it."""
    table = read_table(path)
    if key not in table:
        return None
    why = check(table[key])
    if why is not None:
        notice(f"ignoring a bad entry in {path} ({why}); measuring again")
        return None
    return table[key]


def read_table(path: Path) -> dict:
    """A JSON table of measurements kept per machine and settings; empty when missing or unreadable, and when it is
    not a JSON object (said on stderr: the next measurement written replaces it)."""
    table, why = _load(path)
    if why is not None:
        notice(f"ignoring {path} ({why}); measuring again")
    return table


def _load(path: Path) -> tuple[dict, str | None]:
    """The table at `path` and, when its content is not a JSON object, why (the table is then empty)."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}, None  # missing or unreadable: a re-measurement, silently
    try:
        table = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; deep nesting exhausts the parser
        return {}, "not JSON"
    if not isinstance(table, dict):
        return {}, f"expected a JSON object, found {_json_type(table)}"
    return table, None


def write_table(path: Path, entries: dict) -> None:
    """Merge `entries` into the table at `path`, keeping what other processes wrote since this one read it.

    Under an exclusive lock on a sidecar `.lock` file the table is read again, updated and replaced in one step
    (a reader never sees half a file). A read-only or full cache folder only costs a re-measurement next time:
    failures are silent and leave no temporary file behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            table, _ = _load(path)  # a file that is not a table was reported when read, and is replaced
            table.update(entries)
            with temp_output(path) as tmp:  # replaced in one step; the temp file removed whatever fails
                tmp.write_text(json.dumps(table))
    except (OSError, GGUFSpecError):  # temp_output reports a failed write as a ConversionError
        pass


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on `path`'s sidecar `.lock` file (without fcntl, on Windows: no lock, and of two
    processes writing at once the last one's table wins)."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed, or when the process dies
        yield


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "cpu family", ...); empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}


@functools.cache
def machine() -> str:
    """What sets batch costs besides the model: the CPU (name, family, model) and llama.cpp's build and features.

    Three CPUs seen here priced a 4-token batch at 1.6, 2.3 and 2.6 single-token decodes."""
    cpu = [platform.machine(), platform.processor()]
    fields = cpu_info()
    if fields:
        cpu += [fields.get(k, "") for k in ("model name", "cpu family", "model")]
    return " | ".join(cpu + [llama_cpp.__version__, llama_cpp.llama_print_system_info().decode(errors="replace").strip()])


def _identity(d: LlamaCppDecoder) -> list[object]:
    st = d.path.stat()
    o = d.options
    return [str(d.path), st.st_size, int(st.st_mtime), o.n_threads, o.n_threads_batch, o.n_gpu_layers, o.flash_attn,
            d.kv_cache, sorted(d.weight_buffers)]  # where the weights went: repacked or not costs batches differently
