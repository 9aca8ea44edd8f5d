"""`KvSequence`: a token history whose KV entries live in a llama.cpp context, reached through an Access (access.py):
feeding tokens appends them, rolling back removes their entries, a shift slides them, and on recurrent memory a
rollback's tokens that cannot be undone are decoded again (deferred to the next feed). Every position is decoded
once unless rolled back. LlamaCppDecoder (decoder.py) is one, with token trees (tree_decoding.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .access import Access
from .llama_context import Context, opened
from .errors import ContextLengthError, GGUFSpecError
from .history import common_prefix
from .lockstep import LockstepSlot
from .mtp import HiddenRows
from .recurrent import Rewind, Rollbacks
from .submission import Steps, run_steps

if TYPE_CHECKING:
    from .decoder import DecoderOptions
    from .tree_decoding import TreeLayout

# Tokens a rollback on recurrent memory leaves to decode again (from a checkpoint, or cleared) ride in front of the
# next feed up to this many (a verification chain's worth); more are decoded at once, without logits
REDECODE_NOW = 16


def _clock(name: str) -> property:
    return property(lambda self: getattr(self._access, name), doc=f"Decoder.{name}, as this decoder's access counts it.")


def read_only(rows: np.ndarray, view: bool) -> np.ndarray:
    """`rows` as a caller of a plain call gets them: a view of llama.cpp's buffer flagged read-only (a copy as it is)."""
    if view:
        rows = rows.view()
        rows.flags.writeable = False
    return rows


