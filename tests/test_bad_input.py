"""Bad input ends in a clear message and exit code 2, before llama.cpp sees a damaged file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.errors import ContextLengthError, GGUFSpecError, ModelFileError, PairingError
from ggufspec.gguf_check import headers_kept, read_header
from tiny_models import TinyConfig, write_tiny_gguf


def run_cli(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def run_cli_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """In a child process, so a crash inside llama.cpp would show up as a signal, not kill pytest."""
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def truncated(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    data = smollm2_path.read_bytes()
    out = {}
    for name, n in {"half": len(data) // 2, "header": 3000, "tiny": 10, "last-byte": len(data) - 1}.items():
        (d / f"{name}.gguf").write_bytes(data[:n])
        out[name] = d / f"{name}.gguf"
    (d / "text.gguf").write_text("this is not a model\n" * 10)
    out["text"] = d / "text.gguf"
    mutated = bytearray(data[:200_000])
    mutated[4:8] = (99).to_bytes(4, "little")  # GGUF version 99
    (d / "version.gguf").write_bytes(bytes(mutated) + data[200_000:])
    out["version"] = d / "version.gguf"
    huge = bytearray(data)
    huge[8:16] = (10**12).to_bytes(8, "little")  # absurd tensor count
    (d / "count.gguf").write_bytes(bytes(huge))
    out["count"] = d / "count.gguf"
    return out


@pytest.mark.parametrize("case,message", [
    ("half", "truncated"), ("last-byte", "truncated"), ("header", "truncated"), ("tiny", "too small"),
    ("text", "not a GGUF file"), ("version", "version 99"), ("count", "damaged"),
])
def test_damaged_files_are_refused_before_llama_cpp(truncated, case, message) -> None:
    with pytest.raises(ModelFileError, match=message):
        read_header(truncated[case])
    r = run_cli_process("generate", "-m", str(truncated[case]), "hello")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and str(truncated[case]) in r.stderr


def test_missing_file_and_folder(tmp_path) -> None:
    r = run_cli("generate", "-m", str(tmp_path / "nope.gguf"), "hi")
    assert r.exit_code == 2 and "no such file" in r.output
    r = run_cli("generate", "-m", str(tmp_path), "hi")
    assert r.exit_code == 2


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads files without permission")
def test_unreadable_file(tmp_path, smollm2_path) -> None:
    p = tmp_path / "locked.gguf"
    p.write_bytes(smollm2_path.read_bytes()[:4096])
    p.chmod(0)
    with pytest.raises(ModelFileError, match="cannot be read"):
        read_header(p)


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory, tokenizer_fields, tiny_weights) -> Path:
    """The tiny target with one token's text changed: the pairing must name that token."""
    import gguf

    fields = []
    for f in tokenizer_fields:
        if f.name == "tokenizer.ggml.tokens":
            tokens = f.contents()
            tokens[1000] = "<changed>"
            f = _Field(f.name, f.types, tokens)
        fields.append(f)
    return write_tiny_gguf(tmp_path_factory.mktemp("pair") / "other.gguf", fields, tiny_weights, TinyConfig())


class _Field:
    def __init__(self, name, types, value):
        self.name, self.types, self.value = name, types, value

    def contents(self):
        return self.value


def test_incompatible_pair_names_the_mismatch(tiny_target, other_vocab) -> None:
    with pytest.raises(PairingError, match="token 1000"):
        SpeculativeEngine.load(tiny_target, other_vocab)
    r = run_cli("generate", "-m", str(tiny_target), "-d", str(other_vocab), "hi")
    assert r.exit_code == 2 and "token 1000" in r.output


def test_the_vocabulary_digest_tells_the_same_token_texts_from_others(tiny_target, tiny_draft, other_vocab) -> None:
    target, draft, other = (read_header(p).tokens_digest for p in (tiny_target, tiny_draft, other_vocab))
    assert target and target == draft  # other weights, one vocabulary: check_pair compares no token
    assert other and other != target  # one token's text differs: check_pair names it (above)


