"""The per-machine measurement caches (costs.json, kv_cache.json): where they live, what keys them to a machine,
and how a table is read and written.

A leaf: it imports from ggufspec only the leaves `errors` and `outputs` (the temp-file rule every writer shares), so
costs/ and kv_cache.py both build on it without importing each other.

Contract of a table: a JSON object from keys (which name the machine, see `machine`) to measurements. What it
holds never makes a run fail: a missing, unreadable or malformed file, or an entry its reader rejects, is a
re-measurement (announced on stderr when the file or entry is malformed); a write that fails is silent.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp

from .errors import GGUFSpecError
from .outputs import temp_output

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

COSTS_FILE = "costs.json"  # costs.cached_measure: batch and draft costs per model pair and settings
KV_CACHE_FILE = "kv_cache.json"  # kv_cache.choose: the V cache type paired with q8_0 K on CPU


def cache_dir() -> Path:
    """ggufspec's cache folder: $GGUFSPEC_CACHE, else $XDG_CACHE_HOME/ggufspec, else ~/.cache/ggufspec (as
    hub.ggufspec_cache; an empty variable counts as unset). Read from the environment at every call; no I/O."""
    if os.environ.get("GGUFSPEC_CACHE"):
        return Path(os.environ["GGUFSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggufspec"


def costs_path() -> Path:
    """The cost models' table (see costs.cached_measure)."""
    return cache_dir() / COSTS_FILE


def kv_cache_path() -> Path:
    """The V cache type choices' table (see kv_cache.choose)."""
    return cache_dir() / KV_CACHE_FILE


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
    """What makes a measurement this machine's: the CPU (name, family, model) and llama.cpp's build and features.

    Part of every cache key, so that a home folder shared by different machines (or a new llama.cpp build) does
    not reuse another one's measurements: batch costs differ widely between CPUs (docs/cpu-kernels.md)."""
    cpu = [platform.machine(), platform.processor()]
    fields = cpu_info()
    if fields:
        cpu += [fields.get(k, "") for k in ("model name", "cpu family", "model")]
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return " | ".join(cpu + [llama_cpp.__version__, system_info])


def json_type(value: object) -> str:
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
        return {}, f"expected a JSON object, found {json_type(table)}"
    return table, None


def write_table(path: Path, entries: dict, stale: Callable[[str], bool] | None = None) -> None:
    """Merge `entries` into the table at `path`, keeping what other processes wrote since this one read it, less the
    entries whose key `stale` says can never be read again (the table would otherwise grow with every model moved,
    deleted or downloaded anew).

    Under an exclusive lock on a sidecar `.lock` file the table is read again, updated and replaced in one step
    (a reader never sees half a file). A read-only or full cache folder only costs a re-measurement next time:
    failures are silent and leave no temporary file behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            table, _ = _load(path)  # a file that is not a table was reported when read, and is replaced
            if stale is not None:
                table = {key: value for key, value in table.items() if not stale(key)}
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
