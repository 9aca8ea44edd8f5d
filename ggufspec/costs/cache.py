"""The per-machine cache of measured cost models (costs.json): cached_measure(), the checks an entry passes before
use (check_costs), and `ggufspec doctor`'s report on it (cache_report)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from ..decoder import Decoder, LlamaCppDecoder
# the cache files and the machine key: machine_cache, shared with kv_cache (costs_path stays importable from here)
from ..machine_cache import costs_path, machine, notice, read_entry, write_table
from ..machine_cache import json_type as _json_type
from ..waiting import waiting
from .table import CostModel
from .timing import LONG_BATCHES, measure


# A measurement noisier than this (its slowest round over its fastest, worst short size) was taken on a busy
# machine: it is still cached, marked noisy (its `spread`), and refined by the next tries (NOISY_RETRY_AFTER).
# docs/methods.md#measured-constants: MAX_SPREAD
MAX_SPREAD = 1.5
# Measurements a first use takes at most while they stay noisy, each batch's fastest time kept: a busy machine would
# otherwise never cache a quiet one, and measure again before the first token of every run
MEASURE_TRIES = 3
# Seconds after which a noisy entry is measured again (one try, at its next use): a busy spell ends, and each try
# can only make its times faster, closer to what the batches cost
NOISY_RETRY_AFTER = 3600.0
# What a cached entry holds besides the CostModel's fields: the spread of its measurement and when (Unix seconds)
ENTRY_FIELDS = ("spread", "measured")


def cached_measure(target: LlamaCppDecoder, draft: LlamaCppDecoder | None, k_max: int,
                   long_sizes: Sequence[int] = LONG_BATCHES, mtp: Decoder | None = None) -> CostModel:
    """measure(), remembered per model files, thread settings, CPU and llama.cpp build (machine_cache.machine: a
    home shared by different machines must not share their costs) in machine_cache.costs_path().

    A first use says on stderr what it measures, and takes up to MEASURE_TRIES measurements while they are noisy
    (each batch's fastest time kept); the result is cached even if noisy, marked so (entry_noisy), and a noisy
    entry is used as it is until NOISY_RETRY_AFTER seconds have passed, then refined by one more try at its next
    use. A cached entry is used only when check_costs passes it: a bad one is reported on stderr, measured again
    and written over, so what the cache holds never makes a run fail. `mtp`: the target's MTP head, timed too."""
    if target.options.remote or (draft is not None and draft.options.remote):
        # a network's costs: not this machine's
        notice(f"measuring the target's batch costs through the network for auto: {_what(k_max, draft, mtp)} (at each "
               "load: links change)")
        return _tries(target, draft, k_max, long_sizes, 1, mtp=mtp)[0]
    path = costs_path()
    key = [_identity(target), _identity(draft) if draft else None, k_max, list(long_sizes), machine()]
    key += ["mtp"] if mtp is not None else []  # (entries without the head keep their keys)
    entry = read_entry(path, json.dumps(key), lambda value: check_costs(value, k_max, long_sizes))
    if entry is not None and not _retry_due(entry):
        return cached_model(entry)
    if entry is None:
        notice(f"measuring this machine's batch costs for auto: {_what(k_max, draft, mtp)} (once for these models and "
               f"settings: cached in {path})")
        model, spread = _tries(target, draft, k_max, long_sizes, MEASURE_TRIES, mtp=mtp)
    else:
        notice(f"measuring the batch costs for auto again: the cached ones ({_when(entry['measured'])}) were taken "
               f"on a busy machine (spread {entry['spread']:.2f}); one try, each batch's fastest time kept")
        model, spread = _tries(target, draft, k_max, long_sizes, 1, (cached_model(entry), entry["spread"]), mtp)
    if spread > MAX_SPREAD:
        notice(f"this machine was busy while measuring (spread {spread:.2f}, over {MAX_SPREAD}): its fastest times "
               f"are used and cached, marked noisy, and measured again at a run {NOISY_RETRY_AFTER / 60:.0f} "
               "minutes or more from now")
    write_table(path, {json.dumps(key): {**asdict(model), "spread": spread, "measured": round(time.time())}}, _gone)
    return model


def _what(k_max: int, draft: Decoder | None, mtp: Decoder | None = None) -> str:
    """What measure() times, for the notices: why the wait."""
    parts = [f"the target's batches of 1 to {k_max + 1} tokens and longer ones",
             *(x for x, d in (("a draft token", draft), ("the MTP head's steps", mtp)) if d is not None)]
    listed = ", ".join(parts[:-1]) + ", and " + parts[-1] if len(parts) > 1 else parts[0]
    return f"{listed}, 5 rounds each"


def _tries(target: LlamaCppDecoder, draft: Decoder | None, k_max: int, long_sizes: Sequence[int], tries: int,
           best: tuple[CostModel, float] | None = None, mtp: Decoder | None = None) -> tuple[CostModel, float]:
    """Up to `tries` measurements, until one is quiet (spread at most MAX_SPREAD), starting from `best` (an
    earlier model and its spread); each batch's fastest time over them all, and the smallest spread. A spinner
    shows on a terminal while they run (waiting)."""
    with waiting("measuring batch costs for auto") as wait:
        for i in range(tries):
            if tries > 1:
                wait.label = f"measuring batch costs for auto, try {i + 1} of at most {tries}"
            model, spread = measure(target, draft, k_max, long_sizes=long_sizes, mtp=mtp)
            best = (model, spread) if best is None else (fastest(best[0], model), min(best[1], spread))
            if spread <= MAX_SPREAD:
                break
    assert best is not None  # tries >= 1
    return best


def fastest(a: CostModel, b: CostModel) -> CostModel:
    """Each time of two measurements of the same batches, the faster one: a busy machine only adds time, so the
    fastest of several noisy measurements is the closest to what each batch costs."""
    pick = lambda xs, ys: [min(x, y) for x, y in zip(xs, ys)]  # noqa: E731
    return replace(a.copy(), verify=pick(a.verify, b.verify), draft=min(a.draft, b.draft),
                   long_verify=pick(a.long_verify, b.long_verify), hold=min(a.hold, b.hold),
                   draft_hold=min(a.draft_hold, b.draft_hold), mtp=min(a.mtp, b.mtp),
                   mtp_catch_up=min(a.mtp_catch_up, b.mtp_catch_up))


def cached_model(entry: dict) -> CostModel:
    """The CostModel of a cache entry that check_costs passed (without ENTRY_FIELDS)."""
    return CostModel(**{k: v for k, v in entry.items() if k not in ENTRY_FIELDS})


def entry_noisy(entry: object) -> bool:
    """Whether a cache entry was measured on a busy machine (with a valid spread and time over MAX_SPREAD; entries
    written before spreads were kept: no)."""
    return isinstance(entry, dict) and _check_measurement(entry) is None and entry.get("spread", 1.0) > MAX_SPREAD


def _retry_due(entry: dict) -> bool:
    """A noisy entry whose NOISY_RETRY_AFTER has passed: its next use measures once more."""
    return entry_noisy(entry) and time.time() - entry.get("measured", 0) >= NOISY_RETRY_AFTER


def _when(unix: float) -> str:
    """A measurement's local time, for notices and doctor."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix))


def cache_report(path: Path) -> list[str]:
    """`ggufspec doctor`'s lines on the cost cache at `path`: what it holds, then one line per noisy entry (its
    models, draft lengths, spread, when it was measured and when it is measured again)."""
    try:
        table = json.loads(path.read_bytes())
    except OSError:
        return [f"cost model cache: {path} (not written yet: auto measures at its first run)"]
    except (ValueError, RecursionError):
        table = None
    if not isinstance(table, dict):
        return [f"cost model cache: {path} (not a JSON table: measured again and replaced at auto's next run)"]
    noisy = [(key, e) for key, e in table.items() if entry_noisy(e)]
    lines = [f"cost model cache: {path} ({len(table)} measured setups, {len(noisy)} of them noisy)"]
    for key, e in noisy:
        retry = e["measured"] + NOISY_RETRY_AFTER
        lines.append(f"  noisy: {_setup(key)}: spread {e['spread']:.2f} (over {MAX_SPREAD}), measured "
                     f"{_when(e['measured'])}; in use as it is, measured again at a run from {_when(retry)}")
    return lines


def _setup(key: str) -> str:
    """A cache key's models and draft lengths, for doctor (a key that is not one of ours: as it is)."""
    try:
        target, draft, k_max = json.loads(key)[:3]
        models = " + ".join(Path(m[0]).name for m in (target, draft) if m)
        return f"{models}, draft lengths up to {k_max}"
    except (ValueError, TypeError, IndexError, KeyError):
        return key