class KvSequence(LockstepSlot):
    """The history (`history`) of one KV sequence of a context, reached through `access`, with `options` and a limit
    of `n_ctx` tokens; `_seq` is its sequence id there (LockstepSlot's lane)."""

    decode_seconds = _clock("decode_seconds")
    n_decodes = _clock("n_decodes")
    n_decoded_tokens = _clock("n_decoded_tokens")
    n_batched_tokens = _clock("n_batched_tokens")
    last_batch = _clock("last_batch")

    def __init__(self, access: Access, options: DecoderOptions, n_ctx: int) -> None:
        context = access.context
        self._access = access
        self._seq, self._lockstep = access.seq, access.lockstep
        self.options, self.n_ctx = options, n_ctx
        self.kv_type, self.kv_type_v = context.kv_type, context.kv_type_v
        self.n_ubatch: int = context.n_ubatch
        self.n_rs_seq: int = context.n_rs_seq
        # with options.mtp: the rows its MTP head reads (mtp.py)
        self.hidden_rows = HiddenRows(context.nextn_width) if context.nextn_width is not None else None
        self.history: list[int] = []
        self.shift_keep: int | None = None  # set: a feed that overflows shifts the context instead of failing
        self.n_shifts = 0
        self.hold_seconds = 0.0  # recurrent memory: saving and restoring checkpoints (recurrent.Rewind), a clock
        self._n_out = 0  # rows of hidden states the last decode computed
        self._skip = 0  # leading rows of the last decode that were deferred tokens, not asked for
        self._deferred: list[int] = []
        self._unrecorded = False  # a decode's cells may be in the KV cache without being in the history
        self._tree: TreeLayout | None = None
        self._tree_pre: list[int] = []  # deferred tokens decoded in front of the pending tree
        # recurrent memory: how the history's sequence goes back; None on attention memory (any rollback is free)
        self._rewind = Rewind(context.ctx, self._seq, self.n_rs_seq, self.n_ubatch) if context.recurrent else None

    @property
    def rollbacks(self) -> Rollbacks | None:
        """How this decoder's rollbacks went on recurrent memory (counts, only growing); None on attention memory."""
        return self._rewind.counts if self._rewind is not None else None

    @property
    def shared(self) -> bool:
        """Whether this decoder is a slot of a shared context."""
        return self._lockstep is not None

    @property
    def n_deferred(self) -> int:
        return len(self._deferred)

    def _context(self) -> Context:
        """The context, open; GGUFSpecError once this decoder is closed."""
        return opened(self._access.context)

    # --- decoding -------------------------------------------------------------------------

    # each call that may decode is a decode coroutine (submission.Steps: a pool's tasks run them) and a plain call; the
    # plain calls' views are flagged read-only, the coroutines' (the engine's own reads) not: numpy's argmax took 2.5
    # times as long on a read-only array
    def feed(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False) -> np.ndarray:
        return read_only(run_steps(self.feed_steps(tokens, all_logits, view)), view)

    def sync(self, tokens: Sequence[int], view: bool = False) -> np.ndarray:
        return read_only(run_steps(self.sync_steps(tokens, view)), view)

    def rollback_to(self, n: int) -> None:
        return run_steps(self.rollback_steps(n))

    def feed_steps(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False,
                   picks: bool = False) -> Steps[np.ndarray]:
        if len(tokens) == 0:
            raise ValueError("feed needs at least one token")
        if self._tree is not None:
            self._end_tree()
        pre = self._take_deferred() if self._deferred else []
        base = len(self.history)
        try:
            rows = yield from self._feed([*pre, *tokens] if pre else tokens, all_logits, view, picks)
        except BaseException:
            self._restore_deferred(pre, base)
            raise
        self._skip = len(pre) if all_logits and len(pre) + len(tokens) <= self.options.n_batch else 0
        return rows[len(pre):] if all_logits and pre else rows

    def _feed(self, tokens: Sequence[int], all_logits: bool, view: bool, picks: bool = False) -> Steps[np.ndarray]:
        n = len(tokens)
        if len(self.history) + n > self.n_ctx:
            if self.shift_keep is None:
                raise ContextLengthError(
                    f"{len(self.history) + n} tokens do not fit the context of {self.n_ctx} tokens (raise --n-ctx)."
                )
            self.shift(n)
        step = self.options.n_batch
        if n <= step:  # one batch (every step of a generation)
            yield from self._decode(tokens, all_logits, picks)
            return self._access.logits(n if all_logits else 1, view)
        rows = []
        for start in range(0, n, step):
            chunk = tokens[start : start + step]
            last_chunk = start + step >= n
            yield from self._decode(chunk, all_logits)
            if all_logits or last_chunk:
                rows.append(self._access.logits(len(chunk) if all_logits else 1, view and last_chunk))
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _decode(self, tokens: Sequence[int], all_logits: bool, picks: bool = False) -> Steps[None]:
        self._context()
        hidden = all_logits or len(tokens) == 1
        # until the history records the tokens, the cache may hold cells it does not (see rollback_to)
        self._unrecorded = True
        rc = yield from self._access.chain(tokens, len(self.history), all_logits, hidden, picks)
        if rc != 0:
            # llama.cpp leaves no partial batch in the KV on failure; the history stays as it was.
            raise GGUFSpecError(f"llama_decode failed with code {rc} at position {len(self.history)}")
        if self.hidden_rows is not None:
            self.hidden_rows.put(len(self.history), self._access.nextn(len(tokens)))
        self.history.extend(map(int, tokens))
        self._unrecorded = False
        if self._rewind is not None:
            self._rewind.decoded(len(tokens))
        self._n_out = len(tokens) if hidden else 0  # hidden: every token's row, or the one token's
        self._skip = 0

    def sync_steps(self, tokens: Sequence[int], view: bool = False) -> Steps[np.ndarray]:
        tokens = list(tokens)
        if not tokens:
            raise ValueError("sync needs at least one token")
        keep = min(common_prefix(self.history, tokens), len(tokens) - 1)  # re-decode one token for its logits
        yield from self.rollback_steps(keep)
        return (yield from self.feed_steps(tokens[keep:], all_logits=False, view=view))

    def picks(self, n_rows: int) -> np.ndarray | None:
        return self._access.picks(n_rows)

    def hidden_states(self) -> np.ndarray:
        if not self.options.embeddings:
            raise GGUFSpecError("hidden states need a decoder created with embeddings=True")
        if not self._n_out:
            raise GGUFSpecError("the last decode computed no hidden states (a prefill for the last token's logits)")
        return self._access.states(self._n_out, self._skip)

    # --- going back -----------------------------------------------------------------------

    def shift(self, room: int) -> None:
        """Context shift: drop the older half of the history after its first `shift_keep` tokens (at
        least enough to make `room`), sliding the rest down in place, as llama.cpp's --context-shift does."""
        keep, n = self.shift_keep or 0, len(self.history)
        discard = max((n - keep) // 2, n + room - self.n_ctx)
        if keep + discard > n or room > self.n_ctx - keep:
            raise ContextLengthError(f"{room} tokens do not fit after the {keep} kept ones in a context of {self.n_ctx}.")
        context = self._context()
        if not context.can_shift():
            raise GGUFSpecError("this model's cache cannot shift positions; use a larger --n-ctx instead.")
        with context.lock:
            context.seq_rm(self._seq, keep, keep + discard)
            context.seq_add(self._seq, keep + discard, -1, -discard)
            if self._rewind is not None:  # its snapshots and checkpoints hold the positions before the shift
                self._rewind.forget()
        if self.hidden_rows is not None:
            self.hidden_rows.shift(keep, discard)
        del self.history[keep : keep + discard]
        self.n_shifts += 1

    def rollback_steps(self, n: int) -> Steps[None]:
        if not 0 <= n <= len(self.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(self.history)} tokens")
        self._end_tree()
        if self.hidden_rows is not None:  # deferred tokens keep theirs: the same tokens after the same ones
            self.hidden_rows.cut(n)
        cached = len(self.history) - len(self._deferred)
        if self._rewind is not None:
            yield from self._rewind_to(n, cached)
            return
        # _unrecorded: a decode was interrupted (Ctrl-C lands right after llama_decode returns) before the
        # history recorded it, so cells past the history may hold its tokens; any tree sequences go with them
        if n < cached or self._unrecorded:
            self._context()
            if not self._access.cut(min(n, cached)):
                raise GGUFSpecError("this model's memory cannot be rolled back partially (recurrent model?)")
            self._unrecorded = False
        del self._deferred[max(n - cached, 0):]
        del self.history[n:]

    def _rewind_to(self, n: int, cached: int) -> Steps[None]:
        """rollback_to on recurrent memory: the tokens of history[:n] that its snapshot or checkpoint does not hold
        (recurrent.Rewind.back) are deferred to the next feed, or decoded now where they are more than a verification
        batch's worth (a prefix reused from far back: the next feed may want every row's logits)."""
        context = self._context()
        if n < cached or self._unrecorded:
            with context.lock:
                held = self._rewind.back(cached, n, known=not self._unrecorded)
                self.hold_seconds += self._rewind.seconds
                self._rewind.seconds = 0.0
            self._unrecorded = False
            again = self.history[held:n]
            del self.history[held:]
            self._deferred = []
            if len(again) > REDECODE_NOW:
                yield from self._feed(again[:-REDECODE_NOW], all_logits=False, view=True)
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
        with self._context().lock:
            self._rewind.hold(len(self.history) - len(self._deferred), undo, anchor,
                              len(self._deferred) + (undo or 0) + 1)
            self.hold_seconds += self._rewind.seconds
            self._rewind.seconds = 0.0

    def reset(self) -> None:
        """Forget the whole history."""
        if self._rewind is not None:
            self._rewind.forget()
        self._context()
        self._access.clear()
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

    def _end_tree(self) -> None:
        """Drop an uncommitted tree (tree_decoding.py) from the cache: the history is as it was before tree_logits."""
        if self._tree is not None:
            self._access.keep(self._seq, self._tree.n_leaves)  # the tree's cells are in its leaves' sequences only
            self._deferred = self._tree_pre
            self._tree, self._tree_pre = None, []

    def kv_positions(self, seq_id: int = 0) -> tuple[int, int]:
        """Lowest and highest position the KV cache holds for sequence seq_id, (-1, -1) when none; sequence 0
        holds the history."""
        return self._context().positions(self._seq + seq_id)
