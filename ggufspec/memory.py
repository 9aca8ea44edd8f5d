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
    """K and V of one token over the attention layers, stored as `kv_type` (V as `kv_type_v` if given), from the GGUF's
    hyperparameters (0 if unknown). A hybrid model's recurrent layers hold no KV: recurrent_state_bytes."""
    meta = header.metadata
    n_embd, n_head = _hp(meta, "embedding_length"), _hp(meta, "attention.head_count")
    k_dim = _hp(meta, "attention.key_length") or (n_embd // n_head if n_head else 0)
    v_dim = _hp(meta, "attention.value_length") or k_dim
    per_value = k_dim * bytes_per_value(kv_type) + v_dim * bytes_per_value(kv_type_v or kv_type)
    return int(sum(_layer_kv_heads(meta)) * per_value)


def recurrent_state_bytes(header: GGUFHeader, n_rs_seq: int = 0) -> int:
    """One sequence's recurrent state over a hybrid or recurrent model's recurrent layers, float32 as llama.cpp keeps
    it, times 1 + n_rs_seq (its snapshots: recurrent.py), from the GGUF's hyperparameters (as llama.cpp's
    llama_hparams::n_embd_r and n_embd_s size it); 0 for attention models or where unknown."""
    meta = header.metadata
    n_embd = _hp(meta, "embedding_length")
    if _hp(meta, "shortconv.l_cache"):  # LFM2's short convolutions
        per_layer = n_embd * (_hp(meta, "shortconv.l_cache") - 1)
    elif _hp(meta, "wkv.head_size"):  # RWKV
        per_layer = n_embd * (max(_hp(meta, "token_shift_count"), 1) + _hp(meta, "wkv.head_size"))
    else:  # Mamba, Mamba-2, gated delta nets: the convolution's state and the SSM's
        d_conv, d_inner, d_state = _hp(meta, "ssm.conv_kernel"), _hp(meta, "ssm.inner_size"), _hp(meta, "ssm.state_size")
        per_layer = max(d_conv - 1, 0) * (d_inner + 2 * _hp(meta, "ssm.group_count") * d_state) + d_state * d_inner
    kv_heads = _layer_kv_heads(meta)
    recurrent = sum(1 for h in kv_heads if h == 0) if per_layer else 0
    return recurrent * per_layer * 4 * (1 + n_rs_seq)


def _hp(meta: dict, key: str) -> int:
    """An integer hyperparameter of the model's architecture, 0 where absent."""
    v = meta.get(f"{meta.get('general.architecture')}.{key}")
    return v if isinstance(v, int) and v > 0 else 0


def _layer_kv_heads(meta: dict) -> list[int]:
    """KV heads per layer, 0 for a recurrent layer: from a per-layer head_count_kv (LFM2, Nemotron-H, Jamba), a
    full_attention_interval (Qwen3.5, Qwen3-Next: every n-th layer attends), or none at all (Mamba, RWKV)."""
    arch = meta.get("general.architecture")
    n_layer = _hp(meta, "block_count")
    per_layer = meta.get(f"{arch}.attention.head_count_kv")
    if isinstance(per_layer, (list, tuple)):
        return [int(h) for h in per_layer[:n_layer]]
    n_kv = _hp(meta, "attention.head_count_kv") or _hp(meta, "attention.head_count")
    interval = _hp(meta, "full_attention_interval")
    if interval:
        return [n_kv if (i + 1) % interval == 0 else 0 for i in range(n_layer)]
    return [n_kv] * n_layer


def bytes_per_value(kv_type: str) -> float:
    """Storage of one K or V value in a cache of this type (q8_0: 34 bytes a block of 32)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kv_type.upper()]]
    return size / block


def needed_bytes(header: GGUFHeader, n_ctx: int, kv_type: str = "f16", kv_type_v: str | None = None,
                 n_rs_seq: int = 0, sequences: int = 1) -> int:
    """Weights, the KV cache of n_ctx tokens, and `sequences` recurrent states (a hybrid or recurrent model's)."""
    return (sum(t.n_bytes for t in header.tensors) + kv_bytes_per_token(header, kv_type, kv_type_v) * n_ctx
            + recurrent_state_bytes(header, n_rs_seq) * sequences)


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


def snapshots_that_fit(models: list[tuple[Path, GGUFHeader]], n_ctx: int, kv_type: str, kv_type_v: str | None,
                       extra: Sequence[tuple[str, int]], n_rs_seq: int, sequences: int) -> int:
    """The most recurrent-state snapshots, up to n_rs_seq, with which `models` fit the available RAM (check_memory's
    sum); n_rs_seq where the RAM is unknown or nothing would fit anyway (check_memory then says so)."""
    have = available_bytes()
    if have is None:
        return n_rs_seq
    fixed = sum(n for _, n in extra)
    for n in range(n_rs_seq, -1, -1):
        if fixed + sum(needed_bytes(h, n_ctx, kv_type, kv_type_v, n, sequences) for _, h in models) <= have:
            return n
    return n_rs_seq


def check_memory(models: list[tuple[Path, GGUFHeader]], n_ctx: int, kv_type: str = "f16", kv_type_v: str | None = None,
                 extra: Sequence[tuple[str, int]] = (), n_rs_seq: int = 0, sequences: int = 1) -> None:
    """Refuse, with the numbers, when weights plus KV (and recurrent states: `sequences` of them, with n_rs_seq
    snapshots each) of all `models`, plus `extra` allocations (what, bytes), exceed the available RAM."""
    have = available_bytes()
    if have is None:
        return
    parts = [(p, needed_bytes(h, n_ctx, kv_type, kv_type_v, n_rs_seq, sequences),
              kv_bytes_per_token(h, kv_type, kv_type_v) * n_ctx + recurrent_state_bytes(h, n_rs_seq) * sequences)
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
