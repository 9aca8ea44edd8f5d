"""The default V cache type: measured on this machine on a one-layer model, remembered, read back."""

from __future__ import annotations

import json

import pytest

from ggufspec import kv_cache, memory
from ggufspec.errors import GGUFSpecError
from ggufspec.gguf_check import read_header


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """default_v_type() with an empty cache folder; the process's own choice (kept per cache file) is left alone."""
    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    path = kv_cache.cache_path()
    yield path
    kv_cache._chosen.pop(path, None)


def test_the_attention_model_times_both_v_types() -> None:
    times = kv_cache.measure(repeats=1)
    assert set(times) == set(kv_cache.V_TYPES) and all(0 < t < 1 for t in times.values())


def test_the_choice_is_measured_once_and_read_back(fresh_choice) -> None:
    choice = kv_cache.default_v_type()
    table = json.loads(fresh_choice.read_text())
    assert list(table.values()) == [choice]
    other = next(v for v in kv_cache.V_TYPES if v != choice)
    fresh_choice.write_text(json.dumps({key: other for key in table}))
    kv_cache._chosen.pop(fresh_choice)  # as a new process would
    assert kv_cache.default_v_type() == other, "a remembered choice is used, not measured again"


@pytest.mark.parametrize("q8_0,f16,choice", [(1.0, 0.95, "q8_0"), (1.0, 0.85, "f16"), (1.0, 1.2, "q8_0")])
def test_f16_v_must_be_clearly_faster_to_take_twice_the_v_memory(fresh_choice, monkeypatch, q8_0, f16, choice) -> None:
    monkeypatch.setattr(kv_cache, "measure", lambda: {"q8_0": q8_0, "f16": f16})
    assert kv_cache.default_v_type() == choice


def test_memory_counts_k_and_v_types_apart(smollm2_path) -> None:
    header = read_header(smollm2_path)
    q8, f16 = memory.kv_bytes_per_token(header, "q8_0"), memory.kv_bytes_per_token(header, "f16")
    assert q8 < memory.kv_bytes_per_token(header, "q8_0", "f16") == (q8 + f16) // 2 < f16


def test_a_probe_llama_cpp_cannot_run_keeps_q8_0_and_is_tried_again(fresh_choice, monkeypatch) -> None:
    def fail() -> dict[str, float]:
        raise GGUFSpecError("llama.cpp could not create a context")
    monkeypatch.setattr(kv_cache, "measure", fail)
    assert kv_cache.default_v_type() == "q8_0"
    assert not fresh_choice.exists()


@pytest.mark.parametrize("bad", [None, "f32", 8, ["f16"], {"v": "f16"}])
def test_a_bad_cached_choice_is_measured_again_and_written_over(fresh_choice, monkeypatch, capsys, bad) -> None:
    monkeypatch.setattr(kv_cache, "measure", lambda: {"q8_0": 1.0, "f16": 2.0})
    assert kv_cache.default_v_type() == "q8_0"
    [key] = json.loads(fresh_choice.read_text())
    fresh_choice.write_text(json.dumps({key: bad}))
    kv_cache._chosen.pop(fresh_choice)  # as a new process would
    monkeypatch.setattr(kv_cache, "measure", lambda: {"q8_0": 1.0, "f16": 0.5})
    capsys.readouterr()
    assert kv_cache.default_v_type() == "f16"
    assert capsys.readouterr().err == (f"ggufspec: ignoring a bad entry in {fresh_choice} "
                                       "(expected one of q8_0, f16); measuring again\n")
    assert json.loads(fresh_choice.read_text()) == {key: "f16"}


def test_a_choice_file_that_is_not_a_table_is_measured_again(fresh_choice, monkeypatch, capsys) -> None:
    fresh_choice.write_text("q8_0")
    monkeypatch.setattr(kv_cache, "measure", lambda: {"q8_0": 1.0, "f16": 0.5})
    assert kv_cache.default_v_type() == "f16"
    assert capsys.readouterr().err == f"ggufspec: ignoring {fresh_choice} (not JSON); measuring again\n"
    assert list(json.loads(fresh_choice.read_text()).values()) == ["f16"]
