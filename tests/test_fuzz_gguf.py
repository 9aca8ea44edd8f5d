"""Bounded fuzzing of model loading: damaged GGUFs end in a ggufspec error or a model that works, never a crash.

Two real files are mutated region by region (fixed header, key/value table, tensor table, tensor data offsets,
tensor data, truncation): a small llama model that llama.cpp loads and decodes, and the shipped Medusa heads.
CI runs GGUFSPEC_FUZZ_CASES=600 cases per file (the default); set it to 10000 or more for a long run, and
GGUFSPEC_FUZZ_SEED to draw other cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufspec.errors import ModelFileError
from ggufspec.gguf_check import read_header
from ggufspec.medusa.heads import Heads, load_medusa_gguf

REPO = Path(__file__).resolve().parents[1]
CASES = int(os.environ.get("GGUFSPEC_FUZZ_CASES", "600"))
SEED = int(os.environ.get("GGUFSPEC_FUZZ_SEED", "0"))  # another seed, other cases
MEDUSA = REPO / "models" / "demo" / "smollm2-135m-instruct-medusa.gguf"
EXTREMES = [0, 1, 7, 255, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
CHUNK = 100  # survivors per child process


@dataclass(frozen=True)
class Layout:
    """Byte ranges of a GGUF's parts, and where each tensor's data offset is stored."""

    kv: tuple[int, int]
    tensor_table: tuple[int, int]
    data: tuple[int, int]
    offset_fields: tuple[int, ...]

    @classmethod
    def of(cls, path: Path) -> Layout:
        r = gguf.GGUFReader(path)
        table = min(t.field.offset for t in r.tensors)
        ends = tuple(t.field.offset + sum(p.nbytes for p in t.field.parts) - 8 for t in r.tensors)
        return cls((24, table), (table, r.data_offset), (r.data_offset, path.stat().st_size), ends)


def mutate(blob: bytes, layout: Layout, rng: np.random.Generator) -> tuple[str, bytes]:
    """One damaged copy of `blob`: which region was hit, and the bytes."""
    b = bytearray(blob)
    kind = rng.choice(["header", "kv", "tensor_table", "offset", "data", "truncate"])

    def flip(lo: int, hi: int) -> None:
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(lo, hi)] ^= 1 << int(rng.integers(0, 8))

    def extreme(at: int) -> None:
        b[at:at + 8] = EXTREMES[rng.integers(len(EXTREMES))].to_bytes(8, "little")

    if kind == "header":  # magic, version, tensor count, key/value count
        flip(0, 24) if rng.random() < 0.5 else extreme(int(rng.choice([8, 16])))
    elif kind in ("kv", "tensor_table"):  # string lengths, value types, array sizes, names, dims, types
        lo, hi = getattr(layout, kind)
        flip(lo, hi) if rng.random() < 0.5 else extreme(int(rng.integers(lo, hi - 8)))
    elif kind == "offset":
        at = int(rng.choice(layout.offset_fields))
        if rng.random() < 0.5:
            extreme(at)
        else:  # near misses: misaligned, overlapping, just past the end
            old = int.from_bytes(b[at:at + 8], "little")
            b[at:at + 8] = max(0, old + int(rng.choice([-32, -1, 1, 31, 32, 4096, 1 << 20]))).to_bytes(8, "little")
    elif kind == "data":
        flip(*layout.data)
    else:
        b = b[: rng.integers(0, len(b))]
    return kind, bytes(b)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> Path:
    """A llama model llama.cpp loads and decodes: 2 layers, 32 wide, a 300-token SentencePiece vocabulary."""
    path = tmp_path_factory.mktemp("fuzz") / "small-llama.gguf"
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *(f"\u2581w{i}" for i in range(41))]
    types = [2, 3, 3, *[6] * 256, *[1] * 41]
    n_vocab, e, ff = len(tokens), 32, 64
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 2), (w.add_context_length, 128), (w.add_embedding_length, e),
                       (w.add_feed_forward_length, ff), (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "llama"), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_scores, [0.0] * 3 + [-1.0] * 256 + [-2.0] * 41),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_unk_token_id, 0)):
        add(value)
    rng = np.random.default_rng(0)
    t = {"token_embd.weight": rng.normal(size=(n_vocab, e)), "output_norm.weight": np.ones(e),
         "output.weight": rng.normal(size=(n_vocab, e))}
    for i in range(2):
        t |= {f"blk.{i}.attn_norm.weight": np.ones(e), f"blk.{i}.ffn_norm.weight": np.ones(e),
              **{f"blk.{i}.{n}.weight": rng.normal(0, 0.2, size=(e, e)) for n in ("attn_q", "attn_k", "attn_v", "attn_output")},
              f"blk.{i}.ffn_gate.weight": rng.normal(0, 0.2, size=(ff, e)), f"blk.{i}.ffn_up.weight": rng.normal(0, 0.2, size=(ff, e)),
              f"blk.{i}.ffn_down.weight": rng.normal(0, 0.2, size=(e, ff))}
    for name, a in t.items():
        a = a.astype(np.float32)
        if name.endswith(("ffn_up.weight", "ffn_down.weight")):  # quantized blocks: their sizes are checked too
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name == "output.weight":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_in_children(paths: list[str]) -> Counter:
    """Load and decode every path in child processes (a crash or hang there fails the test with its file)."""
    code = (
        "import json, sys\n"
        "from ggufspec.decoder import LlamaCppDecoder, DecoderOptions\n"
        "from ggufspec.errors import GGUFSpecError\n"
        "out = {'decoded': 0, 'refused': 0}\n"
        "for p in json.loads(sys.argv[1]):\n"
        "    print(p, file=sys.stderr, flush=True)\n"
        "    try:\n"
        "        with LlamaCppDecoder(p, DecoderOptions(n_ctx=64, n_threads=1, memory_check=False)) as d:\n"
        "            d.feed([1, 299, 260, 5])\n"
        "            out['decoded'] += 1\n"
        "    except GGUFSpecError:\n"
        "        out['refused'] += 1\n"
        "print(json.dumps(out))\n"
    )
    total: Counter = Counter()
    for i in range(0, len(paths), CHUNK):
        r = subprocess.run([sys.executable, "-c", code, json.dumps(paths[i:i + CHUNK])], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        lines = r.stderr.splitlines()
        last = [ln for ln in lines if ln.endswith(".gguf")][-1:]
        why = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower()][-3:]
        assert r.returncode == 0, f"exit {r.returncode} on {last}: {why}"
        total.update(json.loads(r.stdout.strip().splitlines()[-1]))
    return total


def test_damaged_models_are_refused_or_load_and_decode(small_llama, tmp_path) -> None:
    blob, layout, rng = small_llama.read_bytes(), Layout.of(small_llama), np.random.default_rng([SEED, 1])
    outcome: Counter = Counter()
    survivors = []
    for i in range(CASES):
        kind, data = mutate(blob, layout, rng)
        path = tmp_path / f"c{i}.gguf"
        path.write_bytes(data)
        try:
            read_header(path)
        except ModelFileError:
            outcome["check refused"] += 1
            path.unlink()
            continue
        survivors.append(str(path))
        outcome[f"passed the check ({kind})"] += 1
    loaded = load_in_children(survivors)
    print(f"fuzz llama: {CASES} cases: {dict(outcome)}; llama.cpp: {dict(loaded)}")
    assert sum(loaded.values()) == len(survivors)
    assert outcome["check refused"] > CASES // 4 and loaded["decoded"] > 0, (outcome, loaded)


def test_damaged_medusa_heads_are_refused_or_load_and_run(tmp_path) -> None:
    blob, layout, rng = MEDUSA.read_bytes(), Layout.of(MEDUSA), np.random.default_rng([SEED, 2])
    h = np.random.default_rng(3).normal(size=(2, 576)).astype(np.float32)
    lm = np.random.default_rng(4).normal(size=(64, 576)).astype(np.float32)
    outcome: Counter = Counter()
    path = tmp_path / "case.gguf"
    for _ in range(CASES):
        kind, data = mutate(blob, layout, rng)
        path.write_bytes(data)
        try:
            raw = load_medusa_gguf(path)
        except ModelFileError:
            outcome["refused"] += 1
            continue
        if raw.heads and raw.hidden == h.shape[1] and raw.lm_heads is None:
            with np.errstate(all="ignore"):  # damaged weights may overflow: numbers, not a crash
                assert Heads(raw, lm).logits(h).shape[-1] == lm.shape[0]
        outcome[f"loaded ({kind})"] += 1
    print(f"fuzz medusa: {CASES} cases: {dict(outcome)}")
    assert outcome["refused"] > CASES // 4, outcome
