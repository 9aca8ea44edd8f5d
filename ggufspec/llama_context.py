"""`Context`: one llama.cpp context over a model's weights, with its batch: opened from DecoderOptions, one batch
decoded at a time, the rows that batch produced read from llama.cpp's buffers, and its KV sequences edited.

It knows nothing of token histories: a decoder (decoder.py, sequence.py) says which tokens go where. Rule: every use
of a context that slots share holds its `lock` (lockstep.py); each KV edit here takes it, and a caller holds it
around edits that must go together.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType

from . import llama_log, mtp
from .errors import GGUFSpecError
from .kv_types import UNQUANTIZED_KV, kv_label
from .llama_batch import Batch
from .model import LlamaModel
from .recurrent import snapshots_for

if TYPE_CHECKING:
    from .decoder import DecoderOptions

# Batches of more tokens than this (prefills) run with llama_log.abort_check, so that Ctrl-C stops them between
# graph nodes rather than after the whole batch; smaller ones (verification chains and trees, Medusa's of up to 64
# nodes, single tokens) skip the check's call into Python at every node.
ABORTABLE_BATCH = 64


def default_threads() -> int:
    """GGUFSPEC_THREADS when set, else every core this process may run on."""
    if os.environ.get("GGUFSPEC_THREADS", "").isdigit() and int(os.environ["GGUFSPEC_THREADS"]) > 0:
        return int(os.environ["GGUFSPEC_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def context_params(opts: DecoderOptions, recurrent: bool) -> llama_cpp.llama_context_params:
    """llama.cpp's context parameters for `opts` (resolved: their cache types are read), on recurrent memory or not."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = opts.n_ctx
    cparams.n_batch = opts.n_batch
    cparams.n_ubatch = opts.micro_batch_on(recurrent)
    cparams.n_seq_max = opts.n_seq_max
    cparams.n_threads = opts.n_threads or default_threads()
    cparams.n_threads_batch = opts.n_threads_batch or cparams.n_threads
    cparams.embeddings = opts.embeddings
    if opts.embeddings:
        cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
    cparams.kv_unified = opts.n_seq_max > 1 if opts.kv_unified is None else opts.kv_unified
    if opts.flash_attn is not None:
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if opts.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
    cparams.no_perf = True
    if recurrent:
        cparams.n_rs_seq = snapshots_for(opts.n_rs_seq, opts.micro_batch_on(recurrent))
    cparams.type_k = int(GGMLQuantizationType[opts.cache_type.upper()])
    cparams.type_v = int(GGMLQuantizationType[opts.cache_type_v.upper()])
    return cparams


