"""ggufspec's Medusa GGUF: the one place that knows how a Medusa head set is laid out in a GGUF file.

`write_heads` (arrays in memory: `medusa train`) and `write_medusa_gguf` (tensors loaded one at a time: `convert
medusa`) write this layout; `read_heads` reads it back. Everything else names keys and tensors through `Keys`,
`MedusaTensor` and `tensor_name`, never by spelling them out.

| what                                   | key / tensor name               | type / shape (numpy order)           |
|----------------------------------------|---------------------------------|--------------------------------------|
| architecture                           | general.architecture = "medusa" | string                               |
| head set's name                        | general.name                    | string (may be absent)               |
| storage type of the matrices           | general.file_type               | uint32 (llama.cpp's LlamaFileType)   |
| format version (1 or 2)                | medusa.version                  | uint32                               |
| number of heads                        | medusa.head_count               | uint32                               |
| ResBlocks per head                     | medusa.layer_count              | uint32                               |
| hidden size of the base model          | medusa.hidden_size              | uint32                               |
| vocabulary size (0: unknown, v2 only)  | medusa.vocab_size               | uint32                               |
| base model name or path                | medusa.base_model               | string (may be absent)               |
| candidate tree fitted to these heads   | medusa.tree                     | string, JSON choices (may be absent) |
| ResBlock j of head i: weight           | medusa.{i}.res.{j}.weight       | [hidden, hidden]                     |
| ResBlock j of head i: bias             | medusa.{i}.res.{j}.bias         | [hidden], always f32                 |
| head i's own LM head (v1 only)         | medusa.{i}.lm_head.weight       | [vocab, hidden]                      |

Version 1 heads carry their own LM heads; version 2 heads share the target's output matrix (none stored). The
matrices are stored as f32, f16 or q8_0 (`OUT_TYPES`); a matrix whose rows q8_0's blocks do not divide falls back
to f16. A restricted candidate vocabulary is a run-time option (`candidates.py`), not part of the file.

This module imports neither llama.cpp nor `ggufspec.convert`: the converter, `medusa train` and the run-time heads
all build on it. It writes through `ggufspec.gguf_write`, the streaming GGUF writer the converter uses too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum, auto
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType, quants

from .. import gguf_write
from ..errors import ConversionError, ModelFileError
from ..gguf_check import read_header
from ..gguf_write import PlannedTensor, write_gguf
from ..trees import TreeError, build_tree

ARCH = "medusa"


class Keys:
    """Metadata keys of a Medusa GGUF (as gguf-py's `gguf.Keys`); the module docstring gives types and meanings."""

    VERSION = "medusa.version"
    HEAD_COUNT = "medusa.head_count"
    LAYER_COUNT = "medusa.layer_count"
    HIDDEN_SIZE = "medusa.hidden_size"
    VOCAB_SIZE = "medusa.vocab_size"
    BASE_MODEL = "medusa.base_model"  # optional
    TREE = "medusa.tree"  # optional: JSON choices fitted to these heads


class MedusaTensor(IntEnum):
    """The kinds of tensor in a Medusa GGUF (as gguf-py's `MODEL_TENSOR`)."""

    RES_WEIGHT = auto()
    RES_BIAS = auto()
    LM_HEAD = auto()


TENSOR_NAMES: dict[MedusaTensor, str] = {
    MedusaTensor.RES_WEIGHT: "medusa.{head}.res.{layer}.weight",
    MedusaTensor.RES_BIAS: "medusa.{head}.res.{layer}.bias",
    MedusaTensor.LM_HEAD: "medusa.{head}.lm_head.weight",
}


def tensor_name(kind: MedusaTensor, head: int, layer: int = 0) -> str:
    """The GGUF name of head `head`'s tensor of this kind (`layer` only matters for ResBlock tensors)."""
    return TENSOR_NAMES[kind].format(head=head, layer=layer)


# storage type of the matrices (biases are always f32) and the general.file_type recorded for it: gguf_write's
# output types less bf16
OUT_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    k: gguf_write.OUT_TYPES[k] for k in ("f32", "f16", "q8_0")}


def check_outtype(outtype: str) -> None:
    """ConversionError unless `outtype` is one of OUT_TYPES."""
    if outtype not in OUT_TYPES:
        raise ConversionError(f"unknown output type {outtype!r} for Medusa heads; choose f16, f32 or q8_0")


