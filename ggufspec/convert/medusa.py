"""Medusa heads (FasterDecoding v1/v2 checkpoints) -> GGUF, plus the reader and numpy evaluation of such a GGUF.

GGUF layout of a Medusa head set (the Medusa runtime reads exactly these names):

| what                                   | key / tensor name              | type / shape (numpy order)  |
|----------------------------------------|--------------------------------|-----------------------------|
| architecture                           | general.architecture = "medusa"| string                      |
| checkpoint format version (1 or 2)     | medusa.version                 | uint32                      |
| number of heads                        | medusa.head_count              | uint32                      |
| ResBlocks per head                     | medusa.layer_count             | uint32                      |
| hidden size of the base model          | medusa.hidden_size             | uint32                      |
| vocabulary size (0: unknown, v2 only)  | medusa.vocab_size              | uint32                      |
| base model name or path                | medusa.base_model              | string (may be absent)      |
| candidate tree fitted to these heads   | medusa.tree                    | string, JSON choices (may be absent) |
| ResBlock j of head i: weight           | medusa.{i}.res.{j}.weight      | [hidden, hidden]            |
| ResBlock j of head i: bias             | medusa.{i}.res.{j}.bias        | [hidden], f32               |
| head i's own LM head (v1 only)         | medusa.{i}.lm_head.weight      | [vocab, hidden]             |

Head i computes h_i = ResBlock_{L-1}(...ResBlock_0(h)) with ResBlock(x) = x + SiLU(W x + b), then
logits_i = lm_head_i h_i (v1), or the base model's LM head applied to h_i (v2). Head i predicts the token
i + 2 positions after the one whose last hidden state h is (head 0 guesses the token after next).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf import quants

from ggufspec.convert.checkpoint import TensorRef, open_tensor_file
from ggufspec.convert.writing import OUT_TYPES, PlannedTensor, storage_type, write_gguf
from ggufspec.errors import ConversionError, ModelFileError
from ggufspec.gguf_check import read_header
from ggufspec.trees import TreeError, build_tree

ARCH = "medusa"
KEY_VERSION = "medusa.version"
KEY_HEAD_COUNT = "medusa.head_count"
KEY_LAYER_COUNT = "medusa.layer_count"
KEY_HIDDEN_SIZE = "medusa.hidden_size"
KEY_VOCAB_SIZE = "medusa.vocab_size"
KEY_BASE_MODEL = "medusa.base_model"
KEY_TREE = "medusa.tree"  # JSON choices fitted to these heads (config.json's medusa_choices); optional


def res_weight_name(head: int, layer: int) -> str:
    return f"medusa.{head}.res.{layer}.weight"


def res_bias_name(head: int, layer: int) -> str:
    return f"medusa.{head}.res.{layer}.bias"


def lm_head_name(head: int) -> str:
    return f"medusa.{head}.lm_head.weight"


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


def find_source(src: Path) -> tuple[Path, dict]:
    """The weights file and parsed config.json (or {}) of a Medusa head set given as folder or file."""
    src = Path(src)
    if src.is_dir():
        weights = next((src / n for n in SOURCE_FILES if (src / n).exists()), None)
        if weights is None:
            raise ModelFileError(f"{src}: no Medusa weights found (expected one of {', '.join(SOURCE_FILES)})")
        cfg_path = src / "config.json"
    elif src.is_file():
        weights, cfg_path = src, src.parent / "config.json"
    else:
        raise ModelFileError(f"{src}: does not exist")
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
    """Convert a FasterDecoding Medusa head set (folder or weights file) to the GGUF file `out`."""
    if outtype not in ("f32", "f16", "q8_0"):
        raise ConversionError(f"unknown output type {outtype!r} for Medusa heads; choose f16, f32 or q8_0")
    start = time.perf_counter()
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


@dataclass
class MedusaHeads:
    """A Medusa head set loaded from GGUF as float32 arrays."""

    version: int
    hidden: int
    vocab: int
    base_model: str
    res: list[list[tuple[np.ndarray, np.ndarray]]]  # res[i][j] = (W [hidden, hidden], b [hidden])
    lm_heads: list[np.ndarray] | None  # v1: [vocab, hidden] per head; v2: None
    choices: list[list[int]] | None = None  # the candidate tree fitted to these heads, if the file has one

    @property
    def heads(self) -> int:
        return len(self.res)

    def hidden_states(self, h: np.ndarray) -> list[np.ndarray]:
        """Each head's output hidden state for base hidden states h ([..., hidden])."""
        outs = []
        for blocks in self.res:
            x = h.astype(np.float32)
            for w, b in blocks:
                z = x @ w.T + b
                x = x + z / (1.0 + np.exp(-z))
            outs.append(x)
        return outs

    def logits(self, h: np.ndarray, base_lm_head: np.ndarray | None = None) -> list[np.ndarray]:
        """Each head's logits; v2 heads need the base model's LM head ([vocab, hidden])."""
        heads = self.lm_heads
        if heads is None:
            if base_lm_head is None:
                raise ValueError("a version 2 Medusa head set uses the base model's LM head: pass base_lm_head")
            heads = [base_lm_head] * self.heads
        return [x @ lm.T for x, lm in zip(self.hidden_states(h), heads)]


