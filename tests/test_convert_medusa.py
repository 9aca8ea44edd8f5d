"""Medusa -> GGUF: heads evaluated from our GGUF equal the same heads evaluated from the source checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from convert_fixtures import medusa_reference, write_medusa
from ggufspec.convert.medusa import convert_medusa
from ggufspec.errors import ConversionError, ModelFileError
from ggufspec.medusa.checkpoint import save_checkpoint
from ggufspec.medusa.format import ARCH, HeadSet, Keys, MedusaTensor, read_heads, tensor_name, write_heads
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
    assert f["general.architecture"] == ARCH
    assert (f[Keys.VERSION], f[Keys.HEAD_COUNT], f[Keys.LAYER_COUNT]) == (1, 3, 2)
    assert (f[Keys.HIDDEN_SIZE], f[Keys.VOCAB_SIZE]) == (HIDDEN, VOCAB)
    assert f[Keys.BASE_MODEL] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types[tensor_name(MedusaTensor.RES_WEIGHT, 2, 1)] == types["medusa.2.res.1.weight"] == "F16"
    assert types[tensor_name(MedusaTensor.RES_BIAS, 2, 1)] == types["medusa.2.res.1.bias"] == "F32"
    assert types[tensor_name(MedusaTensor.LM_HEAD, 0)] == types["medusa.0.lm_head.weight"] == "F16"
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


# --- format.py: the writer `medusa train` uses, and the reader -------------------------------------------------


def gguf_contents(path: Path, ignore: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(metadata without GGUF.* and `ignore`, {tensor name: (type, shape, bytes)}) of a GGUF file."""
    r = GGUFReader(path)
    meta = {k: r.fields[k].contents() for k in r.fields if not k.startswith("GGUF.") and k not in ignore}
    tensors = {t.name: (t.tensor_type.name, t.shape.tolist(), t.data.tobytes()) for t in r.tensors}
    return meta, tensors


def assert_same_gguf(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> None:
    meta_a, tensors_a = gguf_contents(a, ignore)
    meta_b, tensors_b = gguf_contents(b, ignore)
    assert meta_a == meta_b
    assert list(tensors_a) == list(tensors_b)  # same names in the same order
    for name in tensors_a:
        assert tensors_a[name] == tensors_b[name], name


def random_head_set(version: int, heads: int = 3, layers: int = 2, choices=None) -> HeadSet:
    rng = np.random.default_rng(11)
    res = [[(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), rng.standard_normal(HIDDEN).astype(np.float32))
            for _ in range(layers)] for _ in range(heads)]
    lm = [rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) for _ in range(heads)] if version == 1 else None
    return HeadSet(version, HIDDEN, VOCAB, "some/base-model", res, lm, choices, name="my heads")


@pytest.mark.parametrize("version", [1, 2])
def test_format_round_trip_is_exact_in_f32(tmp_path: Path, version: int) -> None:
    written = random_head_set(version, choices=[[0], [1], [0, 0], [0, 0, 2]])
    notes = write_heads(tmp_path / "h.gguf", written, "f32")
    assert notes == []
    read = read_heads(tmp_path / "h.gguf")
    assert (read.version, read.hidden, read.vocab, read.base_model, read.choices, read.name) == \
        (version, HIDDEN, VOCAB, "some/base-model", [[0], [1], [0, 0], [0, 0, 2]], "my heads")
    assert read.meta == written.meta
    for got, want in zip(read.res, written.res):
        for (w, b), (w0, b0) in zip(got, want):
            assert w.dtype == np.float32 and np.array_equal(w, w0) and np.array_equal(b, b0)
    if version == 1:
        assert all(np.array_equal(g, w) for g, w in zip(read.lm_heads, written.lm_heads))
    else:
        assert read.lm_heads is None
    assert isinstance(load_medusa_gguf(tmp_path / "h.gguf"), HeadSet)  # heads.py reads through format.py


def test_format_stores_matrices_in_the_type_asked_and_biases_in_f32(tmp_path: Path) -> None:
    written = random_head_set(2)
    write_heads(tmp_path / "h.gguf", written, "f16")
    read = read_heads(tmp_path / "h.gguf")
    w, b = read.res[1][1]
    assert np.array_equal(w, written.res[1][1][0].astype(np.float16).astype(np.float32))
    assert np.array_equal(b, written.res[1][1][1])
    assert read.choices is None and read.lm_heads is None


@pytest.mark.parametrize("version,outtype", [(1, "f16"), (2, "q8_0"), (2, "f32")])
def test_direct_write_equals_checkpoint_then_convert(tmp_path: Path, version: int, outtype: str) -> None:
    """What `medusa train` writes now (format.write_heads) is what it wrote before (a FasterDecoding checkpoint,
    then convert_medusa): the same metadata and the same bytes in every tensor; only general.name differs (it was
    the checkpoint folder's name)."""
    heads = random_head_set(version, choices=[[0], [0, 1]])
    write_heads(tmp_path / "direct.gguf", heads, outtype)
    ckpt = save_checkpoint(tmp_path / "ckpt", heads.res, heads.lm_heads, base_model=heads.base_model,
                           vocab_size=heads.vocab, choices=heads.choices)
    convert_medusa(ckpt, tmp_path / "converted.gguf", outtype)
    assert_same_gguf(tmp_path / "direct.gguf", tmp_path / "converted.gguf", ignore=("general.name",))


def test_format_refuses_contradictory_heads_and_leaves_no_file(tmp_path: Path) -> None:
    out = tmp_path / "bad.gguf"
    good = random_head_set(2)
    for heads, match in (
        (HeadSet(1, HIDDEN, VOCAB, "", good.res, None), "need their own LM heads"),
        (HeadSet(2, HIDDEN, VOCAB, "", good.res, [np.zeros((VOCAB, HIDDEN))] * 3), "cannot have"),
        (HeadSet(2, HIDDEN, VOCAB, "", good.res, None, [[0], [1, 0]]), "not a tree"),
        (HeadSet(2, HIDDEN, VOCAB, "", good.res, None, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]), "4 deep; there are 3"),
        (HeadSet(2, HIDDEN + 1, VOCAB, "", good.res, None), "shape"),
    ):
        with pytest.raises(ConversionError, match=match):
            write_heads(out, heads, "f32")
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConversionError, match="output type"):
        write_heads(out, good, "q4_0")


def test_format_reader_refuses_what_is_not_medusa(tmp_path: Path) -> None:
    write_heads(tmp_path / "h.gguf", random_head_set(2, heads=2, layers=1), "f32")
    data = bytearray((tmp_path / "h.gguf").read_bytes())
    i = data.index(b"medusa.1.res.0.bias")
    data[i : i + 6] = b"xxxxxx"  # the tensor's name, so it is missing
    (tmp_path / "renamed.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"tensor medusa\.1\.res\.0\.bias is missing"):
        read_heads(tmp_path / "renamed.gguf")
