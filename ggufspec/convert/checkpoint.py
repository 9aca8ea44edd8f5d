"""Lazy read access to checkpoint tensors (safetensors, sharded or not; torch .bin/.pt when torch is installed)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ggufspec.errors import ConversionError, ModelFileError

# safetensors dtype name -> (numpy dtype used to view the bytes, bytes per element)
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: viewed as raw bits, widened by bf16_to_f32
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

_MAX_HEADER = 100 * 1024 * 1024


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values stored as uint16 bits to float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives; `load()` returns it as a float32 (or integer) numpy array."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors-style name: F32, F16, BF16, ...
    file: Path
    _load: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        itemsize = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(self.dtype, 1)
        return size * itemsize

    def load(self) -> np.ndarray:
        arr = self._load()
        if arr.dtype.kind == "f" and arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        return arr


class SafetensorsFile:
    """One .safetensors file, header parsed and validated, data memory-mapped (nothing read until used)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ModelFileError(f"{self.path}: not a safetensors file (shorter than 8 bytes); re-download it")
                (n,) = struct.unpack("<Q", head)
                if n == 0 or n > _MAX_HEADER or 8 + n > size:
                    raise ModelFileError(
                        f"{self.path}: corrupt safetensors header (declared header length {n} bytes, file is {size} bytes); "
                        "the file is truncated or not safetensors: re-download it"
                    )
                raw = f.read(n)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read ({e.strerror or e})") from e
        try:
            header = json.loads(raw.decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise ModelFileError(f"{self.path}: corrupt safetensors header ({e}); re-download the file") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_len = size - self._data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ModelFileError(f"{self.path}: corrupt safetensors header entry for tensor {name!r} ({e})") from e
            if dtype not in _ST_DTYPES:
                raise ConversionError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if not (0 <= begin <= end <= data_len) or end - begin != count * _ST_DTYPES[dtype].itemsize:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} has data offsets {begin}..{end} that do not fit its shape {list(shape)} "
                    f"({dtype}) or the file size; the file is truncated or corrupt: re-download it"
                )
            self.entries[name] = (dtype, shape, begin, end)
    def read(self, name: str) -> np.ndarray:
        """The tensor's values (BF16 widened to float32), read into fresh memory.

        Plain reads rather than mmap: mapped pages would stay in the process's resident set until the whole
        checkpoint had been touched, while a read buffer is freed as soon as its tensor is written.
        """
        dtype, shape, begin, end = self.entries[name]
        npdt = _ST_DTYPES[dtype]
        arr = np.empty((end - begin) // npdt.itemsize, dtype=npdt)
        try:
            with open(self.path, "rb") as f:
                f.seek(self._data_start + begin)
                # readinto, not np.fromfile: SIGTERM/SIGHUP's exception (outputs.py), raised while numpy duplicated the
                # file's descriptor, came out of fromfile as a TypeError, and the process exited 1 instead of 128 + n
                got = f.readinto(memoryview(arr).cast("B"))
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read tensor {name!r} ({e.strerror or e})") from e
        if got != end - begin:
            raise ModelFileError(f"{self.path}: tensor {name!r} is truncated; re-download the file")
        arr = arr.reshape(shape)
        return bf16_to_f32(arr) if dtype == "BF16" else arr

    def refs(self) -> Iterator[TensorRef]:
        for name, (dtype, shape, _, _) in self.entries.items():
            yield TensorRef(name, shape, dtype, self.path, lambda n=name: self.read(n))


def _torch_refs(path: Path) -> Iterator[TensorRef]:
    try:
        import torch
    except ImportError as e:
        raise ConversionError(
            f"{path}: reading PyTorch checkpoints needs torch; install it with `pip install 'ggufspec[torch]'` "
            "or convert the file to safetensors first"
        ) from e
    try:
        state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises many types for bad pickles/zips
        raise ModelFileError(f"{path}: cannot load PyTorch checkpoint ({e}); re-download it") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelFileError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        yield TensorRef(
            name, tuple(t.shape), names.get(t.dtype, "I64"), path,
            lambda t=t: t.float().numpy() if t.is_floating_point() else t.numpy(),
        )


def open_tensor_file(path: Path) -> dict[str, TensorRef]:
    """All tensors of one file (.safetensors, or .bin/.pt/.pth through torch), by name."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return {r.name: r for r in SafetensorsFile(path).refs()}
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read ({e.strerror or e})") from e
    if magic == b"GGUF":  # else torch would be asked for it (or said to be missing)
        raise ConversionError(f"{path}: is a GGUF file already; this takes a safetensors or PyTorch checkpoint")
    return {r.name: r for r in _torch_refs(path)}


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of an HF model folder: safetensors preferred, sharded via its index, else pytorch_model*.bin."""
    folder = Path(folder)
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = folder / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelFileError(f"{index}: not a valid shard index ({e})") from e
            files = sorted({folder / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.exists()]
            if missing:
                raise ModelFileError(f"{index} lists shards that are missing: {', '.join(missing)}; download them")
            return files
        if (folder / single).exists():
            return [folder / single]
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not found:
        raise ModelFileError(
            f"{folder}: no weights found (expected model.safetensors, model-*.safetensors with "
            "model.safetensors.index.json, or pytorch_model.bin)"
        )
    return found


def load_checkpoint(folder: Path) -> dict[str, TensorRef]:
    """Every tensor in an HF model folder, by name, without reading any data."""
    refs: dict[str, TensorRef] = {}
    for f in checkpoint_files(folder):
        for name, ref in open_tensor_file(f).items():
            if name in refs:
                raise ModelFileError(f"tensor {name!r} appears in both {refs[name].file} and {f}")
            refs[name] = ref
    return refs


def file_size(paths: list[Path]) -> int:
    return sum(os.path.getsize(p) for p in paths)
