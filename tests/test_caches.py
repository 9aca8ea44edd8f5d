"""The measurement caches (costs.json, kv_cache.json): where they live; what they hold is checked on read and a bad
entry or file is measured again with a notice; writers at once merge their entries; a failed write leaves no
temporary file; the module that keeps them (machine_cache) is a leaf."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import ggufspec.costs.cache as costs_module  # where cached_measure looks up measure() and machine()
from ggufspec import kv_cache, machine_cache
from ggufspec.costs import ENTRY_FIELDS, LONG_BATCHES, check_costs, measure, timing
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine

from conftest import open_decoder

K_MAX = 2
MEASURING = "ggufspec: measuring this machine's batch costs for auto: "  # the notice of a first measurement


# --- where they live ------------------------------------------------------------------------------

def test_the_cache_folder_honours_ggufspec_cache_then_xdg_cache_home_then_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GGUFSPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert machine_cache.cache_dir() == tmp_path / "home" / ".cache" / "ggufspec"  # where earlier releases wrote
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: unset
    assert machine_cache.cache_dir() == tmp_path / "home" / ".cache" / "ggufspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert (costs_module.costs_path(), kv_cache.cache_path()) == (tmp_path / "xdg" / "ggufspec" / "costs.json",
                                                                 tmp_path / "xdg" / "ggufspec" / "kv_cache.json")
    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path / "own"))
    assert (costs_module.costs_path(), kv_cache.cache_path()) == (tmp_path / "own" / "costs.json",
                                                                 tmp_path / "own" / "kv_cache.json")


def _package_imports(module: str) -> set[str]:
    """The ggufspec modules `module` imports, at any depth of its source (inside functions too); a package's, from
    any of its modules (its own modules left out)."""
    path = Path(machine_cache.__file__).parent / module
    files, top = (sorted(path.glob("*.py")), 2) if path.is_dir() else ([path.with_suffix(".py")], 1)
    found = set()
    for source in (f.read_text() for f in files):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == top:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ggufspec."):
                found.add(node.module.split(".")[1])
    return found


def test_the_cache_modules_import_in_one_direction() -> None:
    """decoder -> kv_cache -> machine_cache and costs -> machine_cache, never back (not even inside a function)."""
    assert _package_imports("machine_cache") <= {"errors", "outputs"}
    assert _package_imports("outputs") <= {"errors"}
    assert "decoder" not in _package_imports("kv_cache") and "costs" not in _package_imports("kv_cache")
    assert "costs" not in _package_imports("decoder")
    assert "kv_cache" not in _package_imports("costs")


@pytest.fixture
def measured(tmp_path, monkeypatch) -> list[int]:
    """costs.json in tmp_path; the k_max of every measurement cached_measure takes (real ones, each reported quiet so
    that it is cached however busy this machine is)."""
    calls: list[int] = []

    def quiet(target, draft, k_max, long_sizes=LONG_BATCHES, mtp=None):
        calls.append(k_max)
        return measure(target, draft, k_max, long_sizes=long_sizes, mtp=mtp)[0], 1.0

    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_module, "measure", quiet)
    return calls


@pytest.fixture(scope="module")
def decoders(tiny_target, tiny_draft):
    with open_decoder(tiny_target) as t, open_decoder(tiny_draft) as d:
        yield t, d


def cached_models(path: Path) -> dict[str, dict]:
    """The cost models in the cache at `path`, by key: each entry without ENTRY_FIELDS (how and when measured)."""
    return {key: {k: v for k, v in entry.items() if k not in ENTRY_FIELDS}
            for key, entry in json.loads(path.read_text()).items()}


def nan(good: dict) -> dict:
    """A good entry with NaN for its first time (json writes and reads NaN)."""
    return {**good, "verify": [float("nan"), *good["verify"][1:]]}


# what a costs.json entry may hold instead of a cost model, and the reason the notice gives
BAD_ENTRIES: dict[str, tuple[Callable[[dict], object], str]] = {
    "null": (lambda good: None, "expected an object, found null"),
    "empty object": (lambda good: {}, "verify: expected 3 positive numbers"),
    "no verify times": (lambda good: {**good, "verify": []}, "verify: expected 3 positive numbers"),
    "a string": (lambda good: "fast", "expected an object, found a string"),
    "verify as strings": (lambda good: {**good, "verify": ["0.1"] * 3}, "verify: expected 3 positive numbers"),
    "zeros": (lambda good: {**good, "verify": [0.0] * 3, "draft": 0.0}, "verify: expected 3 positive numbers"),
    "NaN": (nan, "verify: expected 3 positive numbers"),
    "one time short": (lambda good: {**good, "verify": good["verify"][:2]}, "verify: expected 3 positive numbers"),
    "negative draft": (lambda good: {**good, "draft": -1.0}, "draft: expected a number >= 0"),
    "infinite draft": (lambda good: {**good, "draft": float("inf")}, "draft: expected a number >= 0"),
    "no draft": (lambda good: {"verify": good["verify"]}, "draft: expected a number >= 0"),
    "unknown field": (lambda good: {**good, "faster": True}, "unknown fields: faster"),
    "long sizes unsorted": (lambda good: {**good, "long_sizes": [32, 16], "long_verify": [0.2, 0.1]},
                            "long_sizes: expected the first sizes of [16, 32, 64]"),
    "long times missing": (lambda good: {**good, "long_verify": good["long_verify"][:-1]},
                           "long_verify: expected 3 positive numbers, one per long size"),
}


@pytest.mark.parametrize("name", BAD_ENTRIES)
def test_a_bad_cost_entry_is_measured_again_and_written_over(decoders, measured, capsys, name) -> None:
    bad, why = BAD_ENTRIES[name]
    path = costs_module.costs_path()
    costs_module.cached_measure(*decoders, K_MAX)
    [(key, good)] = json.loads(path.read_text()).items()
    assert good["long_sizes"] == [16, 32, 64], "the tiny target's context holds every long batch"
    path.write_text(json.dumps({key: bad(good)}))
    capsys.readouterr()

    again = costs_module.cached_measure(*decoders, K_MAX)
    assert len(measured) == 2 and len(again.verify) == K_MAX + 1  # measured anew
    ignored, measuring = capsys.readouterr().err.splitlines()
    assert ignored == f"ggufspec: ignoring a bad entry in {path} ({why}); measuring again"
    assert measuring.startswith(MEASURING)
    assert cached_models(path) == {key: asdict(again)}  # written over
    assert costs_module.cached_measure(*decoders, K_MAX) == again and len(measured) == 2  # and read back
    assert capsys.readouterr().err == ""


def test_entries_of_models_gone_or_changed_are_dropped_at_the_next_write(decoders, measured, tmp_path) -> None:
    path = costs_module.costs_path()
    costs_module.cached_measure(*decoders, K_MAX)
    [(key, good)] = json.loads(path.read_text()).items()
    target, *rest = json.loads(key)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    gone = json.dumps([[str(tmp_path / "gone.gguf"), *target[1:]], *rest])  # deleted or moved
    changed = json.dumps([[str(other), other.stat().st_size + 1, *target[2:]], *rest])  # downloaded again
    same = json.dumps([[str(other), other.stat().st_size, int(other.stat().st_mtime), *target[3:]], *rest])
    path.write_text(json.dumps({key: good, gone: good, changed: good, same: good, "a key of another shape": good}))

    costs_module.cached_measure(decoders[0], None, 1)  # a new entry: the table is written
    kept = json.loads(path.read_text())
    assert gone not in kept and changed not in kept
    assert {key, same, "a key of another shape"} < set(kept) and len(kept) == 4


def test_a_cached_entry_holds_no_pool_s_batches(decoders, measured) -> None:
    """A pool times its slots' batches (the target's and the draft model's) at each load: an entry holding them is
    refused and measured again."""
    plain = costs_module.cached_measure(*decoders, K_MAX)
    assert plain.draft_sizes == [] and plain.slots == 0 and check_costs(asdict(plain), K_MAX) is None
    for pool in ({"draft_sizes": [4], "draft_batches": [0.01]}, {"slots": 4, "slot_verify": [0.1]},
                 {"shapes": {"(2, 1)": 0.1}}):
        assert check_costs({**asdict(plain), **pool}, K_MAX) == (
            "a pool's batches (draft_sizes, draft_batches, slots, slot_verify, shapes, mtp_sizes, mtp_batches): "
            "expected none")


def test_a_measured_entry_passes_the_check(decoders, measured) -> None:
    for k_max in (1, 3):
        costs_module.cached_measure(decoders[0], None, k_max)
    entries = json.loads(costs_module.costs_path().read_text()).values()
    assert [check_costs(e, len(e["verify"]) - 1) for e in entries] == [None, None]


NOT_TABLES = [(b"{", "not JSON"), (b"", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[" * 100_000, "not JSON"),
              (b"[1, 2]", "expected a JSON object, found an array"), (b"null", "expected a JSON object, found null")]


@pytest.mark.parametrize("content,why", NOT_TABLES, ids=["truncated", "empty", "binary", "deep", "array", "null"])
def test_a_cost_file_that_is_not_a_table_is_measured_again(decoders, measured, capsys, content, why) -> None:
    path = costs_module.costs_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    model = costs_module.cached_measure(*decoders, K_MAX)
    ignored, measuring = capsys.readouterr().err.splitlines()
    assert ignored == f"ggufspec: ignoring {path} ({why}); measuring again" and measuring.startswith(MEASURING)
    assert list(cached_models(path).values()) == [asdict(model)]


def test_a_run_with_bad_cache_files_goes_on_and_says_so(tiny_target, tiny_draft, tmp_path) -> None:
    """The CLI end to end: `generate -d` measures costs (and the V cache type) afresh instead of failing."""
    (tmp_path / "costs.json").write_text('{"truncated": ')
    (tmp_path / "kv_cache.json").write_text('"f16"')
    env = dict(os.environ, GGUFSPEC_CACHE=str(tmp_path))
    args = ["generate", "-m", str(tiny_target), "-d", str(tiny_draft), "Hello", "-n", "4", "-c", "256", "--json"]
    r = subprocess.run([sys.executable, "-m", "ggufspec.cli", *args], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"ggufspec: ignoring {tmp_path / 'costs.json'} (not JSON); measuring again" in r.stderr
    assert f"ggufspec: ignoring {tmp_path / 'kv_cache.json'} (expected a JSON object, found a string)" in r.stderr
    assert json.loads(r.stdout)["tokens"]
    assert list(json.loads((tmp_path / "kv_cache.json").read_text()).values())[0] in ("q8_0", "f16")


# --- a busy machine ------------------------------------------------------------------------------

class BusyClock:
    """measure()'s timer on a busy machine, simulated (no test can make this machine busy on demand): every third
    batch it times takes half a second longer, so each measurement's spread is far over MAX_SPREAD."""

    def __init__(self) -> None:
        self.calls, self.lost = 0, 0.0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 6 == 0:  # measure() reads the timer twice a batch: the end of every third batch
            self.lost += 0.5
        return time.perf_counter() + self.lost


