"""HF -> GGUF: llama.cpp's logits on our GGUF equal a numpy forward pass of the source checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("tokenizers")

from gguf import GGUFReader, TokenType  # noqa: E402

from convert_fixtures import (  # noqa: E402
    CHAT_TEMPLATE, train_bpe_tokenizer, train_spm_tokenizer, write_tiny_model,
)
import reference  # noqa: E402
from ggufspec.convert import hf  # noqa: E402
from ggufspec.convert.hf import convert_hf  # noqa: E402

REL_TOL = 1e-4  # max |llama.cpp - reference| / max |reference| over all positions and vocab entries

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

CASES = {
    "llama-tied-smollm-bpe": dict(arch="llama", tok="smollm", tied=True),
    "llama3-rope-scaling-sharded-bf16": dict(arch="llama", tok="llama3", rope_scaling=LLAMA3_SCALING, shards=3,
                                             dtype="BF16"),
    "mistral-sentencepiece-mqa": dict(arch="mistral", tok="spm", kv_heads=1),
    "qwen2-qkv-bias": dict(arch="qwen2", tok="qwen2"),
    "qwen3-qk-norm-head-dim": dict(arch="qwen3", tok="qwen2", head_dim=32, tied=True),
}


def make_checkpoint(folder: Path, arch: str, tok: str, **model_kw) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    if tok == "spm":
        pytest.importorskip("sentencepiece")
        n_vocab = train_spm_tokenizer(folder, 500)
    else:
        n_vocab = train_bpe_tokenizer(folder, tok, 500)
    return write_tiny_model(folder, arch, n_vocab, **model_kw)


def llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    # f32 KV cache: the default f16 cache alone would cost ~1e-3 relative error
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, n_threads_batch=1,
                          verbose=False, type_k=0, type_v=0)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def tokens_for(cfg: dict, n: int = 24, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, cfg["vocab_size"], n)]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_reference(tmp_path: Path, case: str) -> None:
    kw = dict(CASES[case])
    cfg = make_checkpoint(tmp_path / "hf", **kw)
    out = tmp_path / "model.gguf"
    rep = convert_hf(tmp_path / "hf", out, "f32")
    assert rep.fallbacks == []
    toks = tokens_for(cfg)
    err = rel_err(llama_logits(out, toks), reference.forward(tmp_path / "hf", toks))
    assert err < REL_TOL, f"{case}: relative logit error {err:.2e}"


def test_test_is_sensitive_to_qk_layout_and_rope_scaling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the tolerance test against passing vacuously: a wrong Q/K layout or ignored rope scaling is caught."""
    cfg = make_checkpoint(tmp_path / "hf", "llama", "smollm", rope_scaling=LLAMA3_SCALING)
    toks = tokens_for(cfg)
    ref = reference.forward(tmp_path / "hf", toks)
    unscaled = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    assert rel_err(reference.forward(tmp_path / "hf", toks, config=unscaled), ref) > 1e-2

    monkeypatch.setitem(hf.ARCHITECTURES, "LlamaForCausalLM", (hf.MODEL_ARCH.LLAMA, False))
    convert_hf(tmp_path / "hf", tmp_path / "unpermuted.gguf", "f32")
    assert rel_err(llama_logits(tmp_path / "unpermuted.gguf", toks), ref) > 1e-2


@pytest.mark.parametrize("outtype,tol", [("f16", 5e-3), ("bf16", 3e-2), ("q8_0", 3e-2)])
def test_lower_precision_outputs_stay_close(tmp_path: Path, outtype: str, tol: float) -> None:
    cfg = make_checkpoint(tmp_path / "hf", "qwen2", "qwen2", hidden=64, ffn=80)
    out = tmp_path / f"model-{outtype}.gguf"
    rep = convert_hf(tmp_path / "hf", out, outtype)
    toks = tokens_for(cfg)
    err = rel_err(llama_logits(out, toks), reference.forward(tmp_path / "hf", toks))
    print(f"{outtype}: relative logit error {err:.2e}")
    assert err < tol
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    # q8_0 blocks are 32 wide: the 80-wide rows of ffn_down fall back to f16 and are reported
    if outtype == "q8_0":
        assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
        assert any("blk.0.ffn_down.weight" in f for f in rep.fallbacks)
    else:
        assert types["blk.0.ffn_down.weight"] == outtype.upper()


