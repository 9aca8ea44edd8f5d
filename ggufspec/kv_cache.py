"""Which V cache type goes with the default q8_0 K cache on CPU: the one this machine attends faster with,
measured once on a one-layer model written for it, and remembered per machine.

With a q8_0 K cache llama.cpp's CPU flash attention decodes every row with one kernel, whatever the batch size, so
verify batches give plain decoding's logits bit for bit with a q8_0 or an f16 V cache alike; which one is faster
depends on the CPU (docs/exactness.md has the figures).

Contract: `resolve` is the one step that chooses, at load time (DecoderOptions.resolved, which LlamaCppDecoder and
SpeculativeEngine.load call before sizing the cache for the memory check); DecoderOptions' cache_type_v only reads
what it chose. Choosing may do I/O: read machine_cache.kv_cache_path(), else write a GGUF file, open two llama.cpp
contexts, time them and write the choice there. One process keeps its first choice per cache file.

This module imports nothing from decoder (decoder imports it): the probe's decoders are opened through the
`open_decoder` the caller passes (LlamaCppDecoder).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeVar

import gguf
import numpy as np

from .errors import GGUFSpecError
from .machine_cache import kv_cache_path, machine, read_entry, write_table

K_TYPE = "q8_0"
V_TYPES = ("q8_0", "f16")  # in order of preference: q8_0 takes half the memory
# f16 V is chosen only when it attends in less than this share of q8_0 V's time: it takes 1.9x the memory
F16_WINS = 0.9

_CELLS = 512  # cached tokens the timing attends to: enough to be dominated by attention on a one-layer model
_HEADS, _KV_HEADS, _HEAD_DIM = 32, 8, 64  # a common geometry: what differs between the V types is a cost per value read


class Probe(Protocol):
    """What measure() needs of a decoder (LlamaCppDecoder has it)."""

    def feed(self, tokens: Sequence[int], all_logits: bool = True) -> object: ...
    def rollback_to(self, n: int) -> None: ...
    def close(self) -> None: ...


class Options(Protocol):
    """What resolve() needs of the options (DecoderOptions has it): a dataclass, built with keywords."""

    needs_v_choice: bool  # the V cache type is this machine's default and not chosen yet
    cpu_v_type: str | None  # where the choice goes


O = TypeVar("O", bound=Options)
# a decoder of the GGUF file at the path, q8_0 K and the given V cache type (and the probe's context size)
OpenProbe = Callable[[Path, str], Probe]


def cache_path() -> Path:
    """The choices' table: machine_cache.kv_cache_path()."""
    return kv_cache_path()


# per cache file, the choice this process made: the two V types give different texts, so one process keeps one
_chosen: dict[Path, str] = {}


def resolve(options: O, open_decoder: Callable[[Path, O], Probe], threads: int) -> O:
    """`options` with cpu_v_type set to this machine's choice where it needs one (options.needs_v_choice), else
    `options` itself.

    Choosing may measure (see choose): the probe's decoders are `open_decoder(path, opts)` with opts made like
    `options` from keywords, llama.cpp's defaults but for a q8_0 K, the V type timed, the probe's context and no
    memory check. `threads`: the thread count a default decoder runs with (decoder.default_threads), part of the
    choice's key."""
    if not options.needs_v_choice:
        return options

    def open_probe(path: Path, v_type: str) -> Probe:
        return open_decoder(path, type(options)(n_ctx=_CELLS + 64, kv_type=K_TYPE, kv_type_v=v_type,
                                                memory_check=False))

    return replace(options, cpu_v_type=choose(open_probe, threads))


def default_v_type() -> str:
    """The V type this process chose (through resolve) to pair with q8_0 K on CPU, for the current cache file; no I/O.
    LookupError when it has chosen none yet."""
    path = cache_path()
    if path not in _chosen:
        raise LookupError(f"no V cache type chosen for {path} yet: kv_cache.resolve (DecoderOptions.resolved) "
                          "chooses it")
    return _chosen[path]


def choose(open_probe: OpenProbe, threads: int) -> str:
    """The V cache type to pair with a q8_0 K cache on CPU: this process's earlier choice, else the one remembered in
    cache_path() for this machine and thread count, else measured now (and remembered unless the probe could not run:
    then q8_0, the smaller cache, and measured again by the next process)."""
    path = cache_path()
    if path not in _chosen:
        _chosen[path] = _read_or_measure(path, open_probe, threads)
    return _chosen[path]


def forget_choice() -> None:
    """Drop this process's choice for the current cache file (cache_path()), so that the next resolve reads that file
    again (and measures where it holds no valid choice), as a new process would; no I/O. For a process whose cache
    file changed under it (a test editing the table)."""
    _chosen.pop(cache_path(), None)


def choice_key(threads: int) -> str:
    """The key under which cache_path()'s table holds this machine's choice for a default decoder of `threads`
    threads: the JSON of [machine_cache.machine(), threads, the tokens the probe attends to]."""
    return json.dumps([machine(), threads, _CELLS])


def _read_or_measure(path: Path, open_probe: OpenProbe, threads: int) -> str:
    key = choice_key(threads)
    choice = read_entry(path, key, check_v_type)
    if choice is not None:
        return choice
    try:
        times = measure(open_probe)
    except GGUFSpecError:
        return "q8_0"  # llama.cpp could not build the probe's contexts here: keep the smaller cache, measure next run
    choice = "f16" if times["f16"] < F16_WINS * times["q8_0"] else "q8_0"
    write_table(path, {key: choice})
    return choice


def check_v_type(value: object) -> str | None:
    """What is wrong with a cached choice, or None when it is one of V_TYPES."""
    return None if value in V_TYPES else f"expected one of {', '.join(V_TYPES)}"


def measure(open_probe: OpenProbe, repeats: int = 7) -> dict[str, float]:
    """Median seconds of one decode after _CELLS tokens, per V type (K q8_0), the types timed in turn, on a
    one-layer model written to a temporary folder (removed after). GGUFSpecError when a context cannot be made."""
    with tempfile.TemporaryDirectory(prefix="ggufspec-kv-") as tmp:
        path = write_attention_model(Path(tmp) / "attention.gguf")
        decoders: list[Probe] = []
        try:
            for v in V_TYPES:
                decoders.append(open_probe(path, v))
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
