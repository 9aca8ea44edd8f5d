"""`LlamaModel`: one GGUF model as llama.cpp loads it: weights, vocabulary, metadata. A context (decoder.py) runs it."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
import llama_cpp

from . import cpu_backend, llama_log
from .errors import GGUFSpecError, ModelFileError
from .gguf_check import GGUFHeader
from .vocab import Vocab

_LOAD_MODES = {  # (use_mmap, use_mlock)
    (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
    (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
    (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
    (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
}


class LlamaModel:
    """The model at `path` (its header already read and checked), loaded with these placement and memory settings
    (as DecoderOptions holds them); Ctrl-C stops the load. ModelFileError where llama.cpp refuses it."""

    def __init__(self, path: Path, header: GGUFHeader, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 use_mlock: bool = False, repack: bool = True, verbose: bool = False, vocab_only: bool = False,
                 devices: list[int] | None = None, tensor_split: tuple[float, ...] = (),
                 load_mtp: bool = False) -> None:
        """`devices`: the ggml devices (addresses) the offloaded layers go to, in place of all of this build's
        (llama.cpp's default), weighed by `tensor_split`; `vocab_only`: the vocabulary and metadata, no weights;
        `load_mtp`: its MTP layers too (llama.cpp skips them by default)."""
        self.path, self.header = path, header
        llama_log.install(verbose)
        self.cpu_backend = cpu_backend.prepare()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        mparams.load_mode = _LOAD_MODES[use_mmap, use_mlock]
        mparams.use_extra_bufts = repack
        mparams.progress_callback = llama_log.load_progress  # stops the load on Ctrl-C
        mparams.vocab_only = vocab_only
        if load_mtp:
            mparams.load_mtp = True
        if devices:
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated, kept alive
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if tensor_split:
            self._split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*tensor_split)
            mparams.tensor_split = self._split
        log: list[str] = []
        with llama_log.capture(log.append), llama_log.interruptible():
            self.handle = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams) or None
        # e.g. "load_tensors:   CPU_REPACK model buffer size =    95.34 MiB"
        self.weight_buffers: dict[str, float] = {
            m[1]: float(m[2]) for m in re.finditer(r"(\S+) model buffer size =\s*([\d.]+) MiB", "".join(log))
        }
        if not self.handle:
            raise ModelFileError(f"{path}: llama.cpp could not load this model (run with --verbose to see why).")
        try:
            self.vocab = Vocab(self.handle)
            self.n_vocab: int = self.vocab.n_tokens
            self.n_embd: int = llama_cpp.llama_model_n_embd(self.handle)
        except BaseException:
            self.close()
            raise

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when absent."""
        model = self.require()
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def require(self):
        """llama.cpp's model handle; GGUFSpecError once closed."""
        if self.handle is None:
            raise GGUFSpecError("this decoder is closed")
        return self.handle

    def close(self) -> None:
        """Free the weights (after every context made from them); further use raises GGUFSpecError."""
        if self.handle is not None:
            llama_cpp.llama_model_free(self.handle)
            self.handle = None
