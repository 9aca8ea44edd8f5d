"""How a decoder reaches its llama.cpp context: `OwnAccess`, a context of its own that it decodes in directly, or
`SlotAccess`, a slot of a shared context whose decodes are submissions to the slots' next batch (lockstep.py). One
interface (`Access`), chosen when the decoder is made: the decoder's history logic (sequence.py) never asks which.

An access counts the decodes it makes (the Decoder clocks: decode_seconds, n_decodes, ...) and keeps the rows the
last one produced until the next.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .llama_context import Context, opened
from .lockstep import Lockstep
from .shared_context import SharedContext
from .submission import NO_BATCH, BatchShape, Steps, Submission


class Access(Protocol):
    """A decoder's way to its context. `context` is None once the decoder closed it; `seq` is the sequence that holds
    its history (its trees' leaves are the sequences after it); `lockstep` is None on a context of its own."""

    context: Context | None
    seq: int
    lockstep: Lockstep | None
    runner: SharedContext | None
    # the Decoder clocks of its decodes, only growing; a slot's last batch's shape
    decode_seconds: float
    n_decodes: int
    n_decoded_tokens: int
    n_batched_tokens: int
    last_batch: BatchShape

    def chain(self, tokens: Sequence[int], start: int, all_logits: bool, hidden: bool,
              picks: bool = False) -> Steps[int]:
        """Decode `tokens` at positions start.. of the history's sequence, with rows for every token (all_logits) or
        the last; `hidden`: their hidden states too; `picks`: each row's argmax, where the batch works them out (see
        picks). A decode coroutine (submission.Steps) that returns llama_decode's return code."""

    def tree(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]]) -> Steps[int]:
        """Decode `tokens`, each at its position in its sequences, with rows and hidden states for all of them (a
        decode coroutine, as chain)."""

    def logits(self, n_rows: int, view: bool) -> np.ndarray:
        """The last decode's n_rows rows of logits; view=True: where they are a view of llama.cpp's buffer, not
        copied (valid until the next decode)."""

    def picks(self, n_rows: int) -> np.ndarray | None:
        """The argmax of each of the last decode's last n_rows rows, where its batch worked them out (a shared one,
        asked by chain's `picks`); else None."""

    def states(self, n_out: int, skip: int) -> np.ndarray:
        """The hidden states of the last decode's n_out rows, but the first `skip`: a copy."""

    def nextn(self, n: int) -> np.ndarray:
        """The MTP hidden rows of the last decode's n tokens (options.mtp)."""

    def cut(self, start: int) -> bool:
        """Remove the history's cells from position `start` on; False where the memory cannot."""

    def clear(self) -> None:
        """Remove every cell of this decoder's sequences."""

    def keep(self, keep: int, n_leaves: int) -> None:
        """Of the history's sequence and its tree's n_leaves leaf sequences, only `keep` stays."""

    def close(self) -> None:
        """Let go of the context (a context of its own is freed)."""


class OwnAccess:
    """A context of one's own: each decode fills its batch and runs it, timed and counted here; its rows are read
    from llama.cpp's buffers. Its history is sequence 0; other sequences hold trees' leaves or decode_sequences'."""

    seq = 0
    lockstep = runner = None
    last_batch = NO_BATCH

    def __init__(self, context: Context) -> None:
        self.context: Context | None = context
        self.decode_seconds = 0.0
        self.n_decodes = self.n_decoded_tokens = self.n_batched_tokens = 0

    def chain(self, tokens: Sequence[int], start: int, all_logits: bool, hidden: bool,
              picks: bool = False) -> Steps[int]:
        self.context.batch.fill(tokens, start, all_logits)
        return self._run(len(tokens), hidden)
        yield  # never reached: a context of its own decodes at once

    def tree(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]]) -> Steps[int]:
        batch = self.context.batch
        batch.fill_tree(tokens, positions, seq_ids)
        rc = self._run(len(tokens), True)
        batch.reset_sequences()
        return rc
        yield  # never reached: a context of its own decodes at once

    def _run(self, n_tokens: int, hidden: bool) -> int:
        t0 = time.perf_counter()
        try:
            return self.context.run(n_tokens, hidden, may_abort=True)
        finally:
            self.decode_seconds += time.perf_counter() - t0
            self.n_decodes += 1
            self.n_decoded_tokens += n_tokens
            self.n_batched_tokens += n_tokens

    def logits(self, n_rows: int, view: bool) -> np.ndarray:
        rows = self.context.logits(n_rows)
        return rows if view else rows.copy()

    def picks(self, n_rows: int) -> np.ndarray | None:
        return None  # the rows are read right after their decode: the reader takes their argmax

    def states(self, n_out: int, skip: int) -> np.ndarray:
        return opened(self.context).states(n_out)[skip:].copy()

    def nextn(self, n: int) -> np.ndarray:
        return self.context.nextn(n)

    def cut(self, start: int) -> bool:
        # every sequence: the tree sequences went before (a rollback ends the tree), decode_sequences' go with it
        return self.context.seq_rm(-1, start, -1)

    def clear(self) -> None:
        self.context.clear()

    def keep(self, keep: int, n_leaves: int) -> None:
        self.context.seq_keep(keep)  # one pass over the cache; there is no other slot

    def close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None


