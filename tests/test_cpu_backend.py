"""The CPU kernels ggufspec loads by default decode what llama.cpp's plain CPU path decodes, on any CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from conftest import CPU_BACKEND, open_decoder
from ggufspec import cpu_backend, kv_cache
from ggufspec.cli import main
from ggufspec.decoder import kv_label
from ggufspec.errors import GGUFSpecError

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea, there lived"
# Repacked Q4_0 kernels are other kernels than the plain ones, not the same sums reordered: on SmolLM2 Q4_0
# (AVX-512 Xeon) their batch logits differed from the plain path's by 0.032 of the logits' spread on average
# (max 1.8, 3 of 25 argmaxes flipped), with every row correlated at >= 0.997. Within one path a batch and
# single tokens agree bit for bit, which is what speculation relies on (test_equivalence).
MEAN_DIFF_OF_SPREAD = 0.1
MIN_ROW_CORRELATION = 0.99


def batch_logits(path: Path, **options) -> tuple[np.ndarray, dict[str, float]]:
    with open_decoder(path, n_ctx=256, **options) as d:
        tokens = d.vocab.tokenize(PROMPT, add_special=True, parse_special=True)
        assert len(tokens) >= 24
        return d.feed(tokens), d.weight_buffers


@pytest.mark.parametrize("model", ["smollm2_path", "smollm2_q4_0"])
def test_default_kernels_decode_a_batch_like_the_plain_cpu_path(model, request) -> None:
    """On an AMX Xeon this batch crashed the process before ggufspec turned AMX off (Q4_1 and Q4_0 went there)."""
    path = request.getfixturevalue(model)
    fast, buffers = batch_logits(path)
    plain, plain_buffers = batch_logits(path, repack=False)
    assert "AMX" not in buffers and "CPU_REPACK" not in plain_buffers, (buffers, plain_buffers)
    if "CPU_REPACK" not in buffers:  # nothing repacked (Q4_1 on x86): the very same kernels
        assert np.array_equal(fast, plain)
    else:
        assert np.abs(fast - plain).mean() < MEAN_DIFF_OF_SPREAD * plain.std()
        assert min(np.corrcoef(f, p)[0, 1] for f, p in zip(fast, plain)) > MIN_ROW_CORRELATION


def test_q4_0_weights_keep_their_repacked_layout(smollm2_q4_0) -> None:
    if "CPU_REPACK" not in CPU_BACKEND.offered:
        pytest.skip(f"this CPU's llama.cpp offers no repacked layouts ({CPU_BACKEND.offered})")
    _, buffers = batch_logits(smollm2_q4_0)
    assert buffers.get("CPU_REPACK", 0) > 50, buffers  # the 30 layers' matrices; the embeddings stay plain


def test_amx_is_turned_off_for_every_llama_cpp_user_in_the_process(smollm2_path) -> None:
    if "AMX" not in CPU_BACKEND.offered:
        pytest.skip("this CPU or llama.cpp build offers no AMX buffer type")
    assert "AMX" in CPU_BACKEND.dropped and "AMX" not in CPU_BACKEND.in_use
    # a fresh process: llama-cpp-python's own Llama, after ggufspec prepared the backend, decodes a batch
    code = (
        "import sys, llama_cpp\n"
        "from ggufspec import cpu_backend\n"
        "print(cpu_backend.prepare().in_use)\n"
        "llm = llama_cpp.Llama(sys.argv[1], n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False)\n"
        f"print(llm({PROMPT!r}, max_tokens=4, temperature=0)['choices'][0]['text'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(smollm2_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "AMX" not in r.stdout.splitlines()[0]


def test_doctor_reports_versions_kernels_and_where_weights_go(smollm2_q4_0) -> None:
    r = CliRunner().invoke(main, ["doctor", "-m", str(smollm2_q4_0), "-c", "512", "--no-repack"])
    assert r.exit_code == 0, r.output
    out = r.output
    assert f"llama-cpp-python {llama_cpp.__version__}" in out and "llama.cpp system info: CPU :" in out
    assert f"in use: {', '.join(CPU_BACKEND.in_use) or 'plain only'}" in out
    assert ("turned off: AMX" in out) == ("AMX" in CPU_BACKEND.dropped)
    assert f"KV cache: {kv_label('q8_0', kv_cache.default_v_type())}, 512 tokens" in out and "cost model cache:" in out
    weights = next(line for line in out.splitlines() if line.strip().startswith("weights:"))
    assert "CPU_REPACK" not in weights  # --no-repack reaches the load
    assert "Q4_0" in out


def test_doctor_without_a_model_and_with_a_bad_one(tmp_path) -> None:
    assert CliRunner().invoke(main, ["doctor"]).exit_code == 0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = CliRunner().invoke(main, ["doctor", "-m", str(bad)])
    assert r.exit_code == 2 and "error:" in r.output


def test_an_amx_build_that_cannot_be_made_safe_is_refused_with_the_rebuild(monkeypatch) -> None:
    """Where the CPU device's layouts cannot be reached (another llama.cpp build), an AMX build is refused before
    any model loads, naming the cause and the CMAKE_ARGS to rebuild with."""
    monkeypatch.setattr(cpu_backend, "extra_buffer_types", lambda: (None, None))
    monkeypatch.setattr(cpu_backend.llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX512 = 1 | AMX_INT8 = 1 |")
    with pytest.raises(GGUFSpecError, match="AMX.*CMAKE_ARGS=.*-DGGML_NATIVE=OFF"):
        cpu_backend.prepare.__wrapped__()
    monkeypatch.setattr(cpu_backend.llama_cpp, "llama_print_system_info", lambda: b"CPU : AVX2 = 1 |")
    assert cpu_backend.prepare.__wrapped__().offered == ()  # no AMX: nothing to refuse
