"""Summary of a GGUF file: architecture, sizes, storage types per tensor group, tokenizer, RAM for weights + KV."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from ggufspec.medusa import heads as medusa
from ggufspec.errors import ModelFileError
from ggufspec.gguf_check import GGUFHeader, read_header
from ggufspec import memory


@dataclass
class GGUFSummary:
    """What `ggufspec inspect` reports about one GGUF file."""

    path: Path
    file_bytes: int
    architecture: str
    name: str
    n_params: int
    weight_bytes: int
    file_type: str
    tensor_groups: dict[str, dict[str, int]]  # group -> storage type -> count
    hparams: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    chat_template: bool = False
    context_length: int | None = None
    medusa: dict[str, Any] | None = None
    header: GGUFHeader | None = field(default=None, repr=False, compare=False)

    @property
    def kv_bytes_per_token(self) -> int | None:
        """An f16 KV cache's bytes a token; None where the header says nothing of the attention."""
        return (memory.kv_bytes_per_token(self.header) or None) if self.header else None

    def kv_bytes(self, n_ctx: int, kv_type: str = "f16", kv_type_v: str | None = None) -> int:
        """A KV cache of n_ctx tokens stored as kv_type (V as kv_type_v if given), as the memory check counts it."""
        return memory.kv_bytes_per_token(self.header, kv_type, kv_type_v) * n_ctx if self.header else 0

    def ram_bytes(self, n_ctx: int, kv_type: str = "f16") -> int:
        """Weights plus a KV cache of n_ctx tokens."""
        return self.weight_bytes + self.kv_bytes(n_ctx, kv_type)


def _field(r: GGUFReader, key: str, default: Any = None) -> Any:
    f = r.get_field(key)
    if f is None:
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return None  # arrays are summarised elsewhere
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError):
        return default


def _array_len(r: GGUFReader, key: str) -> int:
    f = r.get_field(key)
    return len(f.data) if f is not None else 0


def _group(name: str) -> str:
    g = re.sub(r"^blk\.\d+\.", "", name)
    g = re.sub(r"^medusa\.\d+\.res\.\d+\.", "medusa.res.", g)
    g = re.sub(r"^medusa\.\d+\.", "medusa.", g)
    return g.removesuffix(".weight")


def inspect_gguf(path: Path) -> GGUFSummary:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    # bounds-checked first, as for generate: on a truncated file gguf-py's reader fails with a numpy reshape error
    # ("cannot reshape array of size ...") that names neither the tensor nor the missing bytes
    header = read_header(path)
    try:
        r = GGUFReader(path)
    except (OSError, ValueError, IndexError) as e:
        raise ModelFileError(f"{path}: not a readable GGUF file ({e})") from e
    arch = str(_field(r, "general.architecture", "?"))
    groups: dict[str, Counter] = defaultdict(Counter)
    for t in r.tensors:
        groups[_group(t.name)][t.tensor_type.name] += 1
    all_types = Counter()
    for c in groups.values():
        all_types.update(c)
    s = GGUFSummary(
        path=path, file_bytes=path.stat().st_size, architecture=arch, name=str(_field(r, "general.name", "")),
        n_params=sum(int(t.n_elements) for t in r.tensors), weight_bytes=sum(int(t.n_bytes) for t in r.tensors),
        file_type=", ".join(f"{k} x{v}" for k, v in all_types.most_common()),
        tensor_groups={g: dict(c) for g, c in sorted(groups.items())},
    )
    if arch == medusa.ARCH:
        s.medusa = {
            "version": _field(r, medusa.KEY_VERSION), "heads": _field(r, medusa.KEY_HEAD_COUNT),
            "layers per head": _field(r, medusa.KEY_LAYER_COUNT), "hidden size": _field(r, medusa.KEY_HIDDEN_SIZE),
            "vocab size": _field(r, medusa.KEY_VOCAB_SIZE), "base model": _field(r, medusa.KEY_BASE_MODEL, ""),
        }
        return s
    s.hparams = _hparams(r, arch)
    s.context_length = _field(r, f"{arch}.context_length")
    s.header = header
    s.tokenizer = _tokenizer(r) or {}
    s.chat_template = r.get_field("tokenizer.chat_template") is not None
    return s