@dataclass(frozen=True)
class MedusaMeta:
    """A head set's metadata: everything the file records besides the tensors."""

    version: int  # 1: own LM heads; 2: the target's shared
    heads: int
    layers: int  # ResBlocks per head
    hidden: int
    vocab: int  # 0: unknown (v2 only)
    base_model: str = ""
    choices: list[list[int]] | None = None  # candidate tree fitted to the heads
    name: str = ""  # general.name


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the layout: what it is, its GGUF name and its shape (numpy order)."""

    kind: MedusaTensor
    head: int
    layer: int
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return tensor_name(self.kind, self.head, self.layer)


def tensor_layout(meta: MedusaMeta) -> Iterator[TensorSpec]:
    """Every tensor of a head set with this metadata, in file order: per head its ResBlocks (weight, bias), then
    its LM head (v1). LM heads are indexed at layer `meta.layers`, where FasterDecoding checkpoints put them."""
    for i in range(meta.heads):
        for j in range(meta.layers):
            yield TensorSpec(MedusaTensor.RES_WEIGHT, i, j, (meta.hidden, meta.hidden))
            yield TensorSpec(MedusaTensor.RES_BIAS, i, j, (meta.hidden,))
        if meta.version == 1:
            yield TensorSpec(MedusaTensor.LM_HEAD, i, meta.layers, (meta.vocab, meta.hidden))


@dataclass
class HeadSet:
    """A Medusa head set as the file holds it: `read_heads` gives float32 arrays; `write_heads` takes any float."""

    version: int
    hidden: int
    vocab: int
    base_model: str
    res: list[list[tuple[np.ndarray, np.ndarray]]]  # res[i][j] = (W [hidden, hidden], b [hidden])
    lm_heads: list[np.ndarray] | None  # v1: [vocab, hidden] per head; v2: None
    choices: list[list[int]] | None = None  # the candidate tree fitted to these heads, if the file has one
    name: str = ""  # general.name

    @property
    def heads(self) -> int:
        return len(self.res)

    @property
    def meta(self) -> MedusaMeta:
        return MedusaMeta(self.version, self.heads, len(self.res[0]) if self.res else 0, self.hidden, self.vocab,
                          self.base_model, self.choices, self.name)


# --- writing ---------------------------------------------------------------------------------------------------


def storage_type(shape: tuple[int, ...], outtype: str) -> tuple[GGMLQuantizationType, str]:
    """How a tensor of this shape is stored for `outtype`, and a note when that is not `outtype` itself (as
    `gguf_write.storage_type`, for Medusa's output types only: biases stay f32)."""
    check_outtype(outtype)
    return gguf_write.storage_type(shape, outtype)


def _check_meta(meta: MedusaMeta) -> None:
    if meta.version not in (1, 2):
        raise ConversionError(f"Medusa heads of version {meta.version}: only 1 (own LM heads) and 2 exist")
    if meta.version == 1 and meta.vocab <= 0:
        raise ConversionError("version 1 Medusa heads need their vocabulary size (the LM heads' rows)")
    if meta.choices is not None:
        try:
            tree = build_tree(meta.choices)
        except (TreeError, TypeError, ValueError) as e:
            raise ConversionError(f"the candidate tree is not a tree ({e})") from None
        if tree.n_heads > meta.heads:
            raise ConversionError(f"the candidate tree is {tree.n_heads} deep; there are {meta.heads} heads")


def write_medusa_gguf(
    out: Path,
    meta: MedusaMeta,
    load: Callable[[TensorSpec], np.ndarray],
    outtype: str = "f16",
    progress: Callable[[TensorSpec], None] | None = None,
) -> list[str]:
    """Write the head set `meta` describes to the GGUF file `out`; returns notes on tensors stored in another type
    than `outtype` (as "NAME: why").

    `load(spec)` gives each tensor of `tensor_layout(meta)` as an array of that shape, once, in file order: a
    tensor is loaded, encoded and written before the next is loaded, so a head set larger than memory streams
    through. `progress(spec)` is called after each is written. ConversionError for metadata that contradicts
    itself (version, tree) or an array of the wrong shape. The output is written atomically (`temp_output`):
    on any failure `out` is left as it was.
    """
    check_outtype(outtype)
    _check_meta(meta)
    specs = list(tensor_layout(meta))
    types = {s: storage_type(s.shape, outtype) for s in specs}

    def planned(s: TensorSpec) -> PlannedTensor:
        return PlannedTensor(s.name, s.shape, types[s][0], lambda: np.ascontiguousarray(load(s), dtype=np.float32))

    written = iter(specs)  # gguf_write reports each tensor written, in file order
    write_gguf(Path(out), ARCH, lambda w: _add_metadata(w, meta, outtype), [planned(s) for s in specs],
               (lambda _: progress(next(written))) if progress else None)
    return [f"{s.name}: {note}" for s, (_, note) in types.items() if note]


def write_heads(out: Path, heads: HeadSet, outtype: str = "f16") -> list[str]:
    """Write a head set held in memory to the GGUF file `out`, as `write_medusa_gguf` does (same notes, errors
    and atomicity); `heads.version` must be 1 exactly when it has LM heads."""
    if (heads.version == 1) != (heads.lm_heads is not None):
        raise ConversionError(f"version {heads.version} Medusa heads "
                              f"{'need' if heads.version == 1 else 'cannot have'} their own LM heads")
    if any(len(r) != len(heads.res[0]) for r in heads.res):
        raise ConversionError(f"Medusa heads differ in ResBlock count: {[len(r) for r in heads.res]}")

    def load(s: TensorSpec) -> np.ndarray:
        if s.kind is MedusaTensor.LM_HEAD:
            return heads.lm_heads[s.head]
        return heads.res[s.head][s.layer][0 if s.kind is MedusaTensor.RES_WEIGHT else 1]

    return write_medusa_gguf(out, heads.meta, load, outtype)


def _add_metadata(w: GGUFWriter, meta: MedusaMeta, outtype: str) -> None:
    if meta.name:
        w.add_name(meta.name)
    w.add_file_type(int(OUT_TYPES[outtype][1]))
    w.add_uint32(Keys.VERSION, meta.version)
    w.add_uint32(Keys.HEAD_COUNT, meta.heads)
    w.add_uint32(Keys.LAYER_COUNT, meta.layers)
    w.add_uint32(Keys.HIDDEN_SIZE, meta.hidden)
    w.add_uint32(Keys.VOCAB_SIZE, meta.vocab)
    if meta.base_model:
        w.add_string(Keys.BASE_MODEL, meta.base_model)
    if meta.choices is not None:
        w.add_string(Keys.TREE, json.dumps(meta.choices, separators=(",", ":")))


# --- reading ---------------------------------------------------------------------------------------------------


def read_heads(path: Path) -> HeadSet:
    """Read a Medusa GGUF in this layout (any of its storage types) into float32 arrays; ModelFileError for a file
    that is not one, or is damaged (missing tensors or keys, wrong shapes, a `medusa.tree` that is not a tree)."""
    path = Path(path)
    read_header(path)  # bounds-checked first: gguf-py's reader indexes past the end of damaged tables
    try:
        return _read(path)
    except (OSError, ValueError, TypeError, IndexError, KeyError, OverflowError, NotImplementedError) as e:
        # NotImplementedError: gguf-py cannot dequantize the type a tensor claims (Q8_1, say)
        raise ModelFileError(f"{path}: damaged Medusa GGUF ({type(e).__name__}: {e})") from None


def _read(path: Path) -> HeadSet:
    r = GGUFReader(path)

    def get(key: str, default=None):
        f = r.get_field(key)
        return default if f is None else f.contents()

    if get("general.architecture") != ARCH:
        raise ModelFileError(f"{path}: not a Medusa GGUF (general.architecture is {get('general.architecture')!r})")
    tensors = {t.name: t for t in r.tensors}

    def arr(kind: MedusaTensor, head: int, layer: int = 0) -> np.ndarray:
        name = tensor_name(kind, head, layer)
        if name not in tensors:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    heads, layers, version = int(get(Keys.HEAD_COUNT)), int(get(Keys.LAYER_COUNT)), int(get(Keys.VERSION))
    res = [[(arr(MedusaTensor.RES_WEIGHT, i, j), arr(MedusaTensor.RES_BIAS, i, j)) for j in range(layers)]
           for i in range(heads)]
    lm = [arr(MedusaTensor.LM_HEAD, i) for i in range(heads)] if version == 1 else None
    choices = get(Keys.TREE)
    if choices is not None:
        try:
            choices = json.loads(choices)
            build_tree(choices)
        except (TreeError, TypeError, ValueError) as e:
            raise ModelFileError(f"{path}: its {Keys.TREE} is not a candidate tree ({e})") from None
    hidden = int(get(Keys.HIDDEN_SIZE))
    for i, head in enumerate(res):
        for j, (w, b) in enumerate(head):
            if w.shape != (hidden, hidden) or b.shape != (hidden,):
                raise ModelFileError(f"{path}: head {i} layer {j} has shapes {list(w.shape)} and {list(b.shape)}, "
                                     f"not [{hidden}, {hidden}] and [{hidden}]")
    if lm and any(m.shape != (lm[0].shape[0], hidden) for m in lm):
        raise ModelFileError(f"{path}: its output heads differ in shape: {[list(m.shape) for m in lm]}")
    return HeadSet(version, hidden, int(get(Keys.VOCAB_SIZE)), str(get(Keys.BASE_MODEL, "")), res, lm, choices,
                   str(get("general.name", "")))