def check_costs(entry: object, k_max: int, long_sizes: Sequence[int] = LONG_BATCHES) -> str | None:
    """What is wrong with a cached CostModel (as asdict wrote it) for draft lengths up to k_max; None if nothing is.

    verify: k_max + 1 seconds; draft: seconds or 0 (no draft model); long_sizes: what measure() takes of
    `long_sizes` (the sizes past verify's, up to those that fit), with one long_verify time each (both may be
    missing); no pool's batches (draft_sizes, slots, shapes: a pool measures or learns them at each load).
    Seconds are finite floats above 0: prices divide by them and interpolate between the sizes. `spread` (a float
    >= 1) and `measured` (whole Unix seconds) come together, or not at all in entries written before them."""
    if not isinstance(entry, dict):
        return f"expected an object, found {_json_type(entry)}"
    unknown = sorted(set(entry) - {"verify", "draft", "long_sizes", "long_verify", "draft_sizes", "draft_batches",
                                   "slots", "slot_verify", "shapes", "hold", "snapshots", "draft_hold",
                                   "mtp", "mtp_catch_up", "mtp_sizes", "mtp_batches", *ENTRY_FIELDS})
    if unknown:
        return f"unknown fields: {', '.join(unknown)}"
    why = _check_measurement(entry)
    if why is not None:
        return why
    verify, draft = entry.get("verify"), entry.get("draft")
    sizes, secs = entry.get("long_sizes", []), entry.get("long_verify", [])
    longs = [n for n in long_sizes if n > k_max + 1]
    if not (isinstance(verify, list) and len(verify) == k_max + 1 and all(map(_seconds, verify))):
        return f"verify: expected {k_max + 1} positive numbers"
    if not (type(draft) is float and math.isfinite(draft) and draft >= 0):
        return "draft: expected a number >= 0"
    for name in ("hold", "draft_hold", "mtp", "mtp_catch_up"):
        value = entry.get(name, 0.0)
        if not (type(value) is float and math.isfinite(value) and value >= 0):
            return f"{name}: expected a number >= 0"
    if not (type(entry.get("snapshots", 0)) is int and entry.get("snapshots", 0) >= 0):
        return "snapshots: expected a whole number >= 0"
    if not (isinstance(sizes, list) and sizes == longs[:len(sizes)]):
        return f"long_sizes: expected the first sizes of {longs}"
    if not (isinstance(secs, list) and len(secs) == len(sizes) and all(map(_seconds, secs))):
        return f"long_verify: expected {len(sizes)} positive numbers, one per long size"
    if entry.get("slots", 0) != 0 or entry.get("shapes", {}) != {} or any(
            entry.get(name, []) != [] for name in ("draft_sizes", "draft_batches", "slot_verify", "mtp_sizes",
                                                    "mtp_batches")):
        return "a pool's batches (draft_sizes, draft_batches, slots, slot_verify, shapes, mtp_sizes, mtp_batches): " \
               "expected none"
    return None


