"""Rolling back a recurrent state: llama.cpp's snapshot rules, and the checkpoints that undo what they cannot.

Hybrid and recurrent models (Qwen3.5/3.6 `qwen35`, LFM2, Nemotron-H, Mamba, Granite 4, ...) keep part of their
memory as a state that every token overwrites, which `llama_memory_seq_rm` cannot simply cut back. llama.cpp offers
two ways back, both used here, per KV sequence:

- **Snapshots** (the context parameter `n_rs_seq`, for the architectures in llama.cpp's
  `llm_arch_supports_rs_rollback`; it sets the parameter back to 0 for the others): a decode keeps the states after
  each of its last `n_rs_seq` tokens, and a partial `seq_rm` of r tokens restores one (src/llama-memory-recurrent.cpp).
  Rules, checked in the source and on real models: r <= n_rs_seq; r less than the tokens the sequence had in its last
  micro-batch (going further back returns true and leaves a wrong state: the logits were off by 3 to 40 on tiny
  lfm2 and qwen35 models); one rollback between two decodes (a second returns false); the sequence's own id
  (-1 is refused). llama.cpp keeps the last n_rs_seq + 1 tokens of a sequence in one micro-batch, except where every
  token of a batch has outputs (then it splits by n_ubatch).
- **Checkpoints**: the sequence's recurrent state copied out (`llama_state_seq_get_data_ext` with
  LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, as llama-server's speculative checkpoints) and back. Restoring one at length L
  leaves the tokens between L and the rollback's target to be decoded again: the decoder defers them into its next
  batch, where they cost far less than a pass of their own.

Where neither reaches, the sequence is cleared and its tokens decoded again: slow, never wrong.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from enum import Enum

import llama_cpp

from .errors import GGUFSpecError

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # the recurrent (and sliding-window) part of a sequence only
# The most snapshots a target keeps (each a copy of its recurrent state, per sequence): longer chains (lookup's copies)
# are undone from a checkpoint instead
SNAPSHOTS_MAX = 16


class MemoryKind(str, Enum):
    """What a model's memory holds, as `doctor` names it."""

    ATTENTION = "attention"  # a KV cache: any rollback is free
    SWA = "swa"  # a KV cache with sliding-window layers
    HYBRID = "hybrid"  # attention layers and recurrent ones (conv, Mamba, gated delta net)
    RECURRENT = "recurrent"  # recurrent layers only

    @property
    def recurrent(self) -> bool:
        """Whether part of the memory is a state that rollbacks must restore."""
        return self in (MemoryKind.HYBRID, MemoryKind.RECURRENT)


def memory_kind(model) -> MemoryKind:
    """The memory kind of a loaded llama.cpp model (its llama_model pointer)."""
    if llama_cpp.llama_model_is_hybrid(model):
        return MemoryKind.HYBRID
    if llama_cpp.llama_model_is_recurrent(model):
        return MemoryKind.RECURRENT
    return MemoryKind.SWA if llama_cpp.llama_model_n_swa(model) > 0 else MemoryKind.ATTENTION


def rollback_in_use(kind: MemoryKind, n_rs_seq: int, asked: int) -> str:
    """How a model's rollbacks are done, as `doctor` says it: its memory kind, the snapshots it got (`n_rs_seq` of
    the `asked`), the checkpoints beyond them."""
    if not kind.recurrent:
        return f"{kind.value}: rollbacks remove KV cells, free"
    if n_rs_seq:
        return (f"{kind.value}: rollbacks of up to {n_rs_seq} tokens of a batch by snapshots (n_rs_seq), longer ones "
                "and single-token decodes from a checkpoint of the recurrent state")
    why = (" (llama.cpp keeps no snapshots for this architecture)" if asked else
           " (a draft model's single-token guesses: snapshots cannot undo them)")
    return f"{kind.value}: rollbacks from a checkpoint of the recurrent state{why}"


def snapshots_for(n_rs_seq: int, n_ubatch: int) -> int:
    """The n_rs_seq a context can be given: llama.cpp keeps a sequence's last n_rs_seq + 1 tokens in one micro-batch,
    and aborts where that does not leave a token to spare (llama_batch_allocr::split_equal)."""
    return max(0, min(n_rs_seq, n_ubatch - 2))


@dataclass
class Rollbacks:
    """How one sequence's rollbacks went: by snapshot, from a checkpoint (and checkpoints saved), or by decoding the
    sequence again from its start (no checkpoint below the target)."""

    snapshots: int = 0
    saves: int = 0
    restores: int = 0
    replays: int = 0


@dataclass
class Checkpoint:
    """A sequence's recurrent state when the memory held `length` tokens of it."""

    length: int
    data: ctypes.Array
    size: int


