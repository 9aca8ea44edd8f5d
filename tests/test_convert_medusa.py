"""Medusa -> GGUF: heads evaluated from our GGUF equal the same heads evaluated from the source checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from convert_fixtures import medusa_reference, write_medusa
from ggufspec.convert.medusa import convert_medusa
from ggufspec.errors import ConversionError, ModelFileError
from ggufspec.medusa import heads as medusa
from ggufspec.medusa.heads import load_medusa_gguf

HIDDEN, VOCAB = 64, 300


def rel_err(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    return max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))


@pytest.mark.parametrize("version", [1, 2])
def test_heads_match_source_f32_despite_misstated_config(tmp_path: Path, version: int) -> None:
    # like the public medusa-vicuna-7b-v1.3: config says 2 heads, the weights hold 5
    t = write_medusa(tmp_path / "src", heads=5, layers=1, hidden=HIDDEN, vocab=VOCAB, version=version, config_heads=2)
    out = tmp_path / "medusa.gguf"
    rep = convert_medusa(tmp_path / "src", out, "f32")
    assert (rep.version, rep.heads, rep.layers, rep.hidden) == (version, 5, 1, HIDDEN)
    assert any("medusa_num_heads=2" in w for w in rep.warnings)

    heads = load_medusa_gguf(out)
    h = np.random.default_rng(3).standard_normal((7, HIDDEN)).astype(np.float32)
    base = np.random.default_rng(4).standard_normal((VOCAB, HIDDEN)).astype(np.float32) if version == 2 else None
    err = rel_err(heads.logits(h, base), medusa_reference(t, h, 5, 1, base))
    assert err < 1e-5, f"relative error {err:.2e}"
    if version == 2:
        assert heads.lm_heads is None
        with pytest.raises(ValueError):
            heads.logits(h)


def test_metadata_and_names_follow_the_table(tmp_path: Path) -> None:
    write_medusa(tmp_path / "src", heads=3, layers=2, hidden=HIDDEN, vocab=VOCAB)
    out = tmp_path / "m.gguf"
    convert_medusa(tmp_path / "src", out)  # default f16
    r = GGUFReader(out)
    f = {k: r.fields[k].contents() for k in r.fields if not k.startswith("GGUF.")}
    assert f["general.architecture"] == medusa.ARCH
    assert (f[medusa.KEY_VERSION], f[medusa.KEY_HEAD_COUNT], f[medusa.KEY_LAYER_COUNT]) == (1, 3, 2)
    assert (f[medusa.KEY_HIDDEN_SIZE], f[medusa.KEY_VOCAB_SIZE]) == (HIDDEN, VOCAB)
    assert f[medusa.KEY_BASE_MODEL] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types[medusa.res_weight_name(2, 1)] == "F16"
    assert types[medusa.res_bias_name(2, 1)] == "F32"
    assert types[medusa.lm_head_name(0)] == "F16"
    assert len(types) == 3 * (2 * 2 + 1)


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-3), ("q8_0", 3e-2)])
def test_lower_precision_heads_stay_close(tmp_path: Path, outtype: str, tol: float) -> None:
    t = write_medusa(tmp_path / "src", heads=2, layers=1, hidden=HIDDEN, vocab=VOCAB)
    out = tmp_path / "m.gguf"
    convert_medusa(tmp_path / "src", out, outtype)
    h = np.random.default_rng(3).standard_normal((4, HIDDEN)).astype(np.float32)
    assert rel_err(load_medusa_gguf(out).logits(h), medusa_reference(t, h, 2, 1)) < tol


def test_pt_checkpoint_through_torch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    t = write_medusa(tmp_path / "src", heads=2, layers=1, hidden=HIDDEN, vocab=VOCAB, fmt="pt")
    out = tmp_path / "m.gguf"
    convert_medusa(tmp_path / "src", out, "f32")
    h = np.random.default_rng(3).standard_normal((4, HIDDEN)).astype(np.float32)
    assert rel_err(load_medusa_gguf(out).logits(h), medusa_reference(t, h, 2, 1)) < 1e-5


def test_bad_medusa_inputs(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no Medusa weights"):
        convert_medusa(tmp_path, tmp_path / "m.gguf")
    t = write_medusa(tmp_path / "src", heads=2, layers=2, hidden=HIDDEN, vocab=VOCAB)
    del t["1.1.linear.bias"]
    from convert_fixtures import write_safetensors

    write_safetensors(tmp_path / "src" / "medusa_lm_head.safetensors", t)
    with pytest.raises(ConversionError, match=r"1\.1\.linear\.bias is missing"):
        convert_medusa(tmp_path / "src", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(ConversionError, match="output type"):
        convert_medusa(tmp_path / "src", tmp_path / "m.gguf", "q4_0")


def test_fitted_tree_travels_in_the_gguf(tmp_path: Path) -> None:
    """config.json's medusa_choices becomes medusa.tree; a malformed or too deep one is refused, no file left."""
    import json

    write_medusa(tmp_path / "src", heads=2, layers=1, hidden=HIDDEN, vocab=VOCAB)
    assert load_medusa_gguf(convert_medusa(tmp_path / "src", tmp_path / "plain.gguf").out).choices is None
    cfg_path = tmp_path / "src" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for choices, match in (([[0], [1, 0]], "not a tree"), ([[0], [0, 0], [0, 0, 0]], "3 deep; there are 2 heads"),
                           ("[[0]]", "not a tree")):
        cfg_path.write_text(json.dumps({**cfg, "medusa_choices": choices}))
        with pytest.raises(ConversionError, match=match):
            convert_medusa(tmp_path / "src", tmp_path / "bad.gguf")
        assert not (tmp_path / "bad.gguf").exists()
    cfg_path.write_text(json.dumps({**cfg, "medusa_choices": [[0], [1], [0, 0]]}))
    out = convert_medusa(tmp_path / "src", tmp_path / "tree.gguf").out
    assert load_medusa_gguf(out).choices == [[0], [1], [0, 0]]
    assert json.loads(GGUFReader(out).get_field("medusa.tree").contents()) == [[0], [1], [0, 0]]
