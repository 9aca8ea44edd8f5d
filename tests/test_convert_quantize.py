"""Quantization through llama.cpp: outputs load and generate, Q8_0 stays close to F16, fallbacks are reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")

from gguf import GGUFReader  # noqa: E402

from convert_fixtures import train_bpe_tokenizer, write_tiny_model  # noqa: E402
from ggufspec.convert.hf import convert_hf  # noqa: E402
from ggufspec.convert.quantize import quantize  # noqa: E402
from ggufspec.errors import ConversionError, ModelFileError  # noqa: E402


def f16_model(folder: Path, hidden: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    n = train_bpe_tokenizer(folder, "smollm", 500)
    write_tiny_model(folder, "llama", n, hidden=hidden, ffn=2 * hidden, heads=4, kv_heads=2, layers=2)
    out = folder / "model-f16.gguf"
    convert_hf(folder, out, "f16")
    return out


def logits(path: Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False,
                          type_k=0, type_v=0)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def test_q8_0_close_to_f16_and_generates(tmp_path: Path) -> None:
    src = f16_model(tmp_path / "hf", hidden=256)
    out = tmp_path / "model-q8_0.gguf"
    rep = quantize(src, out, "q8_0", threads=2)
    assert rep.fallbacks == []
    assert rep.type_counts.get("Q8_0", 0) > 0 and set(rep.type_counts) <= {"Q8_0", "F32"}
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 500, 24)]
    ref, got = logits(src, toks), logits(out, toks)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"Q8_0 vs F16: max relative logit difference {err:.2e}, top-1 agreement "
          f"{np.mean(got.argmax(-1) == ref.argmax(-1)):.2f}")
    assert err < 2e-2
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    res = llm.create_completion("def add(a, b):", max_tokens=8, temperature=0.0)
    assert res["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k_m", "q6_k"])
def test_k_quants_fall_back_on_narrow_rows_and_say_so(tmp_path: Path, qtype: str) -> None:
    src = f16_model(tmp_path / "hf", hidden=64)
    out = tmp_path / f"model-{qtype}.gguf"
    rep = quantize(src, out, qtype, threads=2)
    if qtype == "q4_0":
        # 32-wide blocks fit 64-wide rows; only output.weight, which llama.cpp keeps at q6_K, falls back
        assert [f.split(":")[0] for f in rep.fallbacks] == ["output.weight"]
    else:
        assert rep.fallbacks and all("not a multiple of 256" in f for f in rep.fallbacks)
        assert any(f.startswith("blk.0.ffn_up.weight:") for f in rep.fallbacks)
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False)
    assert llm.create_completion("hello", max_tokens=4, temperature=0.0)["usage"]["completion_tokens"] >= 1


def test_output_and_embedding_type_overrides(tmp_path: Path) -> None:
    src = f16_model(tmp_path / "hf", hidden=64)
    out = tmp_path / "m.gguf"
    quantize(src, out, "q4_0", threads=2, output_type="f16", embedding_type="q8_0")
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["output.weight"] == "F16" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_0"


def test_bad_quantize_inputs(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFileError, match="bogus.gguf"):
        quantize(bogus, tmp_path / "out.gguf", "q8_0")
    with pytest.raises(ConversionError, match="unknown quantization type"):
        quantize(bogus, tmp_path / "out.gguf", "q7_z")
    with pytest.raises(ConversionError, match="does not exist"):
        quantize(f16_model(tmp_path / "hf", 64), tmp_path / "missing" / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists()