def test_tokenizer_metadata(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", "smollm")
    out = tmp_path / "m.gguf"
    convert_hf(tmp_path / "hf", out, "f16")
    r = GGUFReader(out)

    def field(key: str):
        return r.fields[key].contents()

    assert field("tokenizer.ggml.model") == "gpt2"
    assert field("tokenizer.ggml.pre") == "smollm"
    tokens = field("tokenizer.ggml.tokens")
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert field("tokenizer.ggml.token_type")[:4] == [TokenType.CONTROL] * 3 + [TokenType.NORMAL]
    assert field("tokenizer.ggml.bos_token_id") == 1 and field("tokenizer.ggml.eos_token_id") == 2
    assert field("tokenizer.ggml.add_bos_token") is False
    assert field("tokenizer.chat_template") == CHAT_TEMPLATE
    assert len(field("tokenizer.ggml.merges")) > 100
    assert field("llama.vocab_size") == len(tokens)


def test_config_vocab_larger_than_tokenizer_is_padded(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    n = train_bpe_tokenizer(folder, "gpt2", 400)
    write_tiny_model(folder, "llama", n + 12, tied=True)
    out = tmp_path / "m.gguf"
    convert_hf(folder, out, "f32")
    r = GGUFReader(out)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == n + 12
    assert r.fields["tokenizer.ggml.token_type"].contents()[-1] == TokenType.UNUSED
    toks = [1, 5, 9, n + 3]
    assert rel_err(llama_logits(out, toks), reference.forward(folder, toks)) < REL_TOL


def test_vocab_from_gguf(tmp_path: Path, smollm2_path: Path, tokenizer_fields) -> None:
    src = smollm2_path
    folder = tmp_path / "hf"
    write_tiny_model(folder, "llama", 49152, hidden=32, layers=1, heads=2, kv_heads=1, ffn=32, tied=True)
    out = tmp_path / "draft.gguf"
    convert_hf(folder, out, "f16", vocab_from=src)
    # SmolLM2's tokenizer fields as the session parsed them (conftest): a second GGUFReader of it took seconds
    ours, theirs = GGUFReader(out), {f.name: f for f in tokenizer_fields}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert ours.fields[key].contents() == theirs[key].contents(), key
    a = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    b = llama_cpp.Llama(str(src), vocab_only=True, verbose=False)
    text = b"def f(x):\n    return x * 42  # caf\xc3\xa9 <|im_end|>"
    assert a.tokenize(text, special=True) == b.tokenize(text, special=True)


def test_cli_script_converts(tmp_path: Path) -> None:
    import subprocess
    import sys

    make_checkpoint(tmp_path / "hf", "qwen2", "qwen2", ffn=80)
    script = Path(__file__).resolve().parent.parent / "converters" / "hf_to_gguf.py"
    out = tmp_path / "m.gguf"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "hf"), str(out), "--outtype", "q8_0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and out.is_file()
    assert "blk.0.ffn_down.weight" in proc.stderr  # the f16 fallback is reported


def test_sharded_f16_checkpoint(tmp_path: Path) -> None:
    """Shards listed by the index are all read, whatever order the tensors are spread over them."""
    cfg = make_checkpoint(tmp_path / "hf", "mistral", "smollm", shards=4, dtype="F16")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4
    out = tmp_path / "m.gguf"
    convert_hf(tmp_path / "hf", out, "f32")
    toks = tokens_for(cfg, 12)
    assert rel_err(llama_logits(out, toks), reference.forward(tmp_path / "hf", toks)) < REL_TOL


def test_output_has_no_leftovers(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "hf", "llama", "gpt2")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    convert_hf(tmp_path / "hf", out_dir / "m.gguf", "f16")
    assert [p.name for p in out_dir.iterdir()] == ["m.gguf"]


def test_pytorch_bin_checkpoint_through_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from ggufspec.convert.checkpoint import load_checkpoint

    cfg = make_checkpoint(tmp_path / "hf", "llama", "smollm", dtype="BF16")
    refs = load_checkpoint(tmp_path / "hf")
    state = {n: torch.from_numpy(np.array(r.load())).to(torch.bfloat16) for n, r in refs.items()}
    del refs
    torch.save(state, tmp_path / "hf" / "pytorch_model.bin")
    (tmp_path / "hf" / "model.safetensors").unlink()
    out = tmp_path / "m.gguf"
    convert_hf(tmp_path / "hf", out, "f32")
    toks = tokens_for(cfg, 12)
    assert rel_err(llama_logits(out, toks), reference.forward(tmp_path / "hf", toks)) < REL_TOL