@pytest.fixture
def busy(tmp_path, monkeypatch) -> list[float]:
    """costs.json in tmp_path, measure()'s timer busy (BusyClock); the spread of every real measurement taken."""
    spreads: list[float] = []

    def counted(target, draft, k_max, long_sizes=LONG_BATCHES, mtp=None):
        model, spread = measure(target, draft, k_max, long_sizes=long_sizes, mtp=mtp)
        spreads.append(spread)
        return model, spread

    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(timing, "measure_clock", BusyClock())
    monkeypatch.setattr(costs_module, "measure", counted)
    return spreads


def run_auto(target: Path, draft: Path) -> None:
    """A run of `auto` on the pair, as generate makes one: it measures the costs or reads them from the cache."""
    with SpeculativeEngine.load(target, draft, DecoderOptions(n_ctx=256)) as engine:
        engine.generate("Hello", GenerationSettings(max_tokens=2, method="auto", draft_max=K_MAX))


def test_a_noisy_measurement_is_cached_marked_noisy_and_the_next_run_uses_it(tiny_target, tiny_draft, busy,
                                                                              capsys) -> None:
    """On a busy machine the first run takes the best of a few tries, says what it measures, and caches the result
    marked noisy; the next run uses it without measuring, and doctor says it is noisy and when it was measured."""
    run_auto(tiny_target, tiny_draft)
    err = capsys.readouterr().err.splitlines()
    path = costs_module.costs_path()
    assert len(busy) == costs_module.MEASURE_TRIES and min(busy) > costs_module.MAX_SPREAD  # every try was noisy
    assert [line for line in err if line.startswith(MEASURING)] == [
        f"{MEASURING}the target's batches of 1 to {K_MAX + 1} tokens and longer ones, and a draft token, 5 rounds "
        f"each (once for these models and settings: cached in {path})"]
    assert any(line.startswith("ggufspec: this machine was busy while measuring") for line in err), err
    table = json.loads(path.read_text())
    [entry] = table.values()
    assert entry["spread"] == min(busy) and costs_module.entry_noisy(entry)
    assert abs(entry["measured"] - time.time()) < 600  # measured now (the bound only allows for the run's length)

    run_auto(tiny_target, tiny_draft)
    assert len(busy) == costs_module.MEASURE_TRIES, "the second run measured again"
    assert capsys.readouterr().err == ""
    assert json.loads(path.read_text()) == table  # used as it is
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["measured"]))
    assert costs_module.cache_report(path)[:2] == [
        f"cost model cache: {path} (1 measured setups, 1 of them noisy)",
        f"  noisy: tiny-target.gguf + tiny-draft.gguf, draft lengths up to {K_MAX}: spread {entry['spread']:.2f} "
        f"(over {costs_module.MAX_SPREAD}), measured {when}; in use as it is, measured again at a run from "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(entry['measured'] + costs_module.NOISY_RETRY_AFTER))}"]


