"""`Decoder`: what the verifier and proposers need from a model, and `LlamaCppDecoder`, one llama.cpp context over
a `LlamaModel` (model.py: weights, vocabulary, metadata).

A decoder holds a token history whose KV entries live in the context. Feeding tokens appends
them; rolling back removes KV entries. Every position is decoded once unless rolled back.

LlamaCppDecoder is put together from: the llama.cpp context (llama_context.py: opened from DecoderOptions, a batch
decoded, rows read, KV sequences edited), the way its decodes reach it (access.py: a context of its own, or a slot's
submissions to a context that slots share, shared_context.py), the history (sequence.py) and token trees
(tree_decoding.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, Sequence

import llama_cpp
import numpy as np

from . import kv_cache, rpc
from .access import OwnAccess, SlotAccess
from .llama_context import Context, default_threads
from .errors import GGUFSpecError
from .gguf_check import read_header
from .lockstep import Lockstep
from .micro_batches import Price
from .machine_cache import notice
from .memory import check_memory
from .model import LlamaModel
from .recurrent import MemoryKind, memory_kind
from .sequence import KvSequence, read_only
from .shared_context import SharedContext
from .submission import BatchShape, Steps, run_steps
from .tree_decoding import TreeDecoding
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
    # a slot of a shared context: its last decode's whole batch (tokens per sequence id, its tick), and its own
    # sequence id there; submission.NO_BATCH and 0 on a context of its own
    last_batch: BatchShape
    lane: int
    peers: int  # a slot's: the other slots generating in its context now
    last_tick: int  # a slot's: the number of its context's last batch (BatchShape.tick); -1 on a context of its own
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

    # feed, sync and rollback_to as decode coroutines (submission.Steps), which a pool's tasks run (a decoder whose
    # decodes never wait on other slots' takes lockstep.DecodeSteps' defaults)
    def feed_steps(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False,
                   picks: bool = False) -> Steps[np.ndarray]: ...

    def picks(self, n_rows: int) -> np.ndarray | None:
        """After feed_steps(..., picks=True): the argmax of each of the last n_rows rows it returned, worked out as its
        batch ended (a slot's shared batch: a row read later, after the other slots' steps, is out of cache and took
        three times as long), or None where it was not (the reader takes the rows' argmax itself)."""

    def sync_steps(self, tokens: Sequence[int], view: bool = False) -> Steps[np.ndarray]: ...

    def rollback_steps(self, n: int) -> Steps[None]: ...

    def tree_logits_steps(self, tokens: Sequence[int], parents: Sequence[int]) -> Steps[np.ndarray]: ...

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
# Hybrid and recurrent models' layers (a gated delta net's chunked form) prefill faster in longer micro-batches on CPU:
# they keep llama.cpp's default. docs/methods.md#measured-constants: RECURRENT_CPU_UBATCH
RECURRENT_CPU_UBATCH = 512
# A slot (LlamaCppDecoder.slots) decodes a prompt in chunks of at most this many tokens, each riding in one shared
# batch with the other slots' steps: a long prompt joining delays their next tokens by about one such chunk's decode
SLOT_CHUNK = 128


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
        CPU, where larger micro-batches cost memory and gain no speed: an attention model's (micro_batch_on says any
        model's)."""
        if self.n_ubatch is not None:
            return self.n_ubatch
        return self.n_batch if self.offloads else min(self.n_batch, CPU_UBATCH)

    def micro_batch_on(self, recurrent: bool) -> int:
        """micro_batch for a model with recurrent memory or without: by default RECURRENT_CPU_UBATCH on CPU there."""
        if recurrent and self.n_ubatch is None and not self.offloads:
            return min(self.n_batch, RECURRENT_CPU_UBATCH)
        return self.micro_batch

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


class LlamaCppDecoder(TreeDecoding):
    """One GGUF model and one llama.cpp context, driven through the low-level API: a context of its own, or a slot of
    one that several share (`slots`)."""

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
        model = self._load(opts)
        self._use_model(model)
        if self.memory.recurrent and opts.n_seq_max > 1 and opts.kv_unified is not False:
            # sequences in one cell array serve token trees, whose tokens sit in several sequences at once: recurrent
            # layers hold one state per sequence and cannot share them, and each sequence would hold a state
            notice(f"{self.path.name}: token trees are off (its memory is {self.memory.value}: recurrent layers cannot "
                   "share a token between sequences); drafts run as chains")
            self.options = opts = replace(opts, n_seq_max=1, kv_unified=None)
        try:
            context = Context(model, opts, self.memory.recurrent, self.path)
        except BaseException:
            self.close()
            raise
        super().__init__(OwnAccess(context), opts, context.n_ctx)

    def _load(self, opts: DecoderOptions) -> LlamaModel:
        remote = rpc.devices(rpc.parse_endpoints(opts.rpc)) if opts.remote else None  # may abort: see isolated.py
        with waiting(f"loading {self.path.name}", show=not opts.verbose):  # a long load shows on a terminal
            return LlamaModel(self.path, self.header, n_gpu_layers=(opts.n_gpu_layers or -1) if remote
                              else opts.n_gpu_layers, use_mmap=opts.use_mmap, use_mlock=opts.use_mlock,
                              repack=opts.repack, verbose=opts.verbose, devices=remote,
                              tensor_split=opts.tensor_split, load_mtp=opts.mtp)

    def _use_model(self, model: LlamaModel, memory: MemoryKind | None = None) -> None:
        """Decode with `model`, whose memory kind is `memory` (None: asked of llama.cpp)."""
        self.model = model
        self.vocab, self.n_vocab, self.n_embd = model.vocab, model.n_vocab, model.n_embd
        self.weight_buffers, self.cpu_backend = model.weight_buffers, model.cpu_backend
        self.memory = memory_kind(model.handle) if memory is None else memory

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
        if n == 1:  # a single stream: the context it would have of its own (its prefill in batches of n_batch)
            owner = cls(path, options)
            span, slot_options = owner.options.n_seq_max, replace(owner.options, n_ctx=owner.n_ctx)
        else:  # every slot's n_ctx // n tokens, plus a chunk each: a verification batch's transient cells
            owner = cls(path, replace(options, n_ctx=per_slot * n + n * chunk, n_batch=n * chunk, n_seq_max=n,
                                      n_ubatch=None if options.n_ubatch is None else min(options.n_ubatch, n * chunk),
                                      kv_unified=False))
            slot_options = replace(owner.options, n_ctx=per_slot, n_batch=chunk, n_seq_max=1, n_ubatch=None)
        context = owner._context()
        context.lock = lockstep.lock  # every use of the shared context holds it
        runner = SharedContext(context, owner, leads, alone=n == 1)
        return [cls._slot(owner, SlotAccess(runner, lockstep, i * span, span), slot_options) for i in range(n)]

    @classmethod
    def _slot(cls, owner: LlamaCppDecoder, access: SlotAccess, options: DecoderOptions) -> LlamaCppDecoder:
        """A decoder over the model and the open context of `owner`, reaching the context through `access`."""
        slot = cls.__new__(cls)
        slot.path, slot.header = owner.path, owner.header
        slot._use_model(owner.model, owner.memory)
        KvSequence.__init__(slot, access, options, options.n_ctx)
        return slot

    @property
    def llama_context(self):
        """The llama.cpp context (a llama_context pointer), for llama.cpp's own API: its use bypasses the history."""
        return self._context().ctx

    @property
    def shared_context(self) -> SharedContext | None:
        """The context this slot shares with the others (slots), None on a context of its own or once closed. Its
        close() frees the context and the model for every slot, once they are closed."""
        return self._access.runner

    def pad_chains(self, price: Price | None, pad_max: int) -> None:
        """How this slot's shared context runs uneven chains from now on, for every slot of it: with `price` (a
        micro-batch's seconds by its shape, e.g. CostModel.micro_seconds) chains of up to `pad_max` tokens are padded
        to one length where that costs less (micro_batches.even_lanes); price None (the default): batches run as
        submitted. GGUFSpecError on a decoder with a context of its own."""
        runner = self._access.runner
        if runner is None:
            raise GGUFSpecError("pad_chains needs a slot of a shared context (LlamaCppDecoder.slots)")
        runner.price, runner.pad_max = price, pad_max

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value of the model, as text; None when absent."""
        return self.model.metadata(key)

    @property
    def kv_cache(self) -> str:
        """The K/V cache types of this context, as kv_label spells them."""
        return kv_label(self.kv_type, self.kv_type_v)

    # --- independent sequences -------------------------------------------------------------

    def decode_sequences(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                         view: bool = False) -> np.ndarray:
        """Decode tokens of independent sequences in one batch, token i at positions[i] of sequence seq_ids[i];
        logits (n, V) of every token (hidden_states() gives theirs after it).

        Runs outside the history, for several sequences in one context (e.g. answers generated side by side):
        the history must be empty, seq_ids below n_seq_max; clear_sequence frees one sequence, reset() all.
        view=True: a read-only view of llama.cpp's buffer, valid only until this decoder's next decode.
        """
        context = self._context()
        self._require_own("decode_sequences")
        self._end_tree()
        self._require_no_history("decode_sequences")
        n = len(tokens)
        if n == 0 or len(positions) != n or len(seq_ids) != n:
            raise ValueError(f"decode_sequences needs tokens, positions and seq_ids of one length >= 1, "
                             f"got {n}, {len(positions)} and {len(seq_ids)}")
        if not all(0 <= s < self.options.n_seq_max for s in seq_ids):
            raise ValueError(f"sequence ids must be in 0..{self.options.n_seq_max - 1} (n_seq_max), got {sorted(set(seq_ids))}")
        if n > context.batch.capacity:
            raise GGUFSpecError(f"a batch of {n} tokens needs n_batch >= {n}, this context has {context.batch.capacity}")
        self._unrecorded = True  # and they stay so: not the history's, rollback_to(0) drops them too
        rc = run_steps(self._access.tree(tokens, positions, [[s] for s in seq_ids]))
        if rc != 0:
            raise GGUFSpecError(f"llama_decode failed with code {rc} on a batch of {n} tokens in sequences "
                                f"{sorted(set(seq_ids))} (raise n_ctx?)")
        self._n_out, self._skip = n, 0
        return read_only(self._access.logits(n, view), view)

    def clear_sequence(self, seq_id: int) -> None:
        """Drop every KV entry of sequence seq_id (filled by decode_sequences; the history must be empty)."""
        self._require_own("clear_sequence")
        self._require_no_history("clear_sequence")
        self._context().seq_rm(seq_id, -1, -1)

    def _require_own(self, what: str) -> None:
        if self.shared:
            raise GGUFSpecError(f"{what} needs a context of its own, not a slot of a shared one")

    def _require_no_history(self, what: str) -> None:
        if self.history:
            raise GGUFSpecError(f"{what} runs outside the history, which holds {len(self.history)} tokens: reset() first")

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context, the batch and the model; further use raises GGUFSpecError. A slot lets go of its
        shared context, which the last reference frees."""
        access = getattr(self, "_access", None)  # None: the context did not open
        if access is not None:
            access.close()
            if access.lockstep is not None:  # a slot: the model is the shared context's owner's
                return
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


def prefill(d: Decoder, context: list[int]) -> None:
    """Decode `context` into d's cache, reusing its common prefix (an empty context empties it); on recurrent memory
    its end is kept as a point to go back to (a chat's next turn reuses the prompt at least)."""
    run_steps(prefill_steps(d, context))


def prefill_steps(d: Decoder, context: list[int]) -> Steps[None]:
    """prefill as a decode coroutine."""
    if context:
        yield from d.sync_steps(context)
        d.hold(anchor=True)
    else:
        yield from d.rollback_steps(0)
