"""`Decoder`: what the verifier and proposers need from a model, and `LlamaCppDecoder`, one llama.cpp context over
a `LlamaModel` (model.py: weights, vocabulary, metadata).

A decoder holds a token history whose KV entries live in the context. Feeding tokens appends
them; rolling back removes KV entries. Every position is decoded once unless rolled back.
"""

from __future__ import annotations

import copy
import ctypes
import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType

from . import kv_cache, llama_log, rpc
from .errors import ContextLengthError, GGUFSpecError
from .gguf_check import read_header
from .history import common_prefix
from .llama_batch import Batch
from .lockstep import Lockstep, LockstepSlot, Price, Submission, even_lanes
from .machine_cache import notice
from .memory import check_memory
from .model import LlamaModel
from .recurrent import Rewind, Rollbacks, memory_kind, snapshots_for
from . import mtp
from .mtp import HiddenRows
from .waiting import waiting


class Decoder(Protocol):
    """A model with a KV history. Logits rows are float32 over the model's vocabulary."""

    history: list[int]
    n_vocab: int
    n_ctx: int
    # clocks, only ever growing: the verifier and the proposers time their own passes with them
    decode_seconds: float
    n_decodes: int
    n_decoded_tokens: int
    n_batched_tokens: int  # tokens of the whole batches those decodes ran in (other slots' too, in a shared context)
    # a slot of a shared context: its last decode's whole batch, tokens per sequence id (lockstep.Submission.lanes),
    # and its own sequence id there; () and 0 on a context of its own
    lanes: tuple[int, ...]
    lane: int
    tick: int  # a slot's last decode's batch number (lockstep.Submission.tick), -1 on a context of its own
    peers: int  # a slot's: the other slots generating in its context now
    n_deferred: int  # the history's last tokens not in the memory yet: the next feed decodes them in front

    def feed(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False) -> np.ndarray:
        """Decode `tokens` after the history in one pass; logits of every position (or the last), (n, V).

        view=True: a read-only view of llama.cpp's buffer, valid only until this decoder's next decode.
        """

    def sync(self, tokens: Sequence[int], view: bool = False) -> np.ndarray:
        """Make the history equal `tokens`, reusing the common prefix; logits after the last, (1, V)."""

    def rollback_to(self, n: int) -> None:
        """Keep the first n history tokens and drop the KV entries of the rest (on recurrent memory, tokens its
        snapshots or checkpoints cannot undo are decoded again, by this call or the next feed: see hold)."""

    def hold(self, undo: int | None = None, anchor: bool = False) -> None:
        """Make a later rollback_to the history as it is now cheap (recurrent memory: a checkpoint of the state where
        its snapshots will not reach; nothing for attention). `undo`: the next feed will be rolled back by at most
        that many of its tokens (a verification chain's drafts); None: any number, over any feeds (a draft model's
        single tokens). `anchor`: the point stays until a rollback goes below it, rather than until the next hold
        (a prompt's end, which a chat's next turn goes back to)."""

    def hidden_states(self) -> np.ndarray:
        """Final-norm hidden states (n, H) of the rows the last feed returned logits for (none after a prefill of
        several tokens for the last logits only: computing them all costs that prefill the whole vocabulary's
        logits for every token)."""

    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Logits (n, V) of tree nodes after the history in one pass; parents[i] < i, -1 for the roots."""

    def commit_tree_path(self, path: Sequence[int]) -> int:
        """After tree_logits: append the nodes of `path` (root to node) to the history, drop the rest; return how
        many of the history's last tokens are deferred (nodes that would break the cache's position order: not in
        the KV cache yet, the next decode carries them in front of its batch)."""


# KV cache types llama.cpp accepts (its --cache-type-k/-v); all but the unquantized need flash attention.
from .kv_types import KV_TYPES, UNQUANTIZED_KV, kv_label  # noqa: E402  (apart, for the command line)
# On CPU a prefill runs about as fast in 64-token micro-batches as in 512-token ones, and their activations take
# less memory (docs/memory.md). docs/methods.md#measured-constants: CPU_UBATCH
CPU_UBATCH = 64
# Batches of more tokens than this (prefills) run with llama_log.abort_check, so that Ctrl-C stops them between
# graph nodes rather than after the whole batch; smaller ones (verification chains and trees, Medusa's of up to 64
# nodes, single tokens) skip the check's call into Python at every node.
ABORTABLE_BATCH = 64
# A slot (LlamaCppDecoder.slots) decodes a prompt in chunks of at most this many tokens, each riding in one shared
# batch with the other slots' steps: a long prompt joining delays their next tokens by about one such chunk's decode
SLOT_CHUNK = 128
# Tokens a rollback on recurrent memory leaves to decode again (from a checkpoint, or cleared) ride in front of the
# next feed up to this many (a verification chain's worth); more are decoded at once, without logits
REDECODE_NOW = 16


@dataclass
class DecoderOptions:
    """llama.cpp context settings. n_seq_max > 1 enables tree batches (kv_unified).

    Reading them (properties included) does no I/O. The one setting that depends on this machine, the default V
    cache type on CPU, is chosen by the explicit step `resolved()`, which LlamaCppDecoder runs when it loads."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int | None = None  # None: see `micro_batch`
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    repack: bool = True  # llama.cpp's extra CPU weight layouts (its --no-repack turns them off)
    flash_attn: bool | None = None
    kv_type: str | None = None  # K and V; None: see `cache_type`
    kv_type_k: str | None = None  # K alone (llama.cpp's --cache-type-k); None: kv_type
    kv_type_v: str | None = None  # V alone (llama.cpp's --cache-type-v); None: kv_type
    embeddings: bool = False
    n_seq_max: int = 1
    # one KV cell array for all sequences (trees need it); None: when n_seq_max > 1. False: a stream per sequence
    kv_unified: bool | None = None
    verbose: bool = False
    memory_check: bool = True  # refuse models whose weights + KV exceed the available RAM
    # the default V type on CPU, this machine's choice (q8_0 or f16): set by resolved(); kv_type_v still says what
    # the user asked for (a default that llama.cpp cannot build falls back to f16, an asked type fails)
    cpu_v_type: str | None = None
    # llama.cpp RPC servers ("host:port") that take the offloaded layers (n_gpu_layers of them, 0: all), weighed by
    # tensor_split; such a decoder is opened in a child process (isolated.py), which a failed server may abort
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    rpc_timeout: float = 60.0  # the longest a call may wait on the RPC servers before they are taken for gone
    rpc_draft: bool = False  # a draft model loaded with these options goes to the RPC servers too (default: local)
    # recurrent-state snapshots per sequence (llama.cpp's n_rs_seq) on hybrid and recurrent models whose architecture
    # supports them: a rollback of up to this many tokens of a verification batch restores one, where a checkpoint
    # would cost a copy of the state (recurrent.py). Capped below n_ubatch; ignored by attention models.
    n_rs_seq: int = 0
    # load the model's MTP layers, and keep every token's hidden row for its head (mtp.py); the model must have them
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {self.n_ctx}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {self.n_batch}")
        if self.n_ubatch is not None and not 1 <= self.n_ubatch <= self.n_batch:
            raise ValueError(f"n_ubatch must be between 1 and n_batch ({self.n_batch}), got {self.n_ubatch}")
        if self.n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {self.n_seq_max}")
        if self.n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {self.n_rs_seq}")
        for name in ("kv_type", "kv_type_k", "kv_type_v"):
            value = getattr(self, name)
            if value is not None and value not in KV_TYPES:
                raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {value!r}")
            if value not in (None, *UNQUANTIZED_KV) and self.flash_attn is False:
                raise ValueError(f"a {value} KV cache needs flash attention (llama.cpp quantizes V only there)")
        if any(not 0 <= w < float("inf") for w in self.tensor_split) or (self.tensor_split and not sum(self.tensor_split)):
            raise ValueError(f"tensor_split needs weights >= 0, not all 0, got {list(self.tensor_split)}")
        if len(self.tensor_split) > llama_cpp.LLAMA_MAX_DEVICES:
            raise ValueError(f"tensor_split has at most {llama_cpp.LLAMA_MAX_DEVICES} weights (llama.cpp's devices)")
        if not self.rpc_timeout > 0:
            raise ValueError(f"rpc_timeout must be > 0 seconds, got {self.rpc_timeout}")
        if self.cpu_v_type is not None and self.cpu_v_type not in kv_cache.V_TYPES:
            raise ValueError(f"cpu_v_type must be one of {', '.join(kv_cache.V_TYPES)}, got {self.cpu_v_type!r}")

    @property
    def micro_batch(self) -> int:
        """n_ubatch (the most tokens llama.cpp computes at once), or by default n_batch, capped at CPU_UBATCH on
        CPU, where larger micro-batches cost memory and gain no speed."""
        if self.n_ubatch is not None:
            return self.n_ubatch
        return self.n_batch if self.offloads else min(self.n_batch, CPU_UBATCH)

    @property
    def offloads(self) -> bool:
        """Whether layers go to a GPU: n_gpu_layers asks for it and this llama.cpp build has a GPU backend (without
        one llama.cpp ignores n_gpu_layers, and so do the CPU defaults here)."""
        return self.n_gpu_layers != 0 and gpu_offload()

    @property
    def remote(self) -> bool:
        """Whether layers go to RPC servers (the weights there are not this machine's memory)."""
        return bool(self.rpc)

    @property
    def cache_type(self) -> str:
        """K cache type: kv_type_k, else kv_type, else by default q8_0 on CPU with flash attention: there llama.cpp
        decodes a batch and single tokens with the same attention kernel, bit for bit at any context length (its f16
        cache switches single tokens to a split kernel past 256 cached tokens); else f16."""
        if self.kv_type_k is not None or self.kv_type is not None:
            return self.kv_type_k or self.kv_type
        return kv_cache.K_TYPE if self._cpu_default else "f16"

    @property
    def cache_type_v(self) -> str:
        """V cache type: kv_type_v, else kv_type, else by default on CPU with flash attention cpu_v_type, q8_0 or f16,
        whichever this machine attends faster with (both keep batches bit for bit: docs/exactness.md); else f16.

        No I/O: where the default needs this machine's choice and `resolved()` has not made it (needs_v_choice),
        ValueError, since a memory check sized with a guess could pass a cache that does not fit."""
        if self.kv_type_v is not None or self.kv_type is not None:
            return self.kv_type_v or self.kv_type
        if not self._cpu_default:
            return "f16"
        if self.cpu_v_type is None:
            raise ValueError("the default V cache type on CPU is chosen per machine: read cache_type_v from "
                             "DecoderOptions.resolved() (kv_cache.resolve)")
        return self.cpu_v_type

    @property
    def needs_v_choice(self) -> bool:
        """Whether cache_type_v is this machine's default V type and `resolved()` has not chosen it yet."""
        return self.kv_type_v is None and self.kv_type is None and self.cpu_v_type is None and self._cpu_default

    def resolved(self) -> DecoderOptions:
        """These options with this machine's default V cache type chosen (cpu_v_type) where they need it, else
        themselves: the explicit load-time step before cache_type_v is read (kv_cache.resolve).

        May do I/O on first use in a process: reads the choice from machine_cache.kv_cache_path(), else measures it
        (a one-layer GGUF written to a temporary folder, two llama.cpp contexts timed, ~0.3 s) and writes it there."""
        return kv_cache.resolve(self, LlamaCppDecoder, default_threads())

    @property
    def _cpu_default(self) -> bool:
        return not self.offloads and self.flash_attn is not False


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ...). Not llama_supports_gpu_offload,
    which says yes for an RPC backend alone."""
    return bool(rpc.local_gpus())


def default_threads() -> int:
    """GGUFSPEC_THREADS when set, else every core this process may run on."""
    if os.environ.get("GGUFSPEC_THREADS", "").isdigit() and int(os.environ["GGUFSPEC_THREADS"]) > 0:
        return int(os.environ["GGUFSPEC_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class LlamaCppDecoder(LockstepSlot):
    """One GGUF model and one llama.cpp context, driven through the low-level API."""

    def __init__(self, path: str | os.PathLike, options: DecoderOptions | None = None) -> None:
        """Load the model and make its context. `options` are resolved first (DecoderOptions.resolved: the default V
        cache type on CPU is this machine's choice, measured on first use) and kept resolved in self.options; the
        cache types in use are self.kv_type (K) and self.kv_type_v (V)."""
        self.path = Path(path).expanduser().resolve()
        self.header = read_header(self.path)  # a bad file fails before anything is measured
        # chosen before the memory check sizes the cache with it
        self.options = opts = (options or DecoderOptions()).resolved()
        if opts.memory_check and not opts.offloads and not opts.remote:
            # (a recurrent model's tree sequences are turned off below: one state per independent sequence)
            check_memory([(self.path, self.header)], opts.n_ctx, opts.cache_type, opts.cache_type_v,
                         n_rs_seq=opts.n_rs_seq, sequences=opts.n_seq_max if opts.kv_unified is False else 1)
        self._ctx = self._batch = None
        remote = rpc.devices(rpc.parse_endpoints(opts.rpc)) if opts.remote else None  # may abort: see isolated.py
        with waiting(f"loading {self.path.name}", show=not opts.verbose):  # a long load shows on a terminal
            self.model = model = LlamaModel(self.path, self.header, n_gpu_layers=(opts.n_gpu_layers or -1) if remote
                                            else opts.n_gpu_layers, use_mmap=opts.use_mmap, use_mlock=opts.use_mlock,
                                            repack=opts.repack, verbose=opts.verbose, devices=remote,
                                            tensor_split=opts.tensor_split, load_mtp=opts.mtp)
        self.vocab, self.n_vocab, self.n_embd = model.vocab, model.n_vocab, model.n_embd
        self.weight_buffers, self.cpu_backend = model.weight_buffers, model.cpu_backend
        self.memory = memory_kind(model.handle)
        if self.memory.recurrent and opts.n_seq_max > 1 and opts.kv_unified is not False:
            # sequences in one cell array serve token trees, whose tokens sit in several sequences at once: recurrent
            # layers hold one state per sequence and cannot share them, and each sequence would hold a state
            notice(f"{self.path.name}: token trees are off (its memory is {self.memory.value}: recurrent layers cannot "
                   "share a token between sequences); drafts run as chains")
            self.options = opts = replace(opts, n_seq_max=1, kv_unified=None)
        try:
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = opts.n_ctx
            cparams.n_batch = opts.n_batch
            cparams.n_ubatch = opts.micro_batch
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
            if self.memory.recurrent:
                cparams.n_rs_seq = snapshots_for(opts.n_rs_seq, opts.micro_batch)
            self.kv_type, self.kv_type_v = opts.cache_type, opts.cache_type_v
            cparams.type_k = int(GGMLQuantizationType[self.kv_type.upper()])
            cparams.type_v = int(GGMLQuantizationType[self.kv_type_v.upper()])
            with llama_log.interruptible():
                self._ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
            if not self._ctx and opts.kv_type is opts.kv_type_k is opts.kv_type_v is None and self.kv_cache != "f16":
                # the default q8_0 needs flash attention, which llama.cpp's "auto" may have turned down, and
                # head sizes that are multiples of its 32-value blocks
                self.kv_type = self.kv_type_v = "f16"
                cparams.type_k = cparams.type_v = int(GGMLQuantizationType.F16)
                self._ctx = llama_cpp.llama_init_from_model(model.handle, cparams)
            if not self._ctx:
                quantized = {self.kv_type, self.kv_type_v} - set(UNQUANTIZED_KV)
                why = (f"a {self.kv_cache} KV cache needs flash attention and head sizes its blocks divide: "
                       "try --kv-type f16; or not enough memory" if quantized else
                       "not enough memory? try a smaller --n-ctx")
                raise GGUFSpecError(
                    f"{self.path}: llama.cpp could not create a context with n_ctx={opts.n_ctx} "
                    f"({why}; --verbose shows llama.cpp's reason)."
                )
            # llama.cpp may round the context up; the limit the user asked for is the one we keep.
            self.n_ctx: int = min(opts.n_ctx, llama_cpp.llama_n_ctx(self._ctx))
            self.n_ubatch: int = llama_cpp.llama_n_ubatch(self._ctx)
            self._mem = llama_cpp.llama_get_memory(self._ctx)
            self._batch = Batch(max(opts.n_batch, 1), opts.n_seq_max)
            # what llama.cpp gave: it sets n_rs_seq back to 0 for architectures without snapshots
            self.n_rs_seq: int = llama_cpp.llama_n_rs_seq(self._ctx) if self.memory.recurrent else 0
            self.hidden_rows: HiddenRows | None = None  # with options.mtp: the rows its MTP head reads (mtp.py)
            if opts.mtp:
                mtp.record_hidden(self._ctx)
                self.hidden_rows = HiddenRows(llama_cpp.llama_model_n_embd_out(model.handle))
        except BaseException:
            self.close()
            raise
        self.history: list[int] = []
        self.shift_keep: int | None = None  # set: a feed that overflows shifts the context instead of failing
        self.n_shifts = 0
        self.decode_seconds = 0.0
        self.hold_seconds = 0.0  # recurrent memory: saving and restoring checkpoints (recurrent.Rewind), a clock
        self.n_decodes = 0
        self.n_decoded_tokens = 0
        self.n_batched_tokens = 0
        self.lanes: tuple[int, ...] = ()
        self.tick = -1
        self._n_out = 0  # rows of hidden states the last decode computed
        self._hidden_on = opts.embeddings
        self._abort_on = False  # llama_log.abort_check installed: see ABORTABLE_BATCH
        self._views: dict[tuple[int, int, int], np.ndarray] = {}  # see _buffer_rows
        self._skip = 0  # leading rows of the last decode that were deferred tokens, not asked for
        self._deferred: list[int] = []
        self._unrecorded = False  # a decode's cells may be in the KV cache without being in the history
        self._tree: _Tree | None = None
        self._tree_pre: list[int] = []  # deferred tokens decoded in front of the pending tree
        # a slot of a shared context (see slots): its sequences are _seq (the history) and the _span - 1 after it
        # (its trees' leaves); its decodes are submissions to _runner's batches through _lockstep
        self._seq, self._span = 0, opts.n_seq_max
        self._lockstep: Lockstep | None = None
        self._runner: _SharedContext | None = None
        self._sub: Submission | None = None  # a slot's last decode, with its copied rows
        self._owner = True  # frees the context on close (a slot does not)
        self._rewind = self._new_rewind(0)  # recurrent memory: how the history's sequence goes back

    @classmethod
    def slots(cls, path: str | os.PathLike, options: DecoderOptions, n: int,
              lockstep: Lockstep, leads: bool = False) -> list[LlamaCppDecoder]:
        """n decoders over ONE llama.cpp context (llama-server's slots): each keeps its own history in its own KV
        sequence, and their decodes run together, one batch per tick of `lockstep` (see lockstep.py; `leads`: a
        draft model's context, whose batches run first).
        options.n_ctx is the whole cache, as llama-server's -c: each slot holds n_ctx // n tokens.

        Several slots get a KV stream each (llama.cpp's non-unified cache), so that each slot's cells stay in the
        order it decoded them: in one shared cell array, other slots' rollbacks leave holes that a slot's next
        tokens fill, llama.cpp's attention then sums its cells in another order, and with activations quantized
        between layers that moved SmolLM2's logits by up to 1.1, even with an f32 cache (docs/exactness.md). A
        stream holds one sequence, so slots decode chains, not trees: options.n_seq_max must be 1 then. One slot
        keeps options.n_seq_max sequences (its trees' leaves + 1) in one cell array.
        Closing a slot closes only the slot: the context is freed with the last of them."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if n > 1 and options.n_seq_max != 1:
            raise ValueError(f"{n} slots hold one sequence each (no trees): n_seq_max must be 1, got {options.n_seq_max}")
        span, chunk = options.n_seq_max, min(options.n_batch, SLOT_CHUNK)
        per_slot = options.n_ctx // n
        if per_slot < 2:
            raise ValueError(f"a context of {options.n_ctx} tokens cannot hold {n} slots")
        # every slot's n_ctx // n tokens, plus a chunk each: a verification batch's or a tree's transient cells
        whole = replace(options, n_ctx=per_slot * n + n * chunk, n_batch=n * chunk, n_seq_max=n * span,
                        n_ubatch=min(options.micro_batch, n * chunk), kv_unified=True if n == 1 else False)
        owner = cls(path, whole)
        span = owner.options.n_seq_max // n  # 1 where recurrent memory turned the trees off
        runner = _SharedContext(owner, leads)
        view_options = replace(owner.options, n_ctx=per_slot, n_batch=chunk, n_seq_max=span, n_ubatch=None)
        return [owner._slot(i * span, view_options, lockstep, runner) for i in range(n)]

    def _new_rewind(self, seq: int) -> Rewind | None:
        """The rollback rules of sequence `seq` on recurrent memory; None on attention memory (any rollback is free)."""
        return Rewind(self._ctx, seq, self.n_rs_seq, self.n_ubatch) if self.memory.recurrent else None

    def _slot(self, seq: int, options: DecoderOptions, lockstep: Lockstep, runner: _SharedContext) -> LlamaCppDecoder:
        view = copy.copy(self)
        view.options, view.n_ctx = options, options.n_ctx
        view._seq, view._span, view._lockstep, view._runner, view._sub, view._owner = (
            seq, options.n_seq_max, lockstep, runner, None, False)
        view.history, view._deferred, view._tree, view._tree_pre = [], [], None, []
        view.shift_keep, view.n_shifts, view.decode_seconds, view.n_decodes = None, 0, 0.0, 0
        view.hold_seconds = 0.0
        view.n_decoded_tokens = view.n_batched_tokens = 0
        view.lanes, view.tick = (), -1
        view._n_out = view._skip = 0
        view._unrecorded = False
        view._rewind = view._new_rewind(seq)
        view.hidden_rows = HiddenRows(self.hidden_rows.width) if self.hidden_rows is not None else None
        return view

    @property
    def llama_context(self):
        """The llama.cpp context (a llama_context pointer), for llama.cpp's own API: its use bypasses the history."""
        return self._require_ctx()

    @property
    def rollbacks(self) -> Rollbacks | None:
        """How this decoder's rollbacks went on recurrent memory (counts, only growing); None on attention memory."""
        return self._rewind.counts if self._rewind is not None else None

    @property
    def shared(self) -> bool:
        """Whether this decoder is a slot of a shared context."""
        return self._lockstep is not None

    def pad_chains(self, price: Price | None, pad_max: int) -> None:
        """How this slot's shared context runs uneven chains from now on, for every slot of it: with `price` (a
        micro-batch's seconds by its shape, e.g. CostModel.micro_seconds) chains of up to `pad_max` tokens are padded
        to one length where that costs less (lockstep.even_lanes); price None (the default): batches run as
        submitted. GGUFSpecError on a decoder with a context of its own."""
        if self._runner is None:
            raise GGUFSpecError("pad_chains needs a slot of a shared context (LlamaCppDecoder.slots)")
        self._runner.price, self._runner.pad_max = price, pad_max

    def _locked(self) -> AbstractContextManager:
        """Held around every use of a shared context (nothing for a context of one's own)."""
        return self._lockstep.lock if self._lockstep is not None else nullcontext()

    def _submit(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                outputs: Sequence[bool], hidden: bool) -> int:
        """A slot's decode: its part of the next shared batch; llama_decode's return code."""
        sub = Submission(tokens, positions, seq_ids, outputs, hidden, self._seq)
        self._unrecorded = True
        try:
            self._lockstep.submit(self._runner, sub)
        finally:
            self.decode_seconds += sub.seconds
            self.n_decodes += 1
            self.n_decoded_tokens += len(tokens)
            self.n_batched_tokens += sub.batch
            self.lanes, self.tick = sub.lanes, sub.tick
        self._sub = sub
        return sub.rc

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value of the model, as text; None when absent."""
        return self.model.metadata(key)

    # --- decoding -------------------------------------------------------------------------

    @property
    def n_deferred(self) -> int:
        return len(self._deferred)

    def feed(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False) -> np.ndarray:
        if len(tokens) == 0:
            raise ValueError("feed needs at least one token")
        if self._tree is not None:
            self._end_tree()
        pre = self._take_deferred() if self._deferred else []
        base = len(self.history)
        try:
            rows = self._feed([*pre, *tokens] if pre else tokens, all_logits, view)
        except BaseException:
            self._restore_deferred(pre, base)
            raise
        self._skip = len(pre) if all_logits and len(pre) + len(tokens) <= self.options.n_batch else 0
        return rows[len(pre):] if all_logits and pre else rows

    def _feed(self, tokens: Sequence[int], all_logits: bool, view: bool) -> np.ndarray:
        n = len(tokens)
        if len(self.history) + n > self.n_ctx:
            if self.shift_keep is None:
                raise ContextLengthError(
                    f"{len(self.history) + n} tokens do not fit the context of {self.n_ctx} tokens (raise --n-ctx)."
                )
            self.shift(n)
        step = self.options.n_batch
        if n <= step:  # one batch (every step of a generation)
            self._decode(tokens, all_logits)
            return self._logits(n if all_logits else 1, view)
        rows = []
        for start in range(0, n, step):
            chunk = tokens[start : start + step]
            last_chunk = start + step >= n
            self._decode(chunk, all_logits)
            if all_logits or last_chunk:
                rows.append(self._logits(len(chunk) if all_logits else 1, view and last_chunk))
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _decode(self, tokens: Sequence[int], all_logits: bool) -> None:
        self._require_ctx()
        hidden = all_logits or len(tokens) == 1
        if self.shared:
            start, n = len(self.history), len(tokens)
            rc = self._submit(tokens, range(start, start + n), [[self._seq]] * n,
                              [all_logits or i == n - 1 for i in range(n)], hidden)
        else:
            self._batch.fill(tokens, len(self.history), all_logits)
            rc = self._run_batch(len(tokens), hidden)
        if rc != 0:
            # llama.cpp leaves no partial batch in the KV on failure; the history stays as it was.
            raise GGUFSpecError(f"llama_decode failed with code {rc} at position {len(self.history)}")
        if self.hidden_rows is not None:
            self.hidden_rows.put(len(self.history), self._nextn(len(tokens)))
        self.history.extend(map(int, tokens))
        self._unrecorded = False
        if self._rewind is not None:
            self._rewind.decoded(len(tokens))
        self._n_out = len(tokens) if hidden else 0  # hidden: every token's row, or the one token's
        self._skip = 0

    def _run_batch(self, n_tokens: int, hidden: bool = True) -> int:
        """llama_decode of the filled batch, timed and counted; its return code. Until the caller records the
        tokens, the cache may hold cells the history does not (see rollback_to). hidden=False: no hidden states
        (llama.cpp outputs logits and states of every token of a batch while embeddings are on: a prefill
        would compute and copy the whole vocabulary's logits for every prompt token)."""
        if self._hidden_on != (hidden and self.options.embeddings):
            self._hidden_on = not self._hidden_on
            llama_cpp.llama_set_embeddings(self._ctx, self._hidden_on)
        abortable = n_tokens > ABORTABLE_BATCH
        if self._abort_on != abortable:
            self._abort_on = abortable
            llama_cpp.llama_set_abort_callback(self._ctx, llama_log.abort_check if abortable else llama_log.NO_ABORT_CHECK,
                                               None)
        t0 = time.perf_counter()
        self._unrecorded = True
        try:
            if abortable:
                with llama_log.interruptible():  # rc 2 when Ctrl-C aborted it
                    rc = llama_cpp.llama_decode(self._ctx, self._batch.struct)
            else:
                rc = llama_cpp.llama_decode(self._ctx, self._batch.struct)
            if rc == 0:  # an asynchronous backend (RPC, CUDA) returns before it computed: its time is the pass's
                llama_cpp.llama_synchronize(self._ctx)
        finally:
            self.decode_seconds += time.perf_counter() - t0
            self.n_decodes += 1
            self.n_decoded_tokens += n_tokens
            self.n_batched_tokens += n_tokens
        return rc

    def _nextn(self, n: int) -> np.ndarray:
        """The hidden rows of the last decode's n tokens (options.mtp), a view while valid."""
        if self.shared:
            return self._sub.nextn
        return mtp.hidden_rows(self._ctx, n, self.hidden_rows.width)

    def _logits(self, n_rows: int, view: bool = False) -> np.ndarray:
        if self.shared:
            return self._sub.logits  # the rows it asked for, copied: n_rows of them
        rows = _buffer_rows(self._views, llama_cpp.llama_get_logits(self._ctx), n_rows, self.n_vocab)
        return rows if view else rows.copy()

    def sync(self, tokens: Sequence[int], view: bool = False) -> np.ndarray:
        tokens = list(tokens)
        if not tokens:
            raise ValueError("sync needs at least one token")
        keep = min(common_prefix(self.history, tokens), len(tokens) - 1)  # re-decode one token for its logits
        self.rollback_to(keep)
        return self.feed(tokens[keep:], all_logits=False, view=view)

    def shift(self, room: int) -> None:
        """Context shift: drop the older half of the history after its first `shift_keep` tokens (at
        least enough to make `room`), sliding the rest down in place, as llama.cpp's --context-shift does."""
        keep, n = self.shift_keep or 0, len(self.history)
        discard = max((n - keep) // 2, n + room - self.n_ctx)
        if keep + discard > n or room > self.n_ctx - keep:
            raise ContextLengthError(f"{room} tokens do not fit after the {keep} kept ones in a context of {self.n_ctx}.")
        mem = self._mem_checked()
        if not llama_cpp.llama_memory_can_shift(mem):
            raise GGUFSpecError("this model's cache cannot shift positions; use a larger --n-ctx instead.")
        with self._locked():
            llama_cpp.llama_memory_seq_rm(mem, self._seq, keep, keep + discard)
            llama_cpp.llama_memory_seq_add(mem, self._seq, keep + discard, -1, -discard)
            if self._rewind is not None:  # its snapshots and checkpoints hold the positions before the shift
                self._rewind.forget()
        if self.hidden_rows is not None:
            self.hidden_rows.shift(keep, discard)
        del self.history[keep : keep + discard]
        self.n_shifts += 1

    def rollback_to(self, n: int) -> None:
        if not 0 <= n <= len(self.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(self.history)} tokens")
        self._end_tree()
        if self.hidden_rows is not None:  # deferred tokens keep theirs: the same tokens after the same ones
            self.hidden_rows.cut(n)
        cached = len(self.history) - len(self._deferred)
        if self._rewind is not None:
            self._rewind_to(n, cached)
            return
        # _unrecorded: a decode was interrupted (Ctrl-C lands right after llama_decode returns) before the
        # history recorded it, so cells past the history may hold its tokens; any tree sequences go with them
        if n < cached or self._unrecorded:
            with self._locked():  # a slot's own sequence (its tree sequences went with _end_tree), else all
                ok = llama_cpp.llama_memory_seq_rm(self._mem_checked(), self._seq if self.shared else -1,
                                                   min(n, cached), -1)
            if not ok:
                raise GGUFSpecError("this model's memory cannot be rolled back partially (recurrent model?)")
            self._unrecorded = False
        del self._deferred[max(n - cached, 0):]
        del self.history[n:]

    def _rewind_to(self, n: int, cached: int) -> None:
        """rollback_to on recurrent memory: the tokens of history[:n] that its snapshot or checkpoint does not hold
        (recurrent.Rewind.back) are deferred to the next feed, or decoded now where they are more than a verification
        batch's worth (a prefix reused from far back: the next feed may want every row's logits)."""
        self._require_ctx()
        if n < cached or self._unrecorded:
            with self._locked():
                held = self._rewind.back(cached, n, known=not self._unrecorded)
                self.hold_seconds += self._rewind.seconds
                self._rewind.seconds = 0.0
            self._unrecorded = False
            again = self.history[held:n]
            del self.history[held:]
            self._deferred = []
            if len(again) > REDECODE_NOW:
                self._feed(again[:-REDECODE_NOW], all_logits=False, view=True)
                again = again[-REDECODE_NOW:]
            self.history.extend(again)
            self._deferred = again
        else:
            del self._deferred[max(n - cached, 0):]
            del self.history[n:]

    def hold(self, undo: int | None = None, anchor: bool = False) -> None:
        """See Decoder.hold. A checkpoint holds what the memory holds: deferred tokens stay deferred, and a rollback to
        it decodes them again."""
        if self._rewind is None or self._unrecorded:  # the state after an unrecorded decode is no point to go back to
            return
        self._require_ctx()
        with self._locked():
            self._rewind.hold(len(self.history) - len(self._deferred), undo, anchor,
                              len(self._deferred) + (undo or 0) + 1)
            self.hold_seconds += self._rewind.seconds
            self._rewind.seconds = 0.0

    def reset(self) -> None:
        """Forget the whole history."""
        if self._rewind is not None:
            self._rewind.forget()
        if self.shared:
            self._drop_sequences(range(self._seq, self._seq + self._span))
        else:
            llama_cpp.llama_memory_clear(self._mem_checked(), True)
        self._unrecorded = False
        if self.hidden_rows is not None:
            self.hidden_rows.clear()
        self.history.clear()
        self._deferred.clear()
        self._tree, self._tree_pre = None, []

    def _take_deferred(self) -> list[int]:
        pre, self._deferred = self._deferred, []
        if pre:
            del self.history[-len(pre):]
        return pre

    def _restore_deferred(self, pre: list[int], base: int) -> None:
        """After a failed decode: deferred tokens it did not get into the cache stay deferred."""
        if pre and len(self.history) == base:
            self.history.extend(pre)
            self._deferred = pre

    def hidden_states(self) -> np.ndarray:
        if not self.options.embeddings:
            raise GGUFSpecError("hidden states need a decoder created with embeddings=True")
        if not self._n_out:
            raise GGUFSpecError("the last decode computed no hidden states (a prefill for the last token's logits)")
        if self.shared:
            return self._sub.states[self._skip :]
        ptr = llama_cpp.llama_get_embeddings(self._require_ctx())
        return np.ctypeslib.as_array(ptr, shape=(self._n_out, self.n_embd))[self._skip :].copy()

    # --- trees ----------------------------------------------------------------------------

    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        self._end_tree()
        pre = self._take_deferred()  # decoded as a chain above the roots
        base = len(self.history)
        try:
            logits = self._decode_tree([*pre, *tokens], [*range(-1, len(pre) - 1), *(p + len(pre) for p in parents)])
        except BaseException:
            self._restore_deferred(pre, base)
            raise
        self.history.extend(pre)  # in the cache now, but only in the tree's sequences until the commit
        self._tree_pre, self._skip = pre, len(pre)
        return logits[len(pre):]

    def _decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        tree = _Tree.build(parents)
        if tree.n_leaves + 1 > self.options.n_seq_max:
            raise GGUFSpecError(
                f"a tree with {tree.n_leaves} leaves needs n_seq_max >= {tree.n_leaves + 1}, "
                f"this context has {self.options.n_seq_max}"
            )
        if len(self.history) + tree.depth_max + 1 > self.n_ctx:
            if self.shift_keep is None:
                raise ContextLengthError(f"the tree does not fit the context of {self.n_ctx} tokens")
            self.shift(tree.depth_max + 1)
        base = len(self.history)
        if len(tokens) > self.options.n_batch:
            raise GGUFSpecError(f"a tree of {len(tokens)} nodes needs n_batch >= {len(tokens)}")
        mem, seq = self._mem_checked(), self._seq
        with self._locked():
            for s in range(1, tree.n_leaves + 1):
                llama_cpp.llama_memory_seq_cp(mem, seq, seq + s, -1, -1)
        positions = [base + d for d in tree.depth]
        if self.shared:
            rc = self._submit(tokens, positions, [[seq + s for s in ids] for ids in tree.seq_ids], [True] * len(tokens),
                              True)
        else:
            self._batch.fill_tree(tokens, positions, tree.seq_ids)
            rc = self._run_batch(len(tokens))
            self._batch.reset_sequences(len(tokens))
        if rc != 0:
            self._drop_sequences(range(seq + 1, seq + tree.n_leaves + 1))
            raise GGUFSpecError(f"llama_decode failed with code {rc} on a tree of {len(tokens)} nodes")
        self._n_out = len(tokens)
        self._tree = tree
        self._tree_tokens = [int(t) for t in tokens]
        self._tree_rows = self._nextn(len(tokens)).copy() if self.hidden_rows is not None else None
        self._unrecorded = False
        return self._logits(len(tokens))

    def commit_tree_path(self, path: Sequence[int]) -> int:
        tree = self._tree
        if tree is None:
            raise GGUFSpecError("commit_tree_path needs a tree_logits call just before it")
        n_pre = len(self._tree_pre)  # the deferred tokens in front: the caller's node i is node i + n_pre
        for a, b in zip(path, path[1:]):
            if tree.parents[b + n_pre] != a + n_pre:
                raise ValueError(f"node {b} is not a child of node {a}")
        if path and tree.parents[path[0] + n_pre] != n_pre - 1:
            raise ValueError(f"path must start at a root node, node {path[0]} is not one")
        full = [*range(n_pre), *(int(i) + n_pre for i in path)]
        mem, seq = self._mem, self._seq
        base = len(self.history) - n_pre
        with self._locked():
            if full:
                leaf_seq = seq + tree.seq_ids[full[-1]][0]
                llama_cpp.llama_memory_seq_rm(mem, leaf_seq, base + len(full), -1)
                self._keep_sequence(leaf_seq, tree.n_leaves)
                llama_cpp.llama_memory_seq_cp(mem, leaf_seq, seq, -1, -1)
                llama_cpp.llama_memory_seq_rm(mem, leaf_seq, -1, -1)
            else:
                self._keep_sequence(seq, tree.n_leaves)
        # Node i of the batch sits in the cache cell after node i-1's. The path's nodes after its first gap
        # would sit past freed cells that later tokens fill: out of position order, and llama.cpp's attention
        # adds up cells in cache order, so its logits would drift from plain decoding's (docs/exactness.md). Those
        # nodes are dropped from the cache and decoded again in front of the next batch.
        contiguous = next((i for i, node in enumerate(full) if node != i), len(full))
        if contiguous < len(full):
            with self._locked():
                llama_cpp.llama_memory_seq_rm(mem, seq, base + contiguous, -1)
        committed = [self._tree_tokens[i] for i in full]
        if self.hidden_rows is not None and full:  # the path's rows, at the positions its nodes take
            self.hidden_rows.cut(base)
            self.hidden_rows.put(base, self._tree_rows[full])
        del self.history[base:]
        self.history.extend(committed)
        self._deferred = committed[contiguous:]
        self._tree, self._tree_pre = None, []
        return len(self._deferred)

    def _end_tree(self) -> None:
        """Drop an uncommitted tree from the cache: the history is as it was before tree_logits."""
        if self._tree is not None:
            with self._locked():  # the tree's cells are in its leaves' sequences only
                self._keep_sequence(self._seq, self._tree.n_leaves)
            self._deferred = self._tree_pre
            self._tree, self._tree_pre = None, []

    def _keep_sequence(self, keep: int, n_leaves: int) -> None:
        """Of this decoder's history sequence and its tree's n_leaves leaf sequences, only `keep` stays."""
        if not self.shared:
            llama_cpp.llama_memory_seq_keep(self._mem, keep)  # one pass over the cache; there is no other slot
            return
        self._drop_sequences(s for s in range(self._seq, self._seq + n_leaves + 1) if s != keep)

    def _drop_sequences(self, seqs: Iterable[int]) -> None:
        with self._locked():
            for s in seqs:
                llama_cpp.llama_memory_seq_rm(self._mem_checked(), s, -1, -1)

    # --- independent sequences -------------------------------------------------------------

    def decode_sequences(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                         view: bool = False) -> np.ndarray:
        """Decode tokens of independent sequences in one batch, token i at positions[i] of sequence seq_ids[i];
        logits (n, V) of every token (hidden_states() gives theirs after it).

        Runs outside the history, for several sequences in one context (e.g. answers generated side by side):
        the history must be empty, seq_ids below n_seq_max; clear_sequence frees one sequence, reset() all.
        view=True: a read-only view of llama.cpp's buffer, valid only until this decoder's next decode.
        """
        self._require_ctx()
        self._require_own("decode_sequences")
        self._end_tree()
        self._require_no_history("decode_sequences")
        n = len(tokens)
        if n == 0 or len(positions) != n or len(seq_ids) != n:
            raise ValueError(f"decode_sequences needs tokens, positions and seq_ids of one length >= 1, "
                             f"got {n}, {len(positions)} and {len(seq_ids)}")
        if not all(0 <= s < self.options.n_seq_max for s in seq_ids):
            raise ValueError(f"sequence ids must be in 0..{self.options.n_seq_max - 1} (n_seq_max), got {sorted(set(seq_ids))}")
        if n > self._batch.capacity:
            raise GGUFSpecError(f"a batch of {n} tokens needs n_batch >= {n}, this context has {self._batch.capacity}")
        self._batch.fill_tree(tokens, positions, [[s] for s in seq_ids])
        rc = self._run_batch(n)  # the cells stay unrecorded: not the history's, rollback_to(0) drops them too
        self._batch.reset_sequences(n)
        if rc != 0:
            raise GGUFSpecError(f"llama_decode failed with code {rc} on a batch of {n} tokens in sequences "
                                f"{sorted(set(seq_ids))} (raise n_ctx?)")
        self._n_out, self._skip = n, 0
        return self._logits(n, view)

    def clear_sequence(self, seq_id: int) -> None:
        """Drop every KV entry of sequence seq_id (filled by decode_sequences; the history must be empty)."""
        self._require_own("clear_sequence")
        self._require_no_history("clear_sequence")
        llama_cpp.llama_memory_seq_rm(self._mem_checked(), seq_id, -1, -1)

    def kv_positions(self, seq_id: int = 0) -> tuple[int, int]:
        """Lowest and highest position the KV cache holds for sequence seq_id, (-1, -1) when none; sequence 0
        holds the history."""
        mem, seq_id = self._mem_checked(), self._seq + seq_id
        with self._locked():
            return llama_cpp.llama_memory_seq_pos_min(mem, seq_id), llama_cpp.llama_memory_seq_pos_max(mem, seq_id)

    def _require_own(self, what: str) -> None:
        if self.shared:
            raise GGUFSpecError(f"{what} needs a context of its own, not a slot of a shared one")

    def _require_no_history(self, what: str) -> None:
        if self.history:
            raise GGUFSpecError(f"{what} runs outside the history, which holds {len(self.history)} tokens: reset() first")

    # --- lifetime -------------------------------------------------------------------------

    def _require_ctx(self):
        if self._ctx is None:
            raise GGUFSpecError("this decoder is closed")
        return self._ctx

    def _mem_checked(self):
        self._require_ctx()
        return self._mem

    @property
    def kv_cache(self) -> str:
        """The K/V cache types of this context, as kv_label spells them."""
        return kv_label(self.kv_type, self.kv_type_v)

    def close(self) -> None:
        """Free the context, the batch and the model; further use raises GGUFSpecError. A slot lets go of its
        shared context, which the last reference frees."""
        if not getattr(self, "_owner", True):
            self._ctx = self._batch = self._runner = None
            return
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "model", None) is not None:
            self.model.close()

    def __enter__(self) -> LlamaCppDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _SharedContext:
    """The context the slots share: runs one tick's submissions as one batch (lockstep.Runner)."""

    def __init__(self, owner: LlamaCppDecoder, leads: bool = False) -> None:
        self.owner, self.leads = owner, leads
        self._hidden_on = owner.options.embeddings
        self._views: dict[tuple[int, int, int], np.ndarray] = {}  # see _buffer_rows
        # a micro-batch's price by its shape (EnginePool sets the measured one): uneven chains of up to pad_max
        # tokens are padded to one length where that costs less (lockstep.even_lanes); None: batches run as submitted
        self.price: Price | None = None
        self.pad_max = 0

    def run(self, subs: list[Submission]) -> tuple[int, ...]:
        o = self.owner
        # by sequence: llama.cpp splits a batch over several streams into micro-batches of consecutive sequence ids
        # (and as many tokens of each), so slots in order share theirs
        subs = sorted(subs, key=lambda s: s.lane)
        # tokens by slot, under the slot's own sequence: a tree's tokens sit in its leaves' sequences after it
        # (counted under their first, a lone slot's tree pass looked shared with a second slot, and `auto` priced
        # its next step so)
        lanes = [0] * (1 + subs[-1].lane)
        for s in subs:
            lanes[s.lane] += len(s.tokens)
        ran = self._padded_lanes(subs, lanes)
        tokens, positions, seq_ids, outputs = [], [], [], []
        padded: list[tuple[int, int]] = []  # (sequence, its first pad's position)
        # in sequence order, as llama.cpp takes consecutive sequences into one micro-batch; padded, every sequence up
        # to the last one's (an idle one's submission None)
        by_seq = {s.lane: s for s in subs}
        order = [(seq, by_seq.get(seq)) for seq in range(len(ran))] if ran is not None else [(s.lane, s) for s in subs]
        for seq, s in order:
            if s is not None:
                tokens += s.tokens
                positions += s.positions
                seq_ids += s.seq_ids
                outputs += s.outputs
            pad = ran[seq] - (len(s.tokens) if s is not None else 0) if ran is not None else 0
            if pad:  # past the sequence's last position (an idle one's cached tokens), unread
                end = s.positions[-1] + 1 if s is not None else llama_cpp.llama_memory_seq_pos_max(o._mem, seq) + 1
                tokens += [subs[0].tokens[-1]] * pad
                positions += range(end, end + pad)
                seq_ids += [[seq]] * pad
                outputs += [False] * pad
                padded.append((seq, end))
        n = len(tokens)
        if n > o._batch.capacity:  # cannot happen: each slot submits at most its n_batch, and pads fit beside it
            raise GGUFSpecError(f"a shared batch of {n} tokens exceeds its capacity {o._batch.capacity}")
        o._batch.fill_entries(tokens, positions, seq_ids, outputs)
        hidden = o.options.embeddings and any(s.hidden for s in subs)
        if self._hidden_on != hidden:
            self._hidden_on = hidden
            llama_cpp.llama_set_embeddings(o._ctx, hidden)
        rc = llama_cpp.llama_decode(o._ctx, o._batch.struct)
        if rc == 0:
            llama_cpp.llama_synchronize(o._ctx)  # as in _run_batch: the submissions' seconds include the computation
        o._batch.reset_sequences(n)
        for s in subs:
            s.rc = rc
        for seq, end in padded:  # the pads' cells go: each sequence is as if its own tokens had run alone
            llama_cpp.llama_memory_seq_rm(o._mem, seq, end, -1)
        if rc != 0:
            return ran or tuple(lanes)
        if o.hidden_rows is not None:  # every token's hidden row, in batch order: each submission's own, its pads after
            rows, at = mtp.hidden_rows(o._ctx, n, o.hidden_rows.width), 0
            for seq, s in order:
                if s is not None:
                    s.nextn = rows[at : at + len(s.tokens)].copy()
                at += ran[seq] if ran is not None else len(s.tokens)
        # llama.cpp keeps the output rows in batch order, each submission's together: one view of the batch, a slice
        # copy each (a view and a stack per row cost several times as much, on every tick)
        counts = [sum(map(bool, s.outputs)) for s in subs]
        n_out = sum(counts)
        logits = _buffer_rows(self._views, llama_cpp.llama_get_logits(o._ctx), n_out, o.n_vocab)
        states = _buffer_rows(self._views, llama_cpp.llama_get_embeddings(o._ctx), n_out, o.n_embd) if hidden else None
        row = 0
        for s, k in zip(subs, counts):
            s.logits = logits[row : row + k].copy()
            if hidden and s.hidden:
                s.states = states[row : row + k].copy()
            row += k
        return ran or tuple(lanes)

    def _padded_lanes(self, subs: list[Submission], lanes: list[int]) -> tuple[int, ...] | None:
        """The tokens each sequence runs, pads included, where padding makes the batch of `lanes` (tokens by sequence)
        cheaper (subs sorted by sequence; an idle sequence below the last one may be padded too); None: no pads. A
        slot is one sequence of this context (EnginePool sets price only so)."""
        seqs = {s.lane for s in subs}
        one_each = len(seqs) == len(subs) and all(len(ids) == 1 for s in subs for ids in s.seq_ids)  # chains, no trees
        if self.price is None or len(seqs) < 2 or not one_each or self.owner.memory.recurrent:
            return None  # (recurrent memory: removing a pad would be a second rollback, which llama.cpp refuses)
        even = even_lanes(lanes, self.price, self.pad_max)
        return None if even == tuple(lanes) else even


def _buffer_rows(views: dict[tuple[int, int, int], np.ndarray], ptr, n_rows: int, width: int) -> np.ndarray:
    """The first n_rows rows (of `width` floats) of llama.cpp's output buffer at `ptr`, as a read-only view kept in
    `views` per address and shape: np.ctypeslib.as_array cost 30 us a call (docs/engine-overhead.md). The buffer at
    that address holds at least the rows the last decode wrote."""
    if not ptr:
        raise GGUFSpecError("llama.cpp returned no outputs for this batch")
    key = (ctypes.addressof(ptr.contents), n_rows, width)
    rows = views.get(key)
    if rows is None:
        if len(views) > 64:
            views.clear()
        rows = views[key] = np.ctypeslib.as_array(ptr, shape=(n_rows, width))
        rows.flags.writeable = False  # llama.cpp's buffer: readers only
    return rows


def prefill(d: Decoder, context: list[int]) -> None:
    """Decode `context` into d's cache, reusing its common prefix (an empty context empties it); on recurrent memory
    its end is kept as a point to go back to (a chat's next turn reuses the prompt at least)."""
    if context:
        d.sync(context)
        d.hold(anchor=True)
    else:
        d.rollback_to(0)


@dataclass
class _Tree:
    """Per-node depth and sequence ids of a tree given by parent indices; leaf j is sequence j+1."""

    parents: list[int]
    depth: list[int]
    seq_ids: list[list[int]]
    n_leaves: int
    depth_max: int

    @classmethod
    def build(cls, parents: Sequence[int]) -> _Tree:
        parents = [int(p) for p in parents]
        n = len(parents)
        if n == 0:
            raise ValueError("a tree needs at least one node")
        depth = [0] * n
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depth[i] = 0 if p < 0 else depth[p] + 1
        has_child = [False] * n
        for p in parents:
            if p >= 0:
                has_child[p] = True
        seq_ids: list[list[int]] = [[] for _ in range(n)]
        n_leaves = 0
        for leaf in range(n):
            if has_child[leaf]:
                continue
            n_leaves += 1
            node = leaf
            while node >= 0:
                seq_ids[node].append(n_leaves)
                node = parents[node]
        return cls(parents, depth, seq_ids, n_leaves, max(depth))
