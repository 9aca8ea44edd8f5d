"""RAM needed for weights plus KV cache, checked against what the machine has before loading."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import GGUFSpecError
from .gguf_check import GGUFHeader

GiB = 1 << 30


def kv_bytes_per_token(header: GGUFHeader, kv_type: str = "f16", kv_type_v: str | None = None) -> int:
    """K and V of one token over all layers, stored as `kv_type` (V as `kv_type_v` if given), from the GGUF's
    hyperparameters (0 if unknown)."""
    meta = header.metadata
    arch = meta.get("general.architecture")

    def hp(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        return v if isinstance(v, int) and v > 0 else 0

    n_layer, n_embd, n_head = hp("block_count"), hp("embedding_length"), hp("attention.head_count")
    n_kv = hp("attention.head_count_kv") or n_head
    k_dim = hp("attention.key_length") or (n_embd // n_head if n_head else 0)
    v_dim = hp("attention.value_length") or k_dim
    return int(n_layer * n_kv * (k_dim * bytes_per_value(kv_type) + v_dim * bytes_per_value(kv_type_v or kv_type)))


def bytes_per_value(kv_type: str) -> float:
    """Storage of one K or V value in a cache of this type (q8_0: 34 bytes a block of 32)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kv_type.upper()]]
    return size / block


def needed_bytes(header: GGUFHeader, n_ctx: int, kv_type: str = "f16", kv_type_v: str | None = None) -> int:
    return sum(t.n_bytes for t in header.tensors) + kv_bytes_per_token(header, kv_type, kv_type_v) * n_ctx


def available_bytes() -> int | None:
    """MemAvailable on Linux, physical memory elsewhere; None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(models: list[tuple[Path, GGUFHeader]], n_ctx: int, kv_type: str = "f16", kv_type_v: str | None = None,
                 extra: Sequence[tuple[str, int]] = ()) -> None:
    """Refuse, with the numbers, when weights plus KV of all `models`, plus `extra` allocations (what, bytes),
    exceed the available RAM."""
    have = available_bytes()
    if have is None:
        return
    parts = [(p, needed_bytes(h, n_ctx, kv_type, kv_type_v), kv_bytes_per_token(h, kv_type, kv_type_v) * n_ctx)
             for p, h in models]
    need = sum(n for _, n, _ in parts) + sum(n for _, n in extra)
    if need > have:
        detail = "; ".join([f"{p.name}: {n / GiB:.2f} GiB (KV {kv / GiB:.2f} GiB)" for p, n, kv in parts]
                           + [f"{what}: {n / GiB:.2f} GiB" for what, n in extra])
        raise GGUFSpecError(
            f"not enough memory: weights plus KV cache at n_ctx={n_ctx} need {need / GiB:.2f} GiB ({detail}), "
            f"{have / GiB:.2f} GiB is available. Use a smaller --n-ctx or smaller quantizations, "
            "or pass --no-memory-check to try anyway."
        )
