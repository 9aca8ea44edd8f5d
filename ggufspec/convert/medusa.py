"""Medusa heads (FasterDecoding v1/v2 checkpoints) -> ggufspec's Medusa GGUF: this module reads the checkpoint
(tensor names, config.json) and checks it; `ggufspec.medusa.format` writes the GGUF (its docstring has the layout).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ggufspec.convert.checkpoint import TensorRef, open_tensor_file
from ggufspec.errors import ConversionError, ModelFileError
from ggufspec.medusa.format import MedusaMeta, MedusaTensor, TensorSpec, check_outtype, tensor_layout, write_medusa_gguf
from ggufspec.outputs import refuse_overwriting_inputs
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
    written. ConversionError for a checkpoint that is not a Medusa head set (names, shapes, a config.json tree
    that is not one or is deeper than the heads); the report's warnings name what config.json misstates and the
    tensors stored in another type than `outtype`. The output is written atomically, one tensor loaded at a time
    (`format.write_medusa_gguf`); `progress` gets each tensor's source bytes once it is written.
    """
    check_outtype(outtype)
    start = time.perf_counter()
    refuse_overwriting_inputs(Path(out), source_paths(src))
    weights, cfg = find_source(src)
    refs = open_tensor_file(weights)
    heads, layers, parts = _layout(weights, refs)
    lm_heads = {k[0]: r for k, r in parts.items() if k[2] == "weight"}
    version = 1 if lm_heads else 2
    if lm_heads and (set(lm_heads) != set(range(heads)) or any(k[1] != layers for k, _ in parts.items() if k[2] == "weight")):
        raise ConversionError(f"{weights}: LM-head tensors {{i}}.{layers}.weight are missing for some heads or misplaced")
    warnings = _config_disagrees(cfg, version, heads, layers)
    hidden = parts[(0, 0, "linear.weight")].shape[0] if layers else lm_heads[0].shape[1]
    vocab = lm_heads[0].shape[0] if lm_heads else int(vocab_size or cfg.get("vocab_size") or 0)
    choices = _choices(src, cfg, heads)
    base = base_model or cfg.get("base_model_name_or_path") or cfg.get("base_model") or ""
    meta = MedusaMeta(version, heads, layers, hidden, vocab, base, choices, name=Path(src).resolve().name)
    source = _sources(meta, parts, weights)
    done = None if progress is None else (lambda spec: progress(source[spec].nbytes))
    warnings += write_medusa_gguf(Path(out), meta, lambda spec: source[spec].load(), outtype, done)
    return MedusaReport(Path(out), version, heads, layers, hidden, vocab, warnings, time.perf_counter() - start)


def _config_disagrees(cfg: dict, version: int, heads: int, layers: int) -> list[str]:
    """Warnings for what config.json misstates about the weights (which are used)."""
    warnings = []
    if str(cfg.get("version", version)) != str(version):
        warnings.append(f"config.json says version {cfg.get('version')}, the tensors are a version {version} head set")
    cfg_heads = cfg.get("medusa_num_heads")
    if cfg_heads is not None and int(cfg_heads) != heads:
        warnings.append(f"config.json says medusa_num_heads={cfg_heads}; the weights hold {heads} heads (used)")
    cfg_layers = cfg.get("medusa_num_layers")
    if cfg_layers is not None and int(cfg_layers) != layers:
        warnings.append(f"config.json says medusa_num_layers={cfg_layers}; the weights hold {layers} per head (used)")
    return warnings


def _choices(src: Path, cfg: dict, heads: int) -> list | None:
    """config.json's medusa_choices, checked to be a tree no deeper than the heads; None where it has none."""
    choices = cfg.get("medusa_choices")
    if choices is not None:
        try:
            tree = build_tree(choices)
        except (TreeError, TypeError, ValueError) as e:
            raise ConversionError(f"{src}: config.json's medusa_choices is not a tree ({e})") from None
        if tree.n_heads > heads:
            raise ConversionError(f"{src}: config.json's medusa_choices is {tree.n_heads} deep; there are {heads} heads")
    return choices


def _sources(meta: MedusaMeta, parts: dict, weights: Path) -> dict[TensorSpec, TensorRef]:
    """Every tensor the layout needs, from the checkpoint, its shape checked before anything is written."""
    source: dict[TensorSpec, TensorRef] = {}
    for spec in tensor_layout(meta):
        kind = {MedusaTensor.RES_WEIGHT: "linear.weight", MedusaTensor.RES_BIAS: "linear.bias"}.get(spec.kind, "weight")
        ref = parts[(spec.head, spec.layer, kind)]
        if tuple(ref.shape) != spec.shape:
            raise ConversionError(f"{weights}: tensor {ref.name!r} has shape {list(ref.shape)}, expected {list(spec.shape)}")
        source[spec] = ref
    return source
