"""The click commands: convert hf|medusa, quantize, inspect (output, progress, errors)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

pytest.importorskip("tokenizers")

from convert_fixtures import train_bpe_tokenizer, write_medusa, write_tiny_model  # noqa: E402
from ggufspec.convert.commands import COMMANDS  # noqa: E402
from ggufspec.convert.inspect import inspect_gguf  # noqa: E402
from ggufspec.errors import ConversionError, GGUFSpecError  # noqa: E402


@pytest.fixture()
def cli() -> click.Group:
    group = click.Group("ggufspec")
    for cmd in COMMANDS:
        group.add_command(cmd)
    return group


def run(cli: click.Group, *args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture()
def hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    n = train_bpe_tokenizer(folder, "qwen2", 300)
    write_tiny_model(folder, "qwen2", n, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    return folder


def test_convert_inspect_quantize(cli: click.Group, hf_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    out = tmp_path / "m.gguf"
    res = run(cli, "convert", "hf", hf_dir, out, "--outtype", "f16")
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and out.is_file()

    res = run(cli, "inspect", out, "--n-ctx", "1000")
    assert res.exit_code == 0, res.output
    text = res.output
    assert "architecture:  qwen2" in text
    assert "model gpt2, pre qwen2" in text
    assert "chat template: present" in text
    assert "context:       2048" in text
    # 2 layers x 2 kv heads x (16 + 16) dims x 2 bytes = 256 B per token
    s = inspect_gguf(out)
    assert s.kv_bytes_per_token == 256
    assert s.ram_bytes(1000) == s.weight_bytes + 256_000
    assert s.ram_bytes(1000, "q8_0") == s.weight_bytes + 136_000  # 34 bytes a block of 32 values
    assert "RAM at n_ctx=1000" in text
    assert "attn_q  " in text or "attn_q " in text

    q = tmp_path / "m-q8.gguf"
    res = run(cli, "quantize", out, q, "--type", "q8_0", "--threads", "2")
    assert res.exit_code == 0, res.output
    assert "Q8_0" in res.output and q.is_file()
    res = run(cli, "quantize", out, q, "--type", "q9_9")
    assert res.exit_code == 2 and "--type" in res.output


def test_medusa_convert_and_inspect(cli: click.Group, tmp_path: Path) -> None:
    write_medusa(tmp_path / "src", heads=4, layers=1, hidden=64, vocab=100, config_heads=2)
    out = tmp_path / "medusa.gguf"
    res = run(cli, "convert", "medusa", tmp_path / "src", out)
    assert res.exit_code == 0, res.output
    assert "4 heads x 1 ResBlocks" in res.output and "medusa_num_heads=2" in res.output
    res = run(cli, "inspect", out)
    assert res.exit_code == 0, res.output
    assert "medusa heads:  version 1, heads 4, layers per head 1, hidden size 64, vocab size 100" in res.output


def test_bad_input_raises_ggufspec_error_for_the_cli_to_map(cli: click.Group, hf_dir: Path, tmp_path: Path) -> None:
    (hf_dir / "tokenizer.json").unlink()
    res = run(cli, "convert", "hf", hf_dir, tmp_path / "m.gguf")
    assert isinstance(res.exception, ConversionError) and isinstance(res.exception, GGUFSpecError)
    assert "no tokenizer found" in str(res.exception)
    res = run(cli, "convert", "hf", hf_dir, tmp_path / "m.gguf", "--outtype", "q4_0")
    assert res.exit_code == 2  # click usage error
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF but not really")
    res = run(cli, "inspect", bogus)
    assert isinstance(res.exception, GGUFSpecError) and "bogus.gguf" in str(res.exception)


def test_script_maps_errors_to_exit_2(hf_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    (hf_dir / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
    script = Path(__file__).resolve().parent.parent / "converters" / "hf_to_gguf.py"
    proc = subprocess.run([sys.executable, str(script), str(hf_dir), str(tmp_path / "m.gguf")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "FooForCausalLM" in proc.stderr and "not supported" in proc.stderr
    assert not (tmp_path / "m.gguf").exists()