def test_a_noisy_entry_is_refined_by_one_try_once_it_is_old(decoders, busy, monkeypatch, capsys) -> None:
    """Past NOISY_RETRY_AFTER (simulated: the entry's time moved back), the next use measures once more and keeps
    each batch's fastest time; a quiet try clears the mark."""
    noisy = costs_module.cached_measure(*decoders, K_MAX)
    path = costs_module.costs_path()
    [(key, entry)] = json.loads(path.read_text()).items()
    assert costs_module.cached_measure(*decoders, K_MAX) == noisy and len(busy) == costs_module.MEASURE_TRIES
    entry["measured"] -= int(costs_module.NOISY_RETRY_AFTER) + 1
    path.write_text(json.dumps({key: entry}))
    capsys.readouterr()
    # a quiet try that finds the first batch size faster and the others slower than the noisy entry says
    tried = replace(noisy, verify=[noisy.verify[0] / 2, *(v * 2 for v in noisy.verify[1:])], draft=noisy.draft * 2)
    monkeypatch.setattr(costs_module, "measure", lambda target, draft, k_max, long_sizes=LONG_BATCHES, mtp=None: (tried, 1.0))

    refined = costs_module.cached_measure(*decoders, K_MAX)
    assert capsys.readouterr().err.startswith("ggufspec: measuring the batch costs for auto again: the cached ones (")
    [again] = json.loads(path.read_text()).values()
    assert again["spread"] == 1.0 and not costs_module.entry_noisy(again) and again["measured"] > entry["measured"]
    assert asdict(costs_module.cached_model(again)) == asdict(refined)
    assert refined.verify == [tried.verify[0], *noisy.verify[1:]] and refined.draft == noisy.draft  # the fastest
    assert costs_module.cached_measure(*decoders, K_MAX) == refined and capsys.readouterr().err == ""