def load_medusa_gguf(path: Path) -> MedusaHeads:
    """Read a Medusa GGUF written by convert_medusa (any of its storage types) into float32 arrays;
    ModelFileError for anything damaged."""
    path = Path(path)
    read_header(path)  # bounds-checked first: gguf-py's reader indexes past the end of damaged tables
    try:
        return _read_medusa(path)
    except (OSError, ValueError, TypeError, IndexError, KeyError, OverflowError, NotImplementedError) as e:
        # NotImplementedError: gguf-py cannot dequantize the type a tensor claims (Q8_1, say)
        raise ModelFileError(f"{path}: damaged Medusa GGUF ({type(e).__name__}: {e})") from None


def _read_medusa(path: Path) -> MedusaHeads:
    r = GGUFReader(path)

    def get(key: str, default=None):
        f = r.get_field(key)
        return default if f is None else f.contents()

    if get("general.architecture") != ARCH:
        raise ModelFileError(f"{path}: not a Medusa GGUF (general.architecture is {get('general.architecture')!r})")
    tensors = {t.name: t for t in r.tensors}

    def arr(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    heads, layers, version = int(get(KEY_HEAD_COUNT)), int(get(KEY_LAYER_COUNT)), int(get(KEY_VERSION))
    res = [[(arr(res_weight_name(i, j)), arr(res_bias_name(i, j))) for j in range(layers)] for i in range(heads)]
    lm = [arr(lm_head_name(i)) for i in range(heads)] if version == 1 else None
    choices = get(KEY_TREE)
    if choices is not None:
        try:
            choices = json.loads(choices)
            build_tree(choices)
        except (TreeError, TypeError, ValueError) as e:
            raise ModelFileError(f"{path}: its {KEY_TREE} is not a candidate tree ({e})") from None
    hidden = int(get(KEY_HIDDEN_SIZE))
    for i, head in enumerate(res):
        for j, (w, b) in enumerate(head):
            if w.shape != (hidden, hidden) or b.shape != (hidden,):
                raise ModelFileError(f"{path}: head {i} layer {j} has shapes {list(w.shape)} and {list(b.shape)}, "
                                     f"not [{hidden}, {hidden}] and [{hidden}]")
    if lm and any(m.shape != (lm[0].shape[0], hidden) for m in lm):
        raise ModelFileError(f"{path}: its output heads differ in shape: {[list(m.shape) for m in lm]}")
    return MedusaHeads(version, hidden, int(get(KEY_VOCAB_SIZE)), str(get(KEY_BASE_MODEL, "")), res, lm, choices)
