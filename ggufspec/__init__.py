"""ggufspec: speculative decoding for GGUF models on llama.cpp, exact to the target's own output."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# numpy's OpenBLAS keeps its worker threads spinning ~0.1 s after every product (2**28 cycles by default),
# on the cores llama.cpp's threads need next: with 2 threads each on 2 cores, a decode right after Medusa's
# heads took ~100 ms instead of ~10. OpenBLAS reads this when it loads: it applies if numpy comes after us.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def _start_llama_cpp() -> None:
    """Load llama.cpp and start its backends before anything else loads native code. With a CUDA 13 build on an
    H200 (docs/benchmarks.md, "On a GPU"), every model load crashed (SIGSEGV in llama_model_load_from_file) in a
    process that had imported gguf, sentencepiece or torch first, ggufspec's command line included; with llama.cpp
    loaded and its devices enumerated first, the same loads ran. Cheap on a CPU build (no GPU to start)."""
    try:
        from .ggml_api import devices
    except (ImportError, OSError):  # a broken llama-cpp-python: the commands that need it say so (`ggufspec doctor`)
        return
    devices()


_start_llama_cpp()

# The engine's modules load on first use (a script that only needs ggufspec.errors does not load them).
_EXPORTS = {
    "Decoder": "decoder", "DecoderOptions": "decoder", "LlamaCppDecoder": "decoder",
    "GenerationResult": "engine", "GenerationSettings": "engine", "SpeculativeEngine": "engine",
    "GGUFSpecError": "errors", "SamplingParams": "sampling", "Stats": "stats",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .decoder import Decoder, DecoderOptions, LlamaCppDecoder
    from .engine import GenerationResult, GenerationSettings, SpeculativeEngine
    from .errors import GGUFSpecError
    from .sampling import SamplingParams
    from .stats import Stats


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'ggufspec' has no attribute {name!r}")