def test_a_corrupt_entry_is_replaced_even_by_a_noisy_measurement(decoders, busy, monkeypatch, capsys) -> None:
    """The corrupt entry's notice is said once: the noisy measurement that follows replaces it."""
    path = costs_module.costs_path()
    with monkeypatch.context() as quiet:  # an entry to corrupt, measured on a quiet machine
        quiet.setattr(costs_module, "measure", lambda *args, **kwargs: (measure(*args, **kwargs)[0], 1.0))
        costs_module.cached_measure(*decoders, K_MAX)
    [key] = json.loads(path.read_text())
    path.write_text(json.dumps({key: {"verify": "fast"}}))
    capsys.readouterr()

    model = costs_module.cached_measure(*decoders, K_MAX)
    assert f"ggufspec: ignoring a bad entry in {path} (verify: expected 3 positive numbers); measuring again" in (
        capsys.readouterr().err)
    [entry] = json.loads(path.read_text()).values()
    assert check_costs(entry, K_MAX) is None and costs_module.entry_noisy(entry)
    assert costs_module.cached_measure(*decoders, K_MAX) == model and capsys.readouterr().err == ""


# --- writers at once --------------------------------------------------------------------------

def test_two_measurements_at_once_keep_both_entries(tiny_target, tmp_path, monkeypatch) -> None:
    """Both threads read the (empty) table before either writes: each write must merge, not replace."""
    both_measured = threading.Barrier(2)

    def measure_then_wait(target, draft, k_max, long_sizes=LONG_BATCHES, mtp=None):
        model = measure(target, draft, k_max, long_sizes=long_sizes, mtp=mtp)[0]
        both_measured.wait(timeout=300)
        return model, 1.0

    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_module, "measure", measure_then_wait)
    models, errors = {}, []

    def run(k_max: int) -> None:
        try:
            with open_decoder(tiny_target) as t:
                models[k_max] = costs_module.cached_measure(t, None, k_max)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)
            both_measured.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    table = cached_models(costs_module.costs_path())
    assert sorted(json.loads(key)[2] for key in table) == [1, 2]
    assert sorted(table.values(), key=lambda e: len(e["verify"])) == [asdict(models[1]), asdict(models[2])]


