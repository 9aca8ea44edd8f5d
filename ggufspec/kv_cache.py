"""Which V cache type goes with the default q8_0 K cache on CPU: the one this machine attends faster with,
measured once on a one-layer model written for it, and remembered per machine.

With a q8_0 K cache llama.cpp's CPU flash attention decodes every row with one kernel, whatever the batch size, so
verify batches give plain decoding's logits bit for bit with a q8_0 or an f16 V cache alike (docs/exactness.md).
Which is faster depends on the CPU: after 1,500 tokens of context a Zen 4 decoded the bench target in 115 ms a
token with q8_0 V and 78 ms with f16 V (it turns each q8_0 V row back into floats for every head that reads it).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from .errors import GGUFSpecError

K_TYPE = "q8_0"
V_TYPES = ("q8_0", "f16")  # in order of preference: q8_0 takes half the memory
F16_WINS = 0.9  # f16 V is chosen only when it attends in less than this share of q8_0 V's time

_CELLS = 512  # cached tokens the timing attends to: enough to be dominated by attention on a one-layer model
_HEADS, _KV_HEADS, _HEAD_DIM = 32, 8, 64  # a common geometry: what differs between the V types is a cost per value read


def cache_path() -> Path:
    from .costs import costs_path
    return costs_path().with_name("kv_cache.json")


# per cache file, the choice this process made: the two V types give different texts, so one process keeps one
_chosen: dict[Path, str] = {}


def default_v_type() -> str:
    """The V cache type to pair with a q8_0 K cache on CPU: measured on first use on this machine, then read back."""
    path = cache_path()
    if path not in _chosen:
        _chosen[path] = _read_or_measure(path)
    return _chosen[path]


def _read_or_measure(path: Path) -> str:
    from .costs import machine, read_entry, write_table
    from .decoder import default_threads

    key = json.dumps([machine(), default_threads(), _CELLS])
    choice = read_entry(path, key, check_v_type)
    if choice is not None:
        return choice
    try:
        times = measure()
    except GGUFSpecError:
        return "q8_0"  # llama.cpp could not build the probe's contexts here: keep the smaller cache, measure next run
    choice = "f16" if times["f16"] < F16_WINS * times["q8_0"] else "q8_0"
    write_table(path, {key: choice})
    return choice


def check_v_type(value: object) -> str | None:
    """What is wrong with a cached choice, or None when it is one of V_TYPES."""
    return None if value in V_TYPES else f"expected one of {', '.join(V_TYPES)}"


def measure(repeats: int = 7) -> dict[str, float]:
    """Median seconds of one decode after _CELLS tokens, per V type (K q8_0), taken in turn; ~0.3 s in all."""
    from .decoder import DecoderOptions, LlamaCppDecoder

    with tempfile.TemporaryDirectory(prefix="ggufspec-kv-") as tmp:
        path = write_attention_model(Path(tmp) / "attention.gguf")
        decoders = [LlamaCppDecoder(path, DecoderOptions(n_ctx=_CELLS + 64, kv_type=K_TYPE, kv_type_v=v,
                                                         memory_check=False)) for v in V_TYPES]
        try:
            times: list[list[float]] = [[] for _ in V_TYPES]
            for d in decoders:
                d.feed([i % 256 for i in range(_CELLS)], all_logits=False)
            for _ in range(repeats):
                for d, out in zip(decoders, times):
                    t0 = time.perf_counter()
                    for i in range(3):
                        d.feed([i], all_logits=False)
                        d.rollback_to(_CELLS)
                    out.append((time.perf_counter() - t0) / 3)
            return {v: statistics.median(t) for v, t in zip(V_TYPES, times)}
        finally:
            for d in decoders:
                d.close()


def write_attention_model(path: Path, n_vocab: int = 256, n_embd: int = 64) -> Path:
    """A one-layer llama GGUF whose cost is nearly all attention: narrow embeddings, wide heads, no tokenizer."""
    rng = np.random.default_rng(0)
    q_dim, kv_dim, ff = _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM, 32
    shapes = {
        "token_embd": (n_vocab, n_embd), "output": (n_vocab, n_embd),
        "blk.0.attn_q": (q_dim, n_embd), "blk.0.attn_k": (kv_dim, n_embd), "blk.0.attn_v": (kv_dim, n_embd),
        "blk.0.attn_output": (n_embd, q_dim),
        "blk.0.ffn_gate": (ff, n_embd), "blk.0.ffn_up": (ff, n_embd), "blk.0.ffn_down": (n_embd, ff),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(_CELLS + 64)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_key_length(_HEAD_DIM)
    writer.add_value_length(_HEAD_DIM)
    writer.add_rope_dimension_count(_HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(n_vocab)
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.normal(0, 0.1, size=shape).astype(np.float32))
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(n_embd, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