class Context:
    """The llama.cpp context of `model` for `opts` (resolved), on recurrent memory or not, and its batch of n_batch
    tokens in up to n_seq_max sequences each. GGUFSpecError, naming `path`, where llama.cpp cannot create it; the
    default cache types fall back to f16 where llama.cpp cannot build them (kv_type, kv_type_v: the types in use).

    `ctx` is None once closed. Rows read here are views of llama.cpp's buffers (for reading only), valid until the next
    decode."""

    def __init__(self, model: LlamaModel, opts: DecoderOptions, recurrent: bool, path: Path) -> None:
        self.ctx = self.batch = None
        self.recurrent, self.embeddings = recurrent, opts.embeddings
        self.n_vocab, self.n_embd = model.n_vocab, model.n_embd
        # held around every use: a shared context's is its Lockstep's lock (LlamaCppDecoder.slots sets it)
        self.lock: AbstractContextManager = nullcontext()
        self._hidden_on = opts.embeddings
        self._abort_on = False  # llama_log.abort_check installed: see ABORTABLE_BATCH
        self._views: dict[tuple[int, int, int], np.ndarray] = {}  # see buffer_rows
        try:
            self._create(model, opts, path)
            # llama.cpp may round the context up; the limit the user asked for is the one we keep.
            self.n_ctx: int = min(opts.n_ctx, llama_cpp.llama_n_ctx(self.ctx))
            self.n_ubatch: int = llama_cpp.llama_n_ubatch(self.ctx)
            self.mem = llama_cpp.llama_get_memory(self.ctx)
            self.batch = Batch(max(opts.n_batch, 1), opts.n_seq_max)
            # what llama.cpp gave: it sets n_rs_seq back to 0 for architectures without snapshots
            self.n_rs_seq: int = llama_cpp.llama_n_rs_seq(self.ctx) if recurrent else 0
            self.nextn_width: int | None = None  # with opts.mtp: the width of the rows its MTP head reads (mtp.py)
            if opts.mtp:
                mtp.record_hidden(self.ctx)
                self.nextn_width = llama_cpp.llama_model_n_embd_out(model.handle)
        except BaseException:
            self.close()
            raise

    def _create(self, model: LlamaModel, opts: DecoderOptions, path: Path) -> None:
        cparams = context_params(opts, self.recurrent)
        self.kv_type, self.kv_type_v = opts.cache_type, opts.cache_type_v
        with llama_log.interruptible():
            self.ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
        kv_cache = kv_label(self.kv_type, self.kv_type_v)
        if not self.ctx and opts.kv_type is opts.kv_type_k is opts.kv_type_v is None and kv_cache != "f16":
            # the default q8_0 needs flash attention, which llama.cpp's "auto" may have turned down, and
            # head sizes that are multiples of its 32-value blocks
            self.kv_type = self.kv_type_v = kv_cache = "f16"
            cparams.type_k = cparams.type_v = int(GGMLQuantizationType.F16)
            self.ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
        if not self.ctx:
            quantized = {self.kv_type, self.kv_type_v} - set(UNQUANTIZED_KV)
            why = (f"a {kv_cache} KV cache needs flash attention and head sizes its blocks divide: "
                   "try --kv-type f16; or not enough memory" if quantized else
                   "not enough memory? try a smaller --n-ctx")
            raise GGUFSpecError(
                f"{path}: llama.cpp could not create a context with n_ctx={opts.n_ctx} "
                f"({why}; --verbose shows llama.cpp's reason)."
            )

    # --- decoding -------------------------------------------------------------------------

    def run(self, n_tokens: int, hidden: bool, may_abort: bool) -> int:
        """llama_decode of the filled batch of n_tokens; its return code (2: Ctrl-C aborted it, with `may_abort`).
        Until the caller records the tokens, the cache may hold cells its history does not. hidden=False: no hidden
        states (llama.cpp outputs logits and states of every token of a batch while embeddings are on: a prefill
        would compute and copy the whole vocabulary's logits for every prompt token). `may_abort`: a batch of more
        than ABORTABLE_BATCH tokens runs with llama_log.abort_check (not one that other slots' steps share)."""
        abortable = may_abort and n_tokens > ABORTABLE_BATCH
        if self._hidden_on != (hidden and self.embeddings):
            self._hidden_on = not self._hidden_on
            llama_cpp.llama_set_embeddings(self.ctx, self._hidden_on)
        if self._abort_on != abortable:
            self._abort_on = abortable
            check = llama_log.abort_check if abortable else llama_log.NO_ABORT_CHECK
            llama_cpp.llama_set_abort_callback(self.ctx, check, None)
        if abortable:
            with llama_log.interruptible():  # rc 2 when Ctrl-C aborted it
                rc = llama_cpp.llama_decode(self.ctx, self.batch.struct)
        else:
            rc = llama_cpp.llama_decode(self.ctx, self.batch.struct)
        if rc == 0:  # an asynchronous backend (RPC, CUDA) returns before it computed: its time is the pass's
            llama_cpp.llama_synchronize(self.ctx)
        return rc

    def logits(self, n_rows: int) -> np.ndarray:
        """The logits of the last decode's first n_rows outputs, (n_rows, n_vocab)."""
        return buffer_rows(self._views, llama_cpp.llama_get_logits(self.ctx), n_rows, self.n_vocab)

    def states(self, n_rows: int) -> np.ndarray:
        """The hidden states of the last decode's first n_rows outputs, (n_rows, n_embd) (embeddings on)."""
        return buffer_rows(self._views, llama_cpp.llama_get_embeddings(self.ctx), n_rows, self.n_embd)

    def nextn(self, n: int) -> np.ndarray:
        """The hidden rows of the last decode's n tokens, in batch order, for an MTP head (opts.mtp)."""
        return mtp.hidden_rows(self.ctx, n, self.nextn_width)

    # --- KV sequences (each under the lock) --------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Remove sequence seq's cells at positions p0..p1-1 (-1: all; seq -1: every sequence); False where the
        memory cannot remove them partially."""
        with self.lock:
            return llama_cpp.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def drop(self, seqs: Iterable[int]) -> None:
        """Remove every cell of each of `seqs`."""
        with self.lock:
            for s in seqs:
                llama_cpp.llama_memory_seq_rm(self.mem, s, -1, -1)

    def seq_cp(self, src: int, dst: int) -> None:
        """Put sequence src's cells in sequence dst too."""
        with self.lock:
            llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def seq_keep(self, seq: int) -> None:
        """Remove every cell not in sequence seq (one pass over the cache)."""
        with self.lock:
            llama_cpp.llama_memory_seq_keep(self.mem, seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move sequence seq's cells at positions p0..p1-1 (-1: to the end) by delta positions."""
        with self.lock:
            llama_cpp.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def positions(self, seq: int) -> tuple[int, int]:
        """Lowest and highest position sequence seq holds, (-1, -1) when none."""
        with self.lock:
            return llama_cpp.llama_memory_seq_pos_min(self.mem, seq), llama_cpp.llama_memory_seq_pos_max(self.mem, seq)

    def pos_max(self, seq: int) -> int:
        """Highest position sequence seq holds, -1 when none."""
        with self.lock:
            return llama_cpp.llama_memory_seq_pos_max(self.mem, seq)

    def can_shift(self) -> bool:
        """Whether the memory can move positions (seq_add)."""
        return llama_cpp.llama_memory_can_shift(self.mem)

    def clear(self) -> None:
        """Remove every cell of every sequence."""
        with self.lock:
            llama_cpp.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        """Free the batch and the context (the model stays); ctx is None then."""
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.ctx is not None:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


def opened(context: Context | None) -> Context:
    """`context` while open; GGUFSpecError where its decoder closed it (None) or its owner freed it."""
    if context is None or context.ctx is None:
        raise GGUFSpecError("this decoder is closed")
    return context


def buffer_rows(views: dict[tuple[int, int, int], np.ndarray], ptr, n_rows: int, width: int) -> np.ndarray:
    """The first n_rows rows (of `width` floats) of llama.cpp's output buffer at `ptr`, as a view (for reading only)
    kept in `views` per address and shape: np.ctypeslib.as_array cost 30 us a call (docs/engine-overhead.md). The
    buffer at that address holds at least the rows the last decode wrote."""
    if not ptr:
        raise GGUFSpecError("llama.cpp returned no outputs for this batch")
    key = (ctypes.addressof(ptr.contents), n_rows, width)
    rows = views.get(key)
    if rows is None:
        if len(views) > 64:
            views.clear()
        # llama.cpp's buffer, for readers only, yet not flagged read-only: numpy's argmax takes 2.5 times as long on a
        # read-only array (another loop), and a greedy step's pick is one
        rows = views[key] = np.ctypeslib.as_array(ptr, shape=(n_rows, width))
    return rows
