"""The default V cache type: chosen at load time (DecoderOptions.resolved), measured on this machine on a one-layer
model, remembered, read back; reading the options does no I/O."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from ggufspec import decoder as decoder_module
from ggufspec import kv_cache, machine_cache, memory
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder, default_threads
from ggufspec.errors import GGUFSpecError
from ggufspec.gguf_check import read_header


def choose() -> str:
    """The V type a load on CPU with the default cache gets."""
    return DecoderOptions().resolved().cache_type_v


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """An empty cache folder ($XDG_CACHE_HOME/ggufspec); the process's own choice (kept per cache file) for the usual
    folder is left alone. Yields the choices' file."""
    monkeypatch.delenv("GGUFSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = kv_cache.cache_path()
    assert path == tmp_path / "ggufspec" / "kv_cache.json"
    yield path
    kv_cache.forget_choice()


def test_the_measured_choice_is_written_read_back_and_used_by_the_decoder(fresh_choice, monkeypatch,
                                                                          smollm2_path) -> None:
    measured: list[dict[str, float]] = []
    real_measure = kv_cache.measure

    def once(open_probe):
        measured.append(real_measure(open_probe, repeats=1))
        return measured[-1]

    monkeypatch.setattr(kv_cache, "measure", once)
    with pytest.raises(LookupError):
        kv_cache.default_v_type()  # nothing chosen for this folder yet
    options = DecoderOptions(n_ctx=256).resolved()
    [times] = measured
    assert set(times) == set(kv_cache.V_TYPES) and all(t > 0 for t in times.values())
    choice = "f16" if times["f16"] < kv_cache.F16_WINS * times["q8_0"] else "q8_0"
    assert options.cpu_v_type == options.cache_type_v == kv_cache.default_v_type() == choice
    assert (options.kv_type_v, options.needs_v_choice) == (None, False)  # what the user asked for stays apart
    key = kv_cache.choice_key(default_threads())
    assert json.loads(key)[:2] == [machine_cache.machine(), default_threads()]
    assert json.loads(fresh_choice.read_text()) == {key: choice}

    other = next(v for v in kv_cache.V_TYPES if v != choice)
    fresh_choice.write_text(json.dumps({key: other}))
    kv_cache.forget_choice()  # as a new process would
    with LlamaCppDecoder(smollm2_path, DecoderOptions(n_ctx=256)) as d:
        assert len(measured) == 1, "a remembered choice is used, not measured again"
        assert (d.kv_type, d.kv_type_v) == ("q8_0", other) and d.options.cpu_v_type == other
    with LlamaCppDecoder(smollm2_path, DecoderOptions(n_ctx=256)) as d:
        assert d.kv_type_v == other  # one process keeps its choice


def test_reading_the_options_does_no_io(fresh_choice, tmp_path, monkeypatch) -> None:
    def no_io(*args):
        raise AssertionError("a property chose the V cache type")

    monkeypatch.setattr(kv_cache, "choose", no_io)
    monkeypatch.setattr(kv_cache, "measure", no_io)
    options = DecoderOptions()
    assert options.needs_v_choice and options.cache_type == "q8_0"
    with pytest.raises(ValueError, match=r"DecoderOptions\.resolved\(\)"):
        options.cache_type_v  # noqa: B018 - a guess would size the memory check wrong
    assert replace(options, cpu_v_type="f16").cache_type_v == "f16"
    assert DecoderOptions(kv_type_v="q8_0").cache_type_v == "q8_0"
    assert DecoderOptions(kv_type="f16").cache_type_v == "f16"
    assert DecoderOptions(flash_attn=False).cache_type_v == "f16"
    explicit = DecoderOptions(kv_type="f16")
    assert explicit.resolved() is explicit  # nothing to choose: no I/O either
    monkeypatch.setattr(decoder_module, "gpu_offload", lambda: True)
    on_gpu = DecoderOptions(n_gpu_layers=-1)
    assert (on_gpu.cache_type_v, on_gpu.resolved()) == ("f16", on_gpu)
    assert list(tmp_path.iterdir()) == [], "the cache folder ($XDG_CACHE_HOME) stays empty"
    with pytest.raises(ValueError, match="cpu_v_type must be one of q8_0, f16"):
        DecoderOptions(cpu_v_type="q4_0")


@pytest.mark.parametrize("q8_0,f16,choice", [(1.0, 0.95, "q8_0"), (1.0, 0.85, "f16"), (1.0, 1.2, "q8_0")])
def test_f16_v_must_be_clearly_faster_to_take_twice_the_v_memory(fresh_choice, monkeypatch, q8_0, f16, choice) -> None:
    monkeypatch.setattr(kv_cache, "measure", lambda open_probe: {"q8_0": q8_0, "f16": f16})
    assert choose() == choice


def test_memory_counts_k_and_v_types_apart(smollm2_path) -> None:
    header = read_header(smollm2_path)
    q8, f16 = memory.kv_bytes_per_token(header, "q8_0"), memory.kv_bytes_per_token(header, "f16")
    assert q8 < memory.kv_bytes_per_token(header, "q8_0", "f16") == (q8 + f16) // 2 < f16


def test_a_probe_llama_cpp_cannot_run_keeps_q8_0_and_is_tried_again(fresh_choice, monkeypatch) -> None:
    def fail(open_probe) -> dict[str, float]:
        raise GGUFSpecError("llama.cpp could not create a context")
    monkeypatch.setattr(kv_cache, "measure", fail)
    assert choose() == "q8_0"
    assert not fresh_choice.exists()


@pytest.mark.parametrize("bad", [None, "f32", 8, ["f16"], {"v": "f16"}])
def test_a_bad_cached_choice_is_measured_again_and_written_over(fresh_choice, monkeypatch, capsys, bad) -> None:
    monkeypatch.setattr(kv_cache, "measure", lambda open_probe: {"q8_0": 1.0, "f16": 2.0})
    assert choose() == "q8_0"
    [key] = json.loads(fresh_choice.read_text())
    fresh_choice.write_text(json.dumps({key: bad}))
    kv_cache.forget_choice()  # as a new process would
    monkeypatch.setattr(kv_cache, "measure", lambda open_probe: {"q8_0": 1.0, "f16": 0.5})
    capsys.readouterr()
    assert choose() == "f16"
    assert capsys.readouterr().err == (f"ggufspec: ignoring a bad entry in {fresh_choice} "
                                       "(expected one of q8_0, f16); measuring again\n")
    assert json.loads(fresh_choice.read_text()) == {key: "f16"}


def test_a_choice_file_that_is_not_a_table_is_measured_again(fresh_choice, monkeypatch, capsys) -> None:
    fresh_choice.parent.mkdir(parents=True)
    fresh_choice.write_text("q8_0")
    monkeypatch.setattr(kv_cache, "measure", lambda open_probe: {"q8_0": 1.0, "f16": 0.5})
    assert choose() == "f16"
    assert capsys.readouterr().err == f"ggufspec: ignoring {fresh_choice} (not JSON); measuring again\n"
    assert list(json.loads(fresh_choice.read_text()).values()) == ["f16"]


@pytest.mark.parametrize("first", ["ggufspec.costs", "ggufspec.kv_cache", "ggufspec.machine_cache", "ggufspec.decoder"])
def test_each_module_imports_first_in_a_fresh_interpreter(first) -> None:
    code = f"import {first}, ggufspec.costs, ggufspec.decoder, ggufspec.kv_cache, ggufspec.machine_cache"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