class SlotAccess:
    """A slot of a shared context (LlamaCppDecoder.slots): its sequences are `seq` (the history) and the span - 1
    after it (its trees' leaves); each decode is its part of the next shared batch, submitted through `lockstep` to
    `runner`, its rows handed back (submission.Submission); every KV edit holds the lockstep's lock (Context.lock)."""

    def __init__(self, runner: SharedContext, lockstep: Lockstep, seq: int, span: int) -> None:
        self.runner: SharedContext | None = runner
        self.context: Context | None = runner.context
        self.lockstep, self.seq, self.span = lockstep, seq, span
        self.decode_seconds = 0.0
        self.n_decodes = self.n_decoded_tokens = self.n_batched_tokens = 0
        self.last_batch = NO_BATCH
        self._sub: Submission | None = None  # the last decode, with its rows

    def chain(self, tokens: Sequence[int], start: int, all_logits: bool, hidden: bool,
              picks: bool = False) -> Steps[int]:
        n = len(tokens)
        return (yield from self._submit(tokens, range(start, start + n), [[self.seq]] * n,
                                        [all_logits or i == n - 1 for i in range(n)], hidden, picks))

    def tree(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]]) -> Steps[int]:
        return (yield from self._submit(tokens, positions, seq_ids, [True] * len(tokens), True))

    def _submit(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                outputs: Sequence[bool], hidden: bool, picks: bool = False) -> Steps[int]:
        """This slot's part of the next shared batch; llama_decode's return code."""
        sub = Submission(tokens, positions, seq_ids, outputs, hidden, picks, self.seq, lockstep=self.lockstep,
                         runner=self.runner)
        try:
            yield sub
        finally:
            self.decode_seconds += sub.seconds
            self.n_decodes += 1
            self.n_decoded_tokens += len(tokens)
            self.n_batched_tokens += sub.shape.tokens
            self.last_batch = sub.shape
        self._sub = sub
        return sub.rc

    def logits(self, n_rows: int, view: bool) -> np.ndarray:
        rows = self._sub.logits  # the rows it asked for, n_rows of them: a view of the shared batch's
        return rows if view else rows.copy()

    def picks(self, n_rows: int) -> np.ndarray | None:
        picks = self._sub.picks
        return picks[len(picks) - n_rows:] if picks is not None else None

    def states(self, n_out: int, skip: int) -> np.ndarray:
        return self._sub.states[skip:]

    def nextn(self, n: int) -> np.ndarray:
        return self._sub.nextn

    def cut(self, start: int) -> bool:
        return self.context.seq_rm(self.seq, start, -1)  # its own sequence (its tree sequences went with the tree)

    def clear(self) -> None:
        self.context.drop(range(self.seq, self.seq + self.span))

    def keep(self, keep: int, n_leaves: int) -> None:
        if self.runner.alone:  # every sequence of the context is this slot's: one pass over the cache
            self.context.seq_keep(keep)
        else:
            self.context.drop(s for s in range(self.seq, self.seq + n_leaves + 1) if s != keep)

    def close(self) -> None:
        """Let go of the shared context: the last reference frees it (or SharedContext.close)."""
        self.context = self.runner = None