WRITER = """
import sys
from pathlib import Path
from ggufspec.machine_cache import write_table
path, name, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()  # the go, once every writer is ready
for i in range(n):
    write_table(path, {f"{name}{i}": i})
"""


def test_processes_writing_at_once_lose_no_entry(tmp_path) -> None:
    path, n = tmp_path / "costs.json", 100
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    try:
        assert [w.stdout.readline() for w in writers] == ["ready\n"] * 2
        for w in writers:
            w.stdin.write("go\n")
            w.stdin.flush()
        assert [w.wait(timeout=300) for w in writers] == [0, 0]
    finally:
        for w in writers:
            w.kill()
            w.communicate()
    assert json.loads(path.read_text()) == {f"{name}{i}": i for name in ("a", "b") for i in range(n)}


# --- failed writes ----------------------------------------------------------------------------

def test_a_failed_replace_leaves_no_temporary_file(tmp_path) -> None:
    path = tmp_path / "costs.json"
    path.mkdir()  # os.replace cannot put a file there
    machine_cache.write_table(path, {"key": [1.0]})  # silently: only a re-measurement next time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json", "costs.json.lock"]


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from ggufspec.machine_cache import write_table
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # as a disk that fills up mid-write
write_table(Path(sys.argv[1]), {"new": "x" * 10_000})
"""


def test_a_write_cut_short_leaves_no_temporary_file_and_the_old_table(tmp_path) -> None:
    pytest.importorskip("resource")
    path = tmp_path / "costs.json"
    path.write_text('{"old": 1}')
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == ""
    assert path.read_text() == '{"old": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json", "costs.json.lock"]