def _check_measurement(entry: dict) -> str | None:
    """What is wrong with an entry's ENTRY_FIELDS (both, or neither as before they were kept); None if nothing."""
    spread, measured = entry.get("spread"), entry.get("measured")
    if spread is None and measured is None:
        return None
    if not (type(spread) is float and math.isfinite(spread) and spread >= 1):
        return "spread: expected a number >= 1, with `measured`"
    if not (type(measured) is int and measured >= 0):
        return "measured: expected a time in seconds, with `spread`"
    return None


def _seconds(x: object) -> bool:
    """A time as measure() writes one: a float, finite (json reads NaN and Infinity too) and above 0."""
    return type(x) is float and math.isfinite(x) and x > 0


def _gone(key: str) -> bool:
    """Whether the entry at `key` can never be read again: a model file it names is gone, or is another file now (its
    size or time differs from the key's). A key of another shape is kept (a file off a drive that is not mounted now
    counts as gone: measured again when it is back)."""
    try:
        files = [m[:3] for m in json.loads(key)[:2] if m is not None]
        paths = [Path(f[0]) for f in files]
    except (ValueError, TypeError, IndexError, KeyError):
        return False
    try:
        return any(_file(p) != f for p, f in zip(paths, files))
    except OSError:
        return True


def _file(path: Path) -> list[object]:
    """The part of a cost entry's key that names a model file: its path, size and modification time (seconds)."""
    st = path.stat()
    return [str(path), st.st_size, int(st.st_mtime)]


def _identity(d: LlamaCppDecoder) -> list[object]:
    o = d.options
    return [*_file(d.path), o.n_threads, o.n_threads_batch, o.n_gpu_layers, o.flash_attn,
            d.kv_cache, sorted(d.weight_buffers),  # where the weights went: repacked or not costs batches differently
            *([d.n_rs_seq] if getattr(d, "n_rs_seq", 0) else [])]  # snapshots: written by every batch
