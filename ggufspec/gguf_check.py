"""Checks a GGUF file before llama.cpp opens it, so damaged files raise instead of crashing.

gguf-py's GGUFReader decodes every vocabulary string (~5 s for a 49k vocabulary), too slow
for every load; this walks the same layout with bounds checks and skips what it need not read.
Type sizes come from gguf-py's tables.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4

# GGUFValueType -> struct format of a scalar; STRING (8) and ARRAY (9) are variable length.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRUCTS = {fmt: struct.Struct("<" + fmt) for fmt in _SCALARS.values()}
_STRING, _ARRAY = 8, 9
# Numeric arrays of at most this many values are read as tuples (per-layer hyperparameters: llama.cpp's
# LLAMA_MAX_LAYERS); longer ones (a vocabulary's scores, types), and arrays of strings, as their length.
SHORT_ARRAY = 512

# Hyperparameters llama.cpp asserts on (aborting the process) when out of range, or multiplies into tensor
# shapes where a huge value wraps around to a size that matches: "{arch}.KEY" -> (min, max or another key).
_HPARAM_LIMITS: dict[str, tuple[int, int | str]] = {
    "block_count": (1, 512),  # LLAMA_MAX_LAYERS
    "expert_count": (0, 1024),  # LLAMA_MAX_EXPERTS
    "attention.head_count": (1, "embedding_length"),
    "attention.head_count_kv": (1, "attention.head_count"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, object]  # scalars and strings; arrays as their length (read only: see headers_kept)
    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int
    # a digest of the token texts as stored (tokenizer.ggml.tokens, its count included; empty without one): files
    # whose digests are equal have the same vocabulary, text for text (pairing.check_pair reads this first)
    tokens_digest: bytes = b""


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: truncated or damaged GGUF header (needs {n:,} bytes at offset {self.pos:,}, "
                f"the file has {len(self.buf):,}). Download or convert it again."
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        unpack = _STRUCTS[fmt]
        return unpack.unpack(self.take(unpack.size))[0]

    def string(self) -> bytes:
        return self.take(self.scalar("Q"))

    def value(self, vtype: int, depth: int = 0, unique: bool = False):
        """One value; `unique`: an array of strings must not repeat one (llama.cpp aborts on a duplicate token)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype == _ARRAY and depth == 0:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS and count <= SHORT_ARRAY:  # per-layer hyperparameters: their values
                return struct.unpack(f"<{count}{_SCALARS[item]}", self.take(count * _STRUCTS[_SCALARS[item]].size))
            if item in _SCALARS:
                self.take(count * _STRUCTS[_SCALARS[item]].size)
            elif item == _STRING:
                self.strings(count, unique)
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
            return count
        raise ModelFileError(f"{self.path}: damaged GGUF header (unknown value type {vtype} at offset {self.pos:,}).")

    def strings(self, count: int, unique: bool) -> None:
        """Skip an array of `count` strings; `unique`: none may repeat. (take's checks, inlined: a vocabulary's
        tokens and merges are ~100k strings, and a call per string made this most of a small model's load.)"""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        length = _STRUCTS["Q"].unpack_from
        seen: set[bytes] = set()
        for _ in range(count):
            n = length(buf, pos)[0] if pos + 8 <= size else size
            if pos + 8 + n > size:
                self.pos = pos
                self.string()  # past the end: raises take's error
            pos += 8 + n
            if unique:
                s = buf[pos - n : pos]
                if s in seen:
                    raise ModelFileError(f"{self.path}: damaged vocabulary: token {s[:40]!r} is listed twice. "
                                         "Download or convert the model again.")
                seen.add(s)
        self.pos = pos


_kept = threading.local()  # headers_kept's, per thread


