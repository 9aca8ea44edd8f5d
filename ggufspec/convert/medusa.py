"""Medusa heads (FasterDecoding v1/v2 checkpoints) -> GGUF, in the layout `ggufspec.medusa.heads` reads (its
docstring has the table of keys and tensor names).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf import GGUFWriter

from ggufspec.convert.checkpoint import TensorRef, open_tensor_file
from ggufspec.outputs import refuse_overwriting_inputs
from ggufspec.convert.writing import OUT_TYPES, PlannedTensor, storage_type, write_gguf
from ggufspec.errors import ConversionError, ModelFileError
from ggufspec.medusa.heads import (
    ARCH, KEY_BASE_MODEL, KEY_HEAD_COUNT, KEY_HIDDEN_SIZE, KEY_LAYER_COUNT, KEY_TREE, KEY_VERSION, KEY_VOCAB_SIZE,
    lm_head_name, res_bias_name, res_weight_name,
)
from ggufspec.trees import TreeError, build_tree

SOURCE_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass
class MedusaReport:
    """What a Medusa conversion found and wrote."""

    out: Path
    version: int
    heads: int
    layers: int
    hidden: int
    vocab: int
    warnings: list[str]
    seconds: float


def source_paths(src: Path) -> tuple[Path, Path]:
    """The weights file and the config.json path (which may not exist) of a Medusa head set given as folder or file."""
    src = Path(src)
    if src.is_dir():
        weights = next((src / n for n in SOURCE_FILES if (src / n).exists()), None)
        if weights is None:
            raise ModelFileError(f"{src}: no Medusa weights found (expected one of {', '.join(SOURCE_FILES)})")
        return weights, src / "config.json"
    if src.is_file():
        return src, src.parent / "config.json"
    raise ModelFileError(f"{src}: does not exist")


def find_source(src: Path) -> tuple[Path, dict]:
    """The weights file and parsed config.json (or {}) of a Medusa head set given as folder or file."""
    weights, cfg_path = source_paths(src)
    cfg: dict = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{cfg_path}: not valid JSON ({e})") from e
    return weights, cfg


def _layout(weights: Path, refs: dict[str, TensorRef]) -> tuple[int, int, dict[tuple[int, int, str], TensorRef]]:
    """Heads and ResBlocks per head, counted from the tensor names, with every tensor by (head, index, kind)."""
    parts: dict[tuple[int, int, str], TensorRef] = {}
    for name, ref in refs.items():
        m = _KEY.match(name)
        if not m:
            raise ConversionError(f"{weights}: tensor {name!r} is not a Medusa head tensor ({{i}}.{{j}}.linear.weight|bias or {{i}}.{{L}}.weight)")
        parts[(int(m[1]), int(m[2]), m[3])] = ref
    if not parts:
        raise ConversionError(f"{weights}: holds no tensors")
    heads = max(k[0] for k in parts) + 1
    layers = max((k[1] for k in parts if k[2] != "weight"), default=-1) + 1
    for i in range(heads):
        for j in range(layers):
            for kind in ("linear.weight", "linear.bias"):
                if (i, j, kind) not in parts:
                    raise ConversionError(f"{weights}: tensor {i}.{j}.{kind} is missing (head {i} has fewer ResBlocks than others)")
    return heads, layers, parts


def convert_medusa(
    src: Path,
    out: Path,
    outtype: str = "f16",
    base_model: str | None = None,
    vocab_size: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> MedusaReport:
    """Convert a FasterDecoding Medusa head set (folder or weights file) to the GGUF file `out`.

    `out` must not be, or link to, the weights file or config.json read: that is refused before anything is
    written. The output is written atomically (`write_gguf`).
    """
    if outtype not in ("f32", "f16", "q8_0"):
        raise ConversionError(f"unknown output type {outtype!r} for Medusa heads; choose f16, f32 or q8_0")
    start = time.perf_counter()
    refuse_overwriting_inputs(Path(out), source_paths(src))
    weights, cfg = find_source(src)
    refs = open_tensor_file(weights)
    heads, layers, parts = _layout(weights, refs)
    warnings: list[str] = []

    lm_heads = {k[0]: r for k, r in parts.items() if k[2] == "weight"}
    version = 1 if lm_heads else 2
    if lm_heads and (set(lm_heads) != set(range(heads)) or any(k[1] != layers for k, _ in parts.items() if k[2] == "weight")):
        raise ConversionError(f"{weights}: LM-head tensors {{i}}.{layers}.weight are missing for some heads or misplaced")
    if str(cfg.get("version", version)) != str(version):
        warnings.append(f"config.json says version {cfg.get('version')}, the tensors are a version {version} head set")
    cfg_heads = cfg.get("medusa_num_heads")
    if cfg_heads is not None and int(cfg_heads) != heads:
        warnings.append(f"config.json says medusa_num_heads={cfg_heads}; the weights hold {heads} heads (used)")
    cfg_layers = cfg.get("medusa_num_layers")
    if cfg_layers is not None and int(cfg_layers) != layers:
        warnings.append(f"config.json says medusa_num_layers={cfg_layers}; the weights hold {layers} per head (used)")

    hidden = parts[(0, 0, "linear.weight")].shape[0] if layers else lm_heads[0].shape[1]
    vocab = lm_heads[0].shape[0] if lm_heads else int(vocab_size or cfg.get("vocab_size") or 0)
    plan: list[PlannedTensor] = []

    def add(name: str, ref: TensorRef, want: tuple[int, ...]) -> None:
        if tuple(ref.shape) != want:
            raise ConversionError(f"{weights}: tensor {ref.name!r} has shape {list(ref.shape)}, expected {list(want)}")
        qtype, note = storage_type(want, outtype)
        if note:
            warnings.append(f"{name}: {note}")
        plan.append(PlannedTensor(name, want, qtype, ref.load, ref.nbytes, note))

    for i in range(heads):
        for j in range(layers):
            add(res_weight_name(i, j), parts[(i, j, "linear.weight")], (hidden, hidden))
            add(res_bias_name(i, j), parts[(i, j, "linear.bias")], (hidden,))
        if lm_heads:
            add(lm_head_name(i), lm_heads[i], (vocab, hidden))

    base = base_model or cfg.get("base_model_name_or_path") or cfg.get("base_model") or ""
    choices = cfg.get("medusa_choices")
    if choices is not None:
        try:
            tree = build_tree(choices)
        except (TreeError, TypeError, ValueError) as e:
            raise ConversionError(f"{src}: config.json's medusa_choices is not a tree ({e})") from None
        if tree.n_heads > heads:
            raise ConversionError(f"{src}: config.json's medusa_choices is {tree.n_heads} deep; there are {heads} heads")

    def metadata(w: GGUFWriter) -> None:
        w.add_name(Path(src).resolve().name)
        w.add_file_type(int(OUT_TYPES[outtype][1]))
        w.add_uint32(KEY_VERSION, version)
        w.add_uint32(KEY_HEAD_COUNT, heads)
        w.add_uint32(KEY_LAYER_COUNT, layers)
        w.add_uint32(KEY_HIDDEN_SIZE, hidden)
        w.add_uint32(KEY_VOCAB_SIZE, vocab)
        if base:
            w.add_string(KEY_BASE_MODEL, base)
        if choices is not None:
            w.add_string(KEY_TREE, json.dumps(choices, separators=(",", ":")))

    write_gguf(Path(out), ARCH, metadata, plan, progress)
    return MedusaReport(Path(out), version, heads, layers, hidden, vocab, warnings, time.perf_counter() - start)
