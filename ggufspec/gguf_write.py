"""Streaming GGUF output: tensors encoded one at a time into a temp file, renamed into place only when complete
(through `outputs.temp_output`). Shared by the converters (`convert/`) and the Medusa format (`medusa/format.py`),
so it imports neither."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf import quants

from ggufspec.outputs import temp_output
from ggufspec.errors import ConversionError

Q = GGMLQuantizationType

OUT_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


@dataclass
class PlannedTensor:
    """One output tensor: its GGUF name, logical shape (rows first, as numpy), storage type and how to produce it."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    load: Callable[[], np.ndarray]
    source_bytes: int = 0
    note: str = ""  # why the type differs from the one asked for, if it does

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        return rows * (self.shape[-1] // block) * size


def storage_type(shape: tuple[int, ...], outtype: str) -> tuple[GGMLQuantizationType, str]:
    """Type a tensor of this shape is stored as for `outtype`, and a note when it falls back."""
    if outtype not in OUT_TYPES:
        raise ConversionError(f"unknown output type {outtype!r}; choose one of {', '.join(OUT_TYPES)}")
    want = OUT_TYPES[outtype][0]
    if len(shape) < 2:
        return Q.F32, ""  # norms and biases stay f32, as llama.cpp expects
    block = GGML_QUANT_SIZES[want][0]
    if shape[-1] % block:
        return Q.F16, f"row length {shape[-1]} is not a multiple of {block}: stored as f16"
    return want, ""


def encode(arr: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == Q.F32:
        return arr
    if qtype == Q.F16:
        return arr.astype(np.float16)
    return quants.quantize(arr, qtype)


def write_gguf(
    out: Path,
    arch: str,
    add_metadata: Callable[[GGUFWriter], None],
    tensors: list[PlannedTensor],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write a complete GGUF at `out` (atomically: temp file in the same folder, then rename).

    Failures, Ctrl-C, SIGTERM and SIGHUP leave no temp file and no change at `out` (see `temp_output`).
    """
    with temp_output(out) as tmp:
        w = GGUFWriter(tmp, arch)
        try:
            _write_all(w, add_metadata, tensors, progress)
        except BaseException:
            _close_quietly(w)
            raise


def _write_all(w: GGUFWriter, add_metadata: Callable[[GGUFWriter], None], tensors: list[PlannedTensor],
               progress: Callable[[int], None] | None) -> None:
    """Header, metadata, tensor infos, then each tensor loaded, checked and encoded one at a time; closes `w`."""
    add_metadata(w)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        arr = t.load()
        if tuple(arr.shape) != tuple(t.shape):
            raise ConversionError(f"tensor {t.name}: produced shape {list(arr.shape)}, expected {list(t.shape)}")
        data = encode(arr, t.qtype)
        del arr
        w.write_tensor_data(data)
        del data
        if progress:
            progress(t.source_bytes)
    w.close()


def _close_quietly(w: GGUFWriter) -> None:
    """Close the writer's open files after a failure; a flush that fails again (disk still full) is not news."""
    for f in w.fout or []:
        try:
            f.close()
        except OSError:
            pass
