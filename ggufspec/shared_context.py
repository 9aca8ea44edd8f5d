"""`SharedContext`: the llama.cpp context that a decoder's slots share (LlamaCppDecoder.slots), run as a
submission.Runner: one tick's submissions, every slot's, as ONE batch, each slot's rows handed back to its submission
(views of llama.cpp's buffer, valid until the context's next batch: no slot decodes again before it has read them,
as on a context of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .llama_context import Context
from .errors import GGUFSpecError
from .micro_batches import Price, even_lanes
from .submission import Submission

if TYPE_CHECKING:
    from .decoder import LlamaCppDecoder

# a batch's entries: tokens, positions, sequence ids and outputs, one each per token
Entries = tuple[Sequence[int], Sequence[int], Sequence[Sequence[int]], Sequence[bool]]
# the sequences in batch order, each with its submission (None: an idle sequence, padded)
Order = list[tuple[int, Submission | None]]


class SharedContext:
    """The context the slots share: runs one tick's submissions as one batch (submission.Runner). `owner` opened it:
    closing the owner frees the context and the model, for every slot (`close`)."""

    def __init__(self, context: Context, owner: LlamaCppDecoder, leads: bool = False, alone: bool = False) -> None:
        """`alone`: the context's only slot (a single stream's), whose prefill Ctrl-C may cut short (Context.run)."""
        self.context, self.owner, self.leads, self.alone = context, owner, leads, alone
        # a micro-batch's price by its shape (EnginePool sets the measured one): uneven chains of up to pad_max
        # tokens are padded to one length where that costs less (micro_batches.even_lanes); None: batches run as
        # submitted
        self.price: Price | None = None
        self.pad_max = 0

    def close(self) -> None:
        """Free the context and the model (after every slot closed)."""
        self.owner.close()

    def run(self, subs: list[Submission]) -> tuple[int, ...]:
        if len(subs) == 1:
            return self._run_one(subs[0])
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
        # in sequence order, as llama.cpp takes consecutive sequences into one micro-batch; padded, every sequence up
        # to the last one's (an idle one's submission None)
        by_seq = {s.lane: s for s in subs}
        order = [(seq, by_seq.get(seq)) for seq in range(len(ran))] if ran is not None else [(s.lane, s) for s in subs]
        entries, padded = self._entries(subs, order, ran)
        n = len(entries[0])
        hidden = self.context.embeddings and any(s.hidden for s in subs)
        rc = self._decode(entries, hidden)
        for s in subs:
            s.rc = rc
        for seq, end in padded:  # the pads' cells go: each sequence is as if its own tokens had run alone
            self.context.seq_rm(seq, end, -1)
        if rc == 0:
            self._hand_back(subs, order, ran, n, hidden)
        return ran or tuple(lanes)

    def _run_one(self, sub: Submission) -> tuple[int, ...]:
        """A batch of one submission (a single stream's every batch): its own entries, no pads."""
        n = len(sub.tokens)
        hidden = sub.hidden and self.context.embeddings
        sub.rc = self._decode((sub.tokens, sub.positions, sub.seq_ids, sub.outputs), hidden)
        if sub.rc == 0:
            self._hand_back([sub], [(sub.lane, sub)], None, n, hidden)
        return (0,) * sub.lane + (n,)

    def _padded_lanes(self, subs: list[Submission], lanes: list[int]) -> tuple[int, ...] | None:
        """The tokens each sequence runs, pads included, where padding makes the batch of `lanes` (tokens by sequence)
        cheaper (subs sorted by sequence; an idle sequence below the last one may be padded too); None: no pads. A
        slot is one sequence of this context (EnginePool sets price only so)."""
        seqs = {s.lane for s in subs}
        one_each = len(seqs) == len(subs) and all(len(ids) == 1 for s in subs for ids in s.seq_ids)  # chains, no trees
        if self.price is None or len(seqs) < 2 or not one_each or self.context.recurrent:
            return None  # (recurrent memory: removing a pad would be a second rollback, which llama.cpp refuses)
        even = even_lanes(lanes, self.price, self.pad_max)
        return None if even == tuple(lanes) else even

    def _entries(self, subs: list[Submission], order: Order,
                 ran: tuple[int, ...] | None) -> tuple[Entries, list[tuple[int, int]]]:
        """The batch's entries in `order`, each sequence's pads after its tokens; and (sequence, its first pad's
        position) of each padded one."""
        tokens, positions, seq_ids, outputs = [], [], [], []
        padded: list[tuple[int, int]] = []
        for seq, s in order:
            if s is not None:
                tokens += s.tokens
                positions += s.positions
                seq_ids += s.seq_ids
                outputs += s.outputs
            pad = ran[seq] - (len(s.tokens) if s is not None else 0) if ran is not None else 0
            if pad:  # past the sequence's last position (an idle one's cached tokens), unread
                end = s.positions[-1] + 1 if s is not None else self.context.pos_max(seq) + 1
                tokens += [subs[0].tokens[-1]] * pad
                positions += range(end, end + pad)
                seq_ids += [[seq]] * pad
                outputs += [False] * pad
                padded.append((seq, end))
        return (tokens, positions, seq_ids, outputs), padded

    def _decode(self, entries: Entries, hidden: bool) -> int:
        """One llama_decode of `entries`; its return code."""
        batch, n = self.context.batch, len(entries[0])
        if n > batch.capacity:  # cannot happen: each slot submits at most its n_batch, and pads fit beside it
            raise GGUFSpecError(f"a shared batch of {n} tokens exceeds its capacity {batch.capacity}")
        batch.fill_entries(*entries)
        # the submissions' seconds include the computation (Context.run synchronizes); no abort check in a batch that
        # other slots' steps may share
        rc = self.context.run(n, hidden, may_abort=self.alone)
        batch.reset_sequences()
        return rc

    def _hand_back(self, subs: list[Submission], order: Order, ran: tuple[int, ...] | None, n: int,
                   hidden: bool) -> None:
        """Each submission's rows of the batch's n tokens' outputs: views of the logits and MTP rows (valid until the
        next batch, which no slot of this tick runs before it has read its own), copies of the hidden states."""
        context = self.context
        # every token's hidden row, in batch order: each submission's own, its pads after
        if context.nextn_width is not None:
            rows, at = context.nextn(n), 0
            for seq, s in order:
                if s is not None:
                    s.nextn = rows[at : at + len(s.tokens)]
                at += ran[seq] if ran is not None else len(s.tokens)
        # llama.cpp keeps the output rows in batch order, each submission's together: one view of the batch, a slice
        # each (a view and a stack per row cost several times as much, on every tick)
        counts = [sum(map(bool, s.outputs)) for s in subs]
        n_out = sum(counts)
        logits = context.logits(n_out)
        states = context.states(n_out) if hidden else None
        row = 0
        for s, k in zip(subs, counts):
            s.logits = logits[row : row + k]
            if s.argmax:  # a greedy reader's picks now: read after the other slots' steps, a row was out of cache
                s.picks = s.logits.argmax(axis=1)
            if hidden and s.hidden:
                s.states = states[row : row + k].copy()
            row += k