@contextmanager
def headers_kept() -> Iterator[None]:
    """Within, read_header on this thread parses each file once and returns the same header after (a load reads its
    files' headers at several steps: each parse walks the whole vocabulary). Files are told apart by device, inode,
    size and modification time, and kept only while inside: outside, a file rewritten in place within the clock's
    tick, or a new one on a freed inode, could look unchanged."""
    outer = getattr(_kept, "headers", None)
    if outer is None:
        _kept.headers = {}
    try:
        yield
    finally:
        if outer is None:
            _kept.headers = None


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and bounds-check a GGUF header and tensor table; raise ModelFileError on any problem."""
    p = Path(path).expanduser()
    kept = getattr(_kept, "headers", None)
    with _open(p) as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if kept is not None and key in kept:
            return kept[key]
        header = _parse(f, p, st.st_size)
    if kept is not None:
        kept[key] = header
    return header


def _parse(f, p: Path, size: int) -> GGUFHeader:
    """read_header's, of the open file `f` of `size` bytes."""
    if size < 24:
        raise ModelFileError(f"{p}: {size} bytes is too small for a GGUF file.")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        c = _Cursor(buf, p)
        version, n_tensors, n_kv = _preamble(c, p, size)
        metadata, arrays, tokens_digest = _metadata(c, n_kv)
        infos = [_tensor_info(c, p) for _ in range(n_tensors)]
        _check_hparams(metadata, arrays, p)
        align = metadata.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelFileError(f"{p}: invalid general.alignment {align!r}.")
        data_start = -(-c.pos // align) * align
    finally:
        buf.close()
    for t in infos:
        end = data_start + t.offset + t.n_bytes
        if end > size:
            raise ModelFileError(
                f"{p}: truncated: tensor {t.name!r} needs bytes up to {end:,} but the file has {size:,} "
                f"({end - size:,} bytes missing). Download or convert it again."
            )
    return GGUFHeader(version, metadata, tuple(infos), data_start, size, tokens_digest)


def _open(p: Path):
    """The file, opened for reading; ModelFileError where it is missing, a folder or unreadable."""
    if not p.exists():
        raise ModelFileError(f"{p}: no such file. Check the path, or run `ggufspec pull` to download a model.")
    if p.is_dir():
        raise ModelFileError(f"{p}: is a folder, not a .gguf file.")
    try:
        return open(p, "rb")
    except OSError as e:
        raise ModelFileError(f"{p}: cannot be read ({e.strerror}). Check its permissions.") from None


def _preamble(c: _Cursor, p: Path, size: int) -> tuple[int, int, int]:
    """The magic, the version, and the tensor and key counts (each bounded by what the file's size can hold)."""
    if c.take(4) != GGUF_MAGIC:
        raise ModelFileError(
            f"{p}: not a GGUF file (it does not start with b'GGUF'). "
            "Convert Hugging Face checkpoints with `ggufspec convert hf`."
        )
    version = c.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{p}: GGUF version {version} is not supported (expected 2 or 3).")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    if n_tensors > size // 24 or n_kv > size // 12:  # each entry takes at least that many bytes
        raise ModelFileError(
            f"{p}: truncated or damaged GGUF header ({n_tensors:,} tensors and {n_kv:,} keys "
            f"cannot fit in {size:,} bytes). Download or convert it again."
        )
    return version, n_tensors, n_kv


def _metadata(c: _Cursor, n_kv: int) -> tuple[dict[str, object], set[str], bytes]:
    """The n_kv keys and their values, which of them are arrays, and GGUFHeader.tokens_digest."""
    metadata: dict[str, object] = {}
    arrays: set[str] = set()
    digest = b""
    for _ in range(n_kv):
        key = c.string().decode("utf-8", errors="replace")
        vtype = c.scalar("I")
        if vtype == _ARRAY:
            arrays.add(key)
        start, tokens = c.pos, key == "tokenizer.ggml.tokens"
        metadata[key] = c.value(vtype, unique=tokens)
        if tokens:
            digest = hashlib.blake2b(c.buf[start : c.pos], digest_size=16).digest()
    return metadata, arrays, digest


def _tensor_info(c: _Cursor, p: Path) -> TensorInfo:
    """One entry of the tensor table, its shape and type checked."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = c.string().decode("utf-8", errors="replace")
    n_dims = c.scalar("I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelFileError(f"{p}: tensor {name!r} has {n_dims} dimensions.")
    shape = tuple(c.scalar("Q") for _ in range(n_dims))
    ttype, offset = c.scalar("I"), c.scalar("Q")
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{p}: tensor {name!r} has unknown type {ttype}.") from None
    n = 1
    for d in shape:
        n *= d
    if n == 0 or shape[0] % block:
        raise ModelFileError(f"{p}: tensor {name!r} has an invalid shape {shape} for its type.")
    return TensorInfo(name, shape, ttype, offset, n // block * type_size)


def _check_hparams(metadata: dict[str, object], arrays: set[str], p: Path) -> None:
    """The hyperparameters llama.cpp asserts on within their bounds (_HPARAM_LIMITS)."""
    arch = metadata.get("general.architecture")
    for key, (lo, hi) in _HPARAM_LIMITS.items():
        name = f"{arch}.{key}"
        value = metadata.get(name)
        top = metadata.get(f"{arch}.{hi}") if isinstance(hi, str) else hi
        if name in arrays or not isinstance(value, int) or not isinstance(top, int) or f"{arch}.{hi}" in arrays:
            continue  # absent, per layer, or bounded by a key that is not a plain number
        if not lo <= value <= top:
            raise ModelFileError(f"{p}: damaged metadata: {name} is {value}, outside {lo}..{top}.")
