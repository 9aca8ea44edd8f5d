"""Bad input to the converters: a clear error naming the file or tensor, and nothing half-written under the final name."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from convert_fixtures import train_bpe_tokenizer, write_safetensors, write_tiny_model  # noqa: E402
from ggufspec import gguf_write as writing  # noqa: E402
from ggufspec.convert.hf import convert_hf  # noqa: E402
from ggufspec.errors import ConversionError, GGUFSpecError, ModelFileError  # noqa: E402


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    n = train_bpe_tokenizer(folder, "gpt2", 300)
    write_tiny_model(folder, "llama", n, hidden=32, layers=2, heads=2, kv_heads=1, ffn=32)
    return folder


def outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".gguf" or p.name.endswith(".tmp"))


def test_unknown_architecture(model: Path, tmp_path: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"config\.json.*GPTNeoXForCausalLM.*not supported.*LlamaForCausalLM"):
        convert_hf(model, tmp_path / "m.gguf")
    assert outputs(tmp_path) == []


def test_missing_config(model: Path, tmp_path: Path) -> None:
    (model / "config.json").unlink()
    with pytest.raises(ModelFileError, match=r"config\.json: missing"):
        convert_hf(model, tmp_path / "m.gguf")


def test_missing_tokenizer_files(model: Path, tmp_path: Path) -> None:
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match=r"no tokenizer found.*--vocab-from"):
        convert_hf(model, tmp_path / "m.gguf")
    assert outputs(tmp_path) == []


def test_spm_style_tokenizer_json_without_model_file(model: Path, tmp_path: Path) -> None:
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = True
    (model / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConversionError, match=r"tokenizer\.json.*needs.*tokenizer\.model"):
        convert_hf(model, tmp_path / "m.gguf")


def test_unknown_pre_tokenizer_asks_for_override(model: Path, tmp_path: Path) -> None:
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (model / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConversionError, match=r"pre-tokenizer.*--tokenizer-pre"):
        convert_hf(model, tmp_path / "m.gguf")
    convert_hf(model, tmp_path / "m.gguf", tokenizer_pre="gpt-2")  # the override is the way out


def test_shape_disagrees_with_config(model: Path, tmp_path: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"model\.safetensors.*model\.layers\.0\.mlp\.\w+_proj\.weight.*shape"):
        convert_hf(model, tmp_path / "m.gguf")
    assert outputs(tmp_path) == []


def test_missing_tensor_is_named(model: Path, tmp_path: Path) -> None:
    from ggufspec.convert.checkpoint import SafetensorsFile

    st = SafetensorsFile(model / "model.safetensors")
    tensors = {n: np.array(st.read(n)) for n in st.entries if n != "model.layers.1.mlp.up_proj.weight"}
    st = None
    write_safetensors(model / "model.safetensors", tensors)
    with pytest.raises(ConversionError, match=r"blk\.1\.ffn_up\.weight"):
        convert_hf(model, tmp_path / "m.gguf")


def test_unexpected_tensor_is_named(model: Path, tmp_path: Path) -> None:
    write_safetensors(model / "extra.safetensors", {"vision_tower.proj.weight": np.zeros((2, 2), np.float32)})
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    with pytest.raises(ConversionError, match=r"extra\.safetensors.*vision_tower\.proj\.weight"):
        convert_hf(model, tmp_path / "m.gguf")


@pytest.mark.parametrize("damage", ["huge_header_length", "garbage_json", "truncated_data", "empty"])
def test_corrupt_safetensors(model: Path, tmp_path: Path, damage: str) -> None:
    path = model / "model.safetensors"
    raw = path.read_bytes()
    if damage == "huge_header_length":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    elif damage == "garbage_json":
        raw = raw[:8] + b"{not json" + raw[17:]
    elif damage == "truncated_data":
        raw = raw[: len(raw) // 2]
    else:
        raw = b""
    path.write_bytes(raw)
    with pytest.raises(ModelFileError, match=r"model\.safetensors.*(corrupt|truncated|not a safetensors)"):
        convert_hf(model, tmp_path / "m.gguf")
    assert outputs(tmp_path) == []


def test_missing_shard(model: Path, tmp_path: Path) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFileError, match=r"index\.json lists shards that are missing.*00001-of-00002"):
        convert_hf(model, tmp_path / "m.gguf")


def test_unwritable_output_path(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"does not exist"):
        convert_hf(model, tmp_path / "no" / "such" / "m.gguf")
    (tmp_path / "adir").mkdir()
    with pytest.raises(ConversionError, match=r"is a directory"):
        convert_hf(model, tmp_path / "adir")
    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConversionError, match=r"cannot write"):
            convert_hf(model, ro / "m.gguf")


def test_failure_mid_write_leaves_nothing_and_keeps_old_file(model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills up half-way: the error says so, the temp file is gone, an older output is untouched."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous good file")
    calls = {"n": 0}
    real = writing.encode

    def failing(arr, qtype):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real(arr, qtype)

    monkeypatch.setattr(writing, "encode", failing)
    full = rf"^cannot write to {re.escape(str(tmp_path))}: No space left on device \(m\.gguf was not written\)$"
    with pytest.raises(ConversionError, match=full):
        convert_hf(model, out)
    assert out.read_bytes() == b"previous good file"
    assert outputs(tmp_path) == ["m.gguf"]


def test_all_errors_share_the_cli_base_class() -> None:
    assert issubclass(ConversionError, GGUFSpecError) and issubclass(ModelFileError, GGUFSpecError)
