"""ggufspec: speculative decoding for GGUF models on llama.cpp, exact to the target's own output."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# numpy's OpenBLAS keeps its worker threads spinning ~0.1 s after every product (2**28 cycles by default),
# on the cores llama.cpp's threads need next: with 2 threads each on 2 cores, a decode right after Medusa's
# heads took ~100 ms instead of ~10. OpenBLAS reads this when it loads: it applies if numpy comes after us.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# Loaded on first use, so `ggufspec --help` does not pay for importing llama.cpp.
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