def _hparams(r: GGUFReader, arch: str) -> dict[str, Any]:
    """The architecture's main hyperparameters, as inspect prints them."""

    def hp(key: str) -> Any:
        return _field(r, f"{arch}.{key}")

    n_layer, n_embd, n_head = hp("block_count"), hp("embedding_length"), hp("attention.head_count")
    n_kv = hp("attention.head_count_kv") or n_head
    head_dim = hp("attention.key_length") or (n_embd // n_head if n_embd and n_head else None)
    rope_freqs = any(t.name == "rope_freqs.weight" for t in r.tensors)
    return {
        "layers": n_layer, "embedding": n_embd, "feed forward": hp("feed_forward_length"), "heads": n_head,
        "kv heads": n_kv, "head dim": head_dim, "rope base": hp("rope.freq_base"),
        "rope scaling": hp("rope.scaling.type") or ("llama3 (rope_freqs)" if rope_freqs else None),
    }


def _tokenizer(r: GGUFReader) -> dict[str, Any] | None:
    """The tokenizer's model, size and special tokens (None: the file has no vocabulary)."""
    n_tokens = _array_len(r, "tokenizer.ggml.tokens")
    if not n_tokens:
        return None
    tok = r.get_field("tokenizer.ggml.tokens")

    def text(i: Any) -> str | None:
        if i is None or not 0 <= int(i) < n_tokens:
            return None
        return bytes(tok.parts[tok.data[int(i)]]).decode("utf-8", "replace")

    bos, eos = _field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")
    return {
        "model": _field(r, "tokenizer.ggml.model"), "pre": _field(r, "tokenizer.ggml.pre"), "tokens": n_tokens,
        "merges": _array_len(r, "tokenizer.ggml.merges"),
        "bos": f"{bos} {text(bos)!r}" if bos is not None else None,
        "eos": f"{eos} {text(eos)!r}" if eos is not None else None,
        "add_bos": _field(r, "tokenizer.ggml.add_bos_token"),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_summary(s: GGUFSummary, n_ctx: int | None = None) -> str:
    """Human-readable report; n_ctx defaults to the model's context length (capped at 4096)."""
    lines = [
        f"file:          {s.path} ({_size(s.file_bytes)})",
        f"architecture:  {s.architecture}" + (f"  name: {s.name}" if s.name else ""),
        f"parameters:    {s.n_params:,} ({_size(s.weight_bytes)} of weights)",
        f"storage types: {s.file_type}",
    ]
    if s.medusa is not None:
        lines.append("medusa heads:  " + ", ".join(f"{k} {v}" for k, v in s.medusa.items() if v not in (None, "")))
    else:
        lines.append("hyperparams:   " + ", ".join(f"{k} {v}" for k, v in s.hparams.items() if v is not None))
        lines.append(f"context:       {s.context_length}")
        if s.tokenizer:
            lines.append("tokenizer:     " + ", ".join(f"{k} {v}" for k, v in s.tokenizer.items() if v is not None))
        else:
            lines.append("tokenizer:     none")
        lines.append(f"chat template: {'present' if s.chat_template else 'absent'}")
        if s.kv_bytes_per_token:
            ctx = n_ctx or min(int(s.context_length or 4096), 4096)
            lines.append(f"RAM at n_ctx={ctx}: {_size(s.ram_bytes(ctx, 'q8_0'))} (weights {_size(s.weight_bytes)} + "
                         f"q8_0 KV cache {_size(s.kv_bytes(ctx, 'q8_0'))}, ggufspec's CPU default, or "
                         f"{_size(s.kv_bytes(ctx, 'q8_0', 'f16'))} with f16 V where this CPU reads that faster; "
                         f"f16 as in llama.cpp: {_size(s.kv_bytes(ctx))})")
    lines.append("tensor groups:")
    width = max((len(g) for g in s.tensor_groups), default=0)
    for g, types in s.tensor_groups.items():
        lines.append(f"  {g:<{width}}  " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items())))
    return "\n".join(lines)