def test_a_header_is_parsed_once_within_a_load_and_again_after(smollm2_path, tmp_path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(smollm2_path.read_bytes())
    with headers_kept():
        first = read_header(path)
        assert read_header(path) is first
        with headers_kept():  # nested: the outer scope's
            assert read_header(path) is first
        assert read_header(path) is first
    assert read_header(path) is not first  # outside, each call reads the file
    path.write_bytes(smollm2_path.read_bytes()[:3000])  # a file damaged in place is refused once the load is over
    with pytest.raises(ModelFileError, match="truncated"):
        read_header(path)


def test_prompt_longer_than_context(tiny_target) -> None:
    long = "word " * 200
    r = run_cli("generate", "-m", str(tiny_target), "-c", "64", long)
    assert r.exit_code == 2 and "context" in r.output
    r = run_cli("generate", "-m", str(tiny_target), "-c", "64", "-n", "8", "--truncate-prompt", "--json", long)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stats"]["prompt_tokens"] <= 64 and len(out["tokens"]) == 8


@pytest.mark.parametrize("method", ["autoregressive", "vanilla"])
def test_generation_reaching_the_context_stops_with_length(tiny_target, tiny_draft, method) -> None:
    from ggufspec.decoder import DecoderOptions

    with SpeculativeEngine.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=48)) as engine:
        prompt = "one two three four five"
        n_prompt = len(engine.encode(prompt))
        r = engine.generate(prompt, GenerationSettings(max_tokens=500, method=method, draft_max=5))
        assert r.stop_reason == "length"
        assert n_prompt + len(r.tokens) == 48
        r = engine.generate(prompt, GenerationSettings(max_tokens=5, method=method))
        assert r.stop_reason == "max_tokens" and len(r.tokens) == 5


@pytest.mark.parametrize("args", [
    ["--temp", "-1"], ["--top-p", "0"], ["--top-p", "1.5"], ["--min-p", "2"], ["--draft-max", "0"],
    ["-c", "0"], ["-n", "0"], ["--top-k", "-3"], ["--method", "medusa"], ["--kv-type", "q9_0"],
    ["--kv-type", "q8_0", "--no-flash-attn"],
])
def test_invalid_values_are_usage_errors(tiny_target, args) -> None:
    r = run_cli("generate", "-m", str(tiny_target), *args, "hello")
    assert r.exit_code == 2, r.output
    assert "Error" in r.output or "error" in r.output


def test_empty_prompt(tiny_target) -> None:
    for prompt in ["", "   "]:
        r = run_cli("generate", "-m", str(tiny_target), prompt)
        assert r.exit_code == 2 and "empty" in r.output
    r = run_cli("generate", "-m", str(tiny_target), "-", input="")
    assert r.exit_code == 2 and "empty" in r.output
    with SpeculativeEngine.load(tiny_target) as engine, pytest.raises(GGUFSpecError, match="empty"):
        engine.generate("")


def test_models_that_do_not_fit_in_ram_are_refused_with_numbers(smollm2_path, tiny_target) -> None:
    huge = "50000000"  # SmolLM2's default KV cache for 50M tokens: 0.6 to 0.9 TB
    r = run_cli("generate", "-m", str(smollm2_path), "-d", str(tiny_target), "-c", huge, "hi")
    assert r.exit_code == 2 and "not enough memory" in r.output and "GiB" in r.output
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in r.output and "--no-memory-check" in r.output


def test_vanilla_without_a_draft(tiny_target) -> None:
    r = run_cli("generate", "-m", str(tiny_target), "--method", "vanilla", "hi")
    assert r.exit_code == 2 and "draft" in r.output


def test_engine_api_errors(tiny_target) -> None:
    engine = SpeculativeEngine.load(tiny_target)
    with pytest.raises(ValueError):
        GenerationSettings(max_tokens=0)
    with pytest.raises(ContextLengthError):
        engine.generate("word " * 5000)
    stream = engine.stream("Hello")
    next(stream)
    with pytest.raises(GGUFSpecError, match="already generating"):
        engine.generate("Hello")
    stream.close()
    assert engine.generate("Hello", GenerationSettings(max_tokens=2)).tokens
    engine.close()
    with pytest.raises(GGUFSpecError, match="closed"):
        engine.generate("Hello")


@pytest.mark.parametrize("method", ["autoregressive", "vanilla"])
def test_context_shift_keeps_generating_past_the_context(tiny_target, tiny_draft, method) -> None:
    from ggufspec.decoder import DecoderOptions

    with SpeculativeEngine.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=64)) as engine:
        r = engine.generate("one two three four five", GenerationSettings(
            max_tokens=300, method=method, draft_max=3, context_shift=True))
        assert len(r.tokens) == 300 and r.stop_reason == "max_tokens"
        t = engine.target
        assert t.n_shifts >= 4 and len(t.history) <= 64
        assert t.history[:5] == engine.encode("one two three four five")  # the prompt's start is kept
        assert t.kv_positions(0) == (0, len(t.history) - 1)
        # kept keys were computed while the dropped text was still there: a shifted context is an
        # approximation by design, so only its bookkeeping is checked, not equality with a fresh decode