class Rewind:
    """One KV sequence's way back on recurrent memory: what its snapshots undo, its checkpoints, and the rollback.

    The owner (a decoder) reports every decode of the sequence (`decoded`) and asks for rollbacks (`back`); it holds
    the shared context's lock around both where slots share one. Two checkpoints at most: the `anchor`, at the end of
    the last prompt (prefix reuse goes back to it: a chat's next turn, the server's next request in a slot), and the
    `step`'s, taken before speculative decodes that snapshots cannot undo (a draft model's single tokens, chains
    longer than n_rs_seq)."""

    def __init__(self, ctx, seq: int, n_rs_seq: int, n_ubatch: int) -> None:
        self.ctx, self.mem, self.seq = ctx, llama_cpp.llama_get_memory(ctx), seq
        self.n_rs_seq, self.n_ubatch = n_rs_seq, n_ubatch
        self._reach = 0  # tokens the snapshots of the last decode may undo (0 after a rollback: single use)
        self.anchor: Checkpoint | None = None
        self.step: Checkpoint | None = None
        self.seconds = 0.0  # spent saving and restoring checkpoints (the decoder's hold_seconds take it)
        self.counts = Rollbacks()

    def decoded(self, n: int) -> None:
        """The sequence's last decode had n tokens."""
        self._reach = self.reach_of(n)

    def reach_of(self, n: int) -> int:
        """Tokens the snapshots of a decode of n tokens may undo: up to n_rs_seq, keeping at least one token of its
        last micro-batch (split as llama.cpp splits it: by n_ubatch where every token has outputs, else with the last
        n_rs_seq + 1 tokens together)."""
        tail = min(n, self.n_rs_seq + 1, (n - 1) % self.n_ubatch + 1)
        return min(self.n_rs_seq, tail - 1)

    def reach(self) -> int:
        """Tokens a rollback may undo now by snapshot (0 after a rollback: they are single-use)."""
        return self._reach

    def hold(self, length: int, undo: int | None = None, anchor: bool = False, next_tokens: int = 0) -> None:
        """Make a later rollback to `length` tokens or more (the memory holds `length` now) cheap. `undo`: the next
        decode, of `next_tokens` tokens, will be rolled back by at most that many: its snapshots do that where they
        reach; None: any number, over any decodes. `anchor`: keep it until a rollback goes below it (a prompt's end),
        rather than until the next hold."""
        if undo is not None and undo <= self.reach_of(next_tokens):
            return
        for cp in (self.step, self.anchor):
            if cp is not None and cp.length == length:  # the state at `length` is saved already
                if anchor:
                    self.anchor = cp
                return
        if anchor:
            self.anchor = self._save(length, self.anchor if self.anchor is not self.step else None)
        else:
            self.step = self._save(length, self.step if self.step is not self.anchor else None)

    def back(self, cached: int, n: int, known: bool = True) -> int:
        """Make the sequence hold its first n of `cached` tokens where it can; return how many it holds: n (by
        snapshot), a checkpoint's length below n (restored), or 0 (cleared). The caller decodes the rest again.
        known=False: the memory may hold a decode the caller did not record (interrupted): no snapshot then."""
        for cp in (self.step, self.anchor):  # a checkpoint past n describes tokens going away now
            if cp is not None and cp.length > n:
                self._drop(cp)
        r = cached - n
        if known and 0 < r <= self._reach:
            if not llama_cpp.llama_memory_seq_rm(self.mem, self.seq, n, -1):  # cannot happen: the rules allow it
                raise GGUFSpecError(f"llama.cpp refused a rollback of {r} tokens within n_rs_seq={self.n_rs_seq}")
            self._reach = 0
            self.counts.snapshots += 1
            return n
        self._reach = 0
        best = max((cp for cp in (self.step, self.anchor) if cp is not None), key=lambda cp: cp.length, default=None)
        if best is not None:
            self._restore(best)
            return best.length
        llama_cpp.llama_memory_seq_rm(self.mem, self.seq, -1, -1)  # a whole sequence always goes
        self.counts.replays += n > 0
        return 0

    def forget(self) -> None:
        """The sequence was emptied: no snapshot, no checkpoint."""
        self._reach = 0
        self.anchor = self.step = None

    def _save(self, length: int, reuse: Checkpoint | None) -> Checkpoint:
        t0 = time.perf_counter()
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, self.seq, PARTIAL)
        data = reuse.data if reuse is not None and reuse.size == size else (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data_ext(self.ctx, data, size, self.seq, PARTIAL)
        if written != size:
            raise GGUFSpecError(f"llama.cpp wrote {written} of {size} bytes of a recurrent state (out of memory?)")
        self.seconds += time.perf_counter() - t0
        self.counts.saves += 1
        return Checkpoint(length, data, size)

    def _restore(self, cp: Checkpoint) -> None:
        t0 = time.perf_counter()
        if llama_cpp.llama_state_seq_set_data_ext(self.ctx, cp.data, cp.size, self.seq, PARTIAL) != cp.size:
            raise GGUFSpecError("llama.cpp could not restore a recurrent state it saved")
        # the attention layers' cells past the checkpoint (a hybrid's); its recurrent cell is at length - 1 now
        llama_cpp.llama_memory_seq_rm(self.mem, self.seq, cp.length, -1)
        self.seconds += time.perf_counter() - t0
        self.counts.restores += 1

    def _drop(self, cp: Checkpoint) -> None:
        if cp is self.step:
            self.step = None
        if cp is self.anchor:
            self.anchor = None
