"""llama.cpp with our GGUF tokenizes a mixed corpus exactly as the `tokenizers` library does from the source files."""

from __future__ import annotations

from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
tokenizers = pytest.importorskip("tokenizers")

from convert_fixtures import (  # noqa: E402
    TOKENIZER_CORPUS, bpe_from_gguf, spm_tokenizer_json, train_bpe_tokenizer,
    train_spm_tokenizer, write_tiny_model,
)
from ggufspec.convert.hf import convert_hf  # noqa: E402


def convert_vocab(folder: Path, n_vocab: int, arch: str = "llama") -> "llama_cpp.Llama":
    write_tiny_model(folder, arch, n_vocab, hidden=32, layers=1, heads=2, kv_heads=1, ffn=32, tied=True)
    out = folder / "model.gguf"
    convert_hf(folder, out, "f16")
    return llama_cpp.Llama(str(out), vocab_only=True, verbose=False)


def mismatches(llm: "llama_cpp.Llama", encode) -> list[str]:
    bad = []
    for text in TOKENIZER_CORPUS:
        ours = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        theirs = encode(text)
        if ours != theirs:
            bad.append(f"{text!r}: llama.cpp {ours} vs reference {theirs}")
    return bad


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama3", "qwen2"])
def test_trained_bpe_tokenizes_like_tokenizers(tmp_path: Path, pre: str) -> None:
    n = train_bpe_tokenizer(tmp_path, pre, 800)
    llm = convert_vocab(tmp_path, n)
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert mismatches(llm, lambda t: tk.encode(t, add_special_tokens=False).ids) == []


def test_real_smollm2_bpe_tokenizes_like_tokenizers(tmp_path: Path, smollm2_path: Path) -> None:
    """A real 49k-token vocabulary and merge list (SmolLM2's), rebuilt as tokenizer.json, then converted."""
    src = smollm2_path
    n = bpe_from_gguf(tmp_path, src)
    llm = convert_vocab(tmp_path, n)
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert mismatches(llm, lambda t: tk.encode(t, add_special_tokens=False).ids) == []
    assert llm.tokenize(b"<|im_start|>", add_bos=False, special=True) == [1]


def test_sentencepiece_tokenizes_like_tokenizers_and_sentencepiece(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    n = train_spm_tokenizer(tmp_path, 600)
    spm_tokenizer_json(tmp_path)  # HF ships both; the converter must take the vocabulary from tokenizer.model
    llm = convert_vocab(tmp_path, n, arch="mistral")
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert mismatches(llm, lambda t: tk.encode(t, add_special_tokens=False).ids) == []
    assert mismatches(llm, sp.encode) == []
    assert llm.tokenize(b"hi", add_bos=True)[0] == sp.bos_id()


def test_corpus_catches_a_wrong_pre_tokenizer(tmp_path: Path) -> None:
    """The corpus is not vacuous: forcing GPT-2's split onto a Llama 3 style tokenizer is detected."""
    n = train_bpe_tokenizer(tmp_path, "llama3", 800)
    write_tiny_model(tmp_path, "llama", n, hidden=32, layers=1, heads=2, kv_heads=1, ffn=32, tied=True)
    convert_hf(tmp_path, tmp_path / "wrong.gguf", "f16", tokenizer_pre="gpt-2")
    llm = llama_cpp.Llama(str(tmp_path / "wrong.gguf"), vocab_only=True, verbose=False)
    tk = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert mismatches(llm, lambda t: tk.encode(t, add_special_tokens=False).ids) != []
