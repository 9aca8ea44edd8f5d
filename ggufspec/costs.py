"""What a target pass and a draft token cost on this machine: measured, cached per machine, corrected in use.

On CPUs the target's cost for a batch of n tokens is far from n times one token, and it depends
on the CPU as much as on the weight type (llama.cpp repacks Q4_0 and Q8_0 for small batches, and a CPU's
matrix kernels decide what a 4-token batch costs against one token: docs/cpu-kernels.md), so the
best draft length is found by measuring, not assumed.
"""

from __future__ import annotations

import bisect
import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from .decoder import Decoder, LlamaCppDecoder
from .lockstep import Lockstep, padded_seconds
from .waiting import waiting
# the cache files and the machine key: machine_cache, shared with kv_cache (costs_path stays importable from here)
from .machine_cache import costs_path, machine, notice, read_entry, write_table
from .machine_cache import json_type as _json_type

# Costs are learned per context size: up to this many cached tokens, twice as many, four times... A batch attends to
# the whole context, and past this many cached tokens llama.cpp's CPU flash attention decodes a batch with other
# kernels than one token, so a batch's price against a decode changes with the context, and what a long prompt
# teaches must not price a short one. docs/methods.md#measured-constants: CONTEXT_SIZE
CONTEXT_SIZE = 256
# Long batches measured for prompt lookup's long guesses (where the text copies its context): the draft
# lengths they hold are one less. At most llama.cpp's CPU micro-batch (decoder.CPU_UBATCH), so one pass.
LONG_BATCHES = (16, 32, 64)
# The MTP head's catch-up batch measure() times: the committed tokens of a few steps (its price per token is what
# `auto` charges for text the head has not read)
MTP_CATCH_UP = 16


@dataclass
class CostModel:
    """verify[n-1]: seconds for the target to decode n tokens with all logits; draft: one draft token;
    long_verify[i]: a batch of long_sizes[i] tokens (sizes past verify's; between them, interpolated);
    draft_batches[i]: a draft batch of draft_sizes[i] tokens (a pool's slots drafting together), one each;
    slot_verify[w-1]: a batch of w tokens in each of `slots` sequences (a pool's steps; measure_together);
    shapes[(seqs, w)]: a micro-batch of w tokens in each of fewer sequences, as the pool's ticks ran it (observe).
    All but slot_verify and shapes are one sequence's tokens, as measure() times them.
    On recurrent memory (recurrent.py): hold, the target's checkpoint (saved and restored), which a step pays whose
    chain is longer than its `snapshots` undo; draft_hold, the draft model's, which a step drafting 2 tokens or more
    pays (its snapshots never undo single-token decodes). Both 0 on attention memory. Each is charged whole, an upper
    bound: a restore happens only after a rejection.
    With the target's MTP head (mtp.py): mtp, one of its draft steps; mtp_catch_up, a token of a batch catching up on
    committed text (one layer, no logits: far less than a step); mtp_batches[i], a pool's MTP batch of mtp_sizes[i]
    tokens. MtpPrices prices the head as the draft."""

    verify: list[float]
    draft: float
    long_sizes: list[int] = field(default_factory=list)
    long_verify: list[float] = field(default_factory=list)
    draft_sizes: list[int] = field(default_factory=list)
    draft_batches: list[float] = field(default_factory=list)
    slots: int = 0
    slot_verify: list[float] = field(default_factory=list)
    shapes: dict[tuple[int, int], float] = field(default_factory=dict)  # learned in use, never cached
    hold: float = 0.0
    snapshots: int = 0
    draft_hold: float = 0.0
    mtp: float = 0.0
    mtp_catch_up: float = 0.0
    mtp_sizes: list[int] = field(default_factory=list)
    mtp_batches: list[float] = field(default_factory=list)
    # the last shared target and draft batches whose prices were learned (observe); not fields: never cached or copied
    _tick = _draft_tick = -1

    def __post_init__(self) -> None:
        # micro_seconds' and padded_seconds' prices until the model learns (replaced then, never cleared: a price
        # worked out meanwhile goes to the old one): a pool's slots price the same few batches, several lengths
        # each, every step
        self._prices: dict[tuple, float] = {}

    def copy(self) -> CostModel:
        """An independent copy, of the same class (a subclass may price or learn differently)."""
        return replace(self, verify=list(self.verify), long_sizes=list(self.long_sizes),
                       long_verify=list(self.long_verify), draft_sizes=list(self.draft_sizes),
                       draft_batches=list(self.draft_batches), slot_verify=list(self.slot_verify),
                       shapes=dict(self.shapes), mtp_sizes=list(self.mtp_sizes), mtp_batches=list(self.mtp_batches))

    @property
    def shared(self) -> bool:
        """Whether other slots' tokens ride in the batches priced (SharedBatch)."""
        return False

    @property
    def catch_up(self) -> float:
        """What the drafter takes to read a token of text it has not seen: a draft model's is priced at a draft step
        (a catch-up batch costs a little less: an upper bound)."""
        return self.draft

    @property
    def k_long(self) -> tuple[int, ...]:
        """The long draft lengths whose batches were measured."""
        return tuple(n - 1 for n in self.long_sizes)

    def batch_seconds(self, n: int) -> float:
        """Seconds for a batch of n tokens: measured, interpolated between measured sizes, or scaled from the largest."""
        if n <= len(self.verify) or not self.long_sizes:
            return self.verify[min(n, len(self.verify)) - 1]
        sizes, secs = [len(self.verify), *self.long_sizes], [self.verify[-1], *self.long_verify]
        if n >= sizes[-1]:
            return secs[-1] * n / sizes[-1]
        return _between(sizes, secs, n)

    def micro_seconds(self, seqs: int, each: int) -> float:
        """Seconds for a micro-batch of `each` tokens in each of `seqs` sequences (lockstep.micro_shapes): for a
        pool's steps, between one sequence's `each` tokens and every slot's, as measured together, interpolated by
        the sequences; else priced by its tokens. llama.cpp computes several sequences' tokens with other kernels
        than one sequence's as many: priced as one sequence's, a pool's batch is off, and uneven chains that one
        padded pass would run for less are left in several. A shape the pool's ticks ran is priced as they took
        (`shapes`): an interpolated price can be off either way, by enough to flip a choice."""
        memo = self._prices
        price = memo.get((seqs, each))
        if price is None:
            price = memo[seqs, each] = self._micro_price(seqs, each)
        return price

    def padded_seconds(self, lanes: tuple[int, ...], longest: int) -> float:
        """What a batch of `lanes[s]` tokens of each sequence s costs, padded where that costs less
        (lockstep.padded_seconds, at micro_seconds' prices)."""
        memo = self._prices
        price = memo.get((lanes, longest))
        if price is None:
            price = memo[lanes, longest] = padded_seconds(lanes, self.micro_seconds, longest)
        return price

    def _micro_price(self, seqs: int, each: int) -> float:
        learned = self.shapes.get((seqs, each))
        if learned is not None:
            return learned
        if 1 < seqs <= self.slots and each <= len(self.slot_verify):
            every, one = self.slot_verify[each - 1], self.batch_seconds(each)
            return every if seqs == self.slots else one + (every - one) * (seqs - 1) / (self.slots - 1)
        return self.batch_seconds(seqs * each)

    def draft_seconds(self, n: int) -> float:
        """Seconds for a draft batch of n tokens (every slot's draft position at once): between the measured sizes,
        interpolated, past the largest, scaled from it; one token's price where no batch was measured."""
        if n <= 1 or not self.draft_sizes:
            return self.draft
        sizes, secs = [1, *self.draft_sizes], [self.draft, *self.draft_batches]
        if n >= sizes[-1]:
            return secs[-1] * n / sizes[-1]
        return _between(sizes, secs, n)

    @staticmethod
    def expected_tokens(k: int, acceptance: float | Sequence[float]) -> float:
        """Tokens a step with k drafts commits; acceptance[i]: chance draft i is kept once judged
        (a single number: the same at every position; a short list: its last entry for the positions after it)."""
        return CostModel.expected_tokens_upto(k, acceptance)[k]

    @staticmethod
    def expected_tokens_upto(k_max: int, acceptance: float | Sequence[float]) -> tuple[float, ...]:
        """expected_tokens(k, acceptance) for k = 0..k_max, in one pass."""
        return _tokens_upto(k_max, acceptance if isinstance(acceptance, (int, float)) else tuple(acceptance))

    def step_seconds(self, k: int, free: bool = False) -> float:
        """Drafting k tokens (free: they cost nothing, as prompt lookup's) and verifying them."""
        return k * (0.0 if free else self.draft) + self.batch_seconds(k + 1) + self.holds(k, free)

    def holds(self, k: int, free: bool, slots: int = 1) -> float:
        """What checkpoints of recurrent states add to a step of k drafts (free: not a draft model's), for `slots`
        slots each taking theirs."""
        if not k:
            return 0.0
        target = self.hold if k > self.snapshots else 0.0
        return slots * (target + (self.draft_hold if k > 1 and not free else 0.0))

    def rate(self, k: int, tokens: float, free: bool = False) -> float:
        """Committed tokens per second of a step with k drafts that commits `tokens` on average."""
        return tokens / self.step_seconds(k, free)

    def expected_rate(self, k: int, acceptance: float | Sequence[float], free: bool = False) -> float:
        """Committed tokens per second with k drafts."""
        return self.rate(k, self.expected_tokens(k, acceptance), free)

    def best_k(self, acceptance: float | Sequence[float], k_max: int, k_min: int = 0, free: bool = False,
               longer: Sequence[int] = ()) -> int:
        """The draft length in k_min..k_max (or among `longer`) with the most expected tokens per second."""
        return self.best(acceptance, k_max, k_min, free, longer)[0]

    def best(self, acceptance: float | Sequence[float], k_max: int, k_min: int = 0, free: bool = False,
             longer: Sequence[int] = ()) -> tuple[int, float]:
        """best_k's length and its expected tokens per second (expected_rate's)."""
        tokens = self.expected_tokens_upto(max((k_max, *longer)), acceptance)  # one pass for every length (every step)
        best, most = k_min, -1.0
        for k in (*range(k_min, k_max + 1), *longer):
            r = self.rate(k, tokens[k], free)
            if r > most:  # the first of equals
                best, most = k, r
        return best, most

    def observe(self, n_verify: int, verify_s: float, draft_decodes: int, draft_s: float, weight: float = 0.2,
                draft_width: int = 1, verify_seqs: int = 1, verify_shapes: Sequence[tuple[int, int]] = (),
                tick: int = -1, draft_tick: int = -1, mtp: bool = False) -> None:
        """Move toward what one step really cost: the batch size seen at `weight`, the others at half of it
        (after a plain step: every size and the draft at `weight`), the draft at `weight` per decode, each of its
        decodes a batch of `draft_width` tokens (other slots' too, in a pool), every draft size alike. A batch of
        `verify_seqs` sequences' tokens teaches only the shape it ran as (micro_seconds), if it is a step's; one
        that ran in several micro-batches (`verify_shapes`, `verify_s` their total) teaches each of their shapes by
        how far their priced sum was off, if all are steps'. Unlearned, a batch the pool ran unpadded because its
        price was below the padded one's would keep that price, and run unpadded tick after tick where padding
        costs less.

        A shared batch (`tick`: its number, which every slot's step in it reports) teaches its price once: learned
        from each of n slots at weight w, one slow tick would move a price 1 - (1 - w)^n of the way to its time
        (0.83 for 8 slots at 0.2), and the pool would act on that one tick for long. So do the draft batches of
        slots drafting together (`draft_tick`: the step's last one). `mtp`: the drafter was the MTP head, whose prices
        learn from its decodes.

        A model measured while the machine was busy (or cached from another load) corrects itself in use.
        Plain steps scale every cost alike: they slow down as the context grows (the draft's too), and
        taking that as batches or drafts getting relatively cheaper would switch drafting on where it
        does not pay.
        """
        if tick >= 0 and not self._first_report("_tick", tick):
            verify_s = 0.0
        if verify_s > 0 and len(verify_shapes) > 1:
            if all(each <= len(self.verify) for _, each in verify_shapes):  # steps' shapes, not a prompt's chunks
                priced = {shape: self.micro_seconds(*shape) for shape in verify_shapes}
                off = verify_s / sum(priced[shape] for shape in verify_shapes)
                for (seqs, each), seconds in priced.items():
                    if seqs > 1:  # one sequence's tokens are priced by `verify`, which learns from its own batches
                        self._learn_shape(seqs, each, seconds * off, weight)
        elif verify_s > 0 and verify_seqs > 1:
            each = n_verify // verify_seqs
            if each * verify_seqs == n_verify and each <= len(self.verify):  # a step's shape, not a prompt's chunks
                moved = self._learn_shape(verify_seqs, each, verify_s, weight)
                if each == 1 and verify_seqs == self.slots and not draft_decodes:
                    self._scale_slots(moved)  # every slot's plain tokens: as measured, the chains and the draft alike
        elif verify_s > 0 and n_verify > len(self.verify) and self.long_sizes:
            # only a measured size learns, from a batch of its own size: between sizes the price is not smooth (a
            # batch of 7 tokens can cost more than one of 8), so a neighbour's batches would price it wrong
            if n_verify in self.long_sizes:
                i = self.long_sizes.index(n_verify)
                self.long_verify[i] *= (verify_s / self.long_verify[i]) ** weight
        elif verify_s > 0:
            n = min(n_verify, len(self.verify)) - 1
            ratio = verify_s / self.verify[n]
            others = weight if n == 0 else weight / 2
            self.verify = [v * ratio ** (weight if i == n else others) for i, v in enumerate(self.verify)]
            if n == 0 and not draft_decodes:
                self._scale_draft(ratio ** weight)
        if draft_tick >= 0 and not self._first_report("_draft_tick", draft_tick):
            draft_decodes = 0
        if draft_decodes:
            seen = draft_s / draft_decodes / (MtpPrices(self) if mtp else self).draft_seconds(draft_width)
            self._scale_draft(1 + (1 - (1 - weight) ** draft_decodes) * (seen - 1), "mtp" if mtp else "draft")
        if verify_s > 0 or draft_decodes:  # learned (a shared tick is learned from one slot's step only)
            self._prices = {}

    def _first_report(self, last: str, tick: int) -> bool:
        """Whether `tick` is a shared batch not yet learned, where attribute `last` holds the last one learned (set to
        `tick`); atomic, as the slots' threads observe their shared tick at once."""
        with _TICKS:
            first = getattr(self, last) != tick
            setattr(self, last, tick)
        return first

    def _learn_shape(self, seqs: int, each: int, seconds: float, weight: float) -> float:
        """A micro-batch of `each` tokens in each of `seqs` sequences took `seconds`: that shape's price alone moves
        toward it (every slot's measured one, or fewer slots' from what micro_seconds priced it at). Returns the
        factor it moved by."""
        if seqs == self.slots and each <= len(self.slot_verify):
            factor = (seconds / self.slot_verify[each - 1]) ** weight
            self.slot_verify[each - 1] *= factor
        else:
            seen = self.micro_seconds(seqs, each)
            factor = (seconds / seen) ** weight
            self.shapes[seqs, each] = seen * factor
        self._prices = {}
        return factor

    def _scale_slots(self, factor: float) -> None:
        """Every slot's plain tokens moved by `factor`: their chains' measured prices and the draft's move alike, as
        one sequence's plain steps move every size (observe). Moved alone, the slots' plain price would rise with
        their contexts while their chains, rarely run, kept the start-up price, and drafting (and the draft model's
        prefill) would look cheaper than it is. Fewer slots'
        shapes are not moved so: their first ticks correct an interpolated price, which says nothing of the others'."""
        self.slot_verify[1:] = [v * factor for v in self.slot_verify[1:]]  # observe, its caller, forgets the prices
        self._scale_draft(factor)

    def _scale_draft(self, factor: float, which: str | None = None) -> None:
        """The draft model's prices (`which` "draft"), the MTP head's ("mtp") or both (None: the machine's pace)."""
        if which != "mtp":
            self.draft *= factor
            self.draft_batches = [s * factor for s in self.draft_batches]
        if which != "draft":
            self.mtp *= factor
            self.mtp_catch_up *= factor
            self.mtp_batches = [s * factor for s in self.mtp_batches]


_TICKS = threading.Lock()  # CostModel.observe: a shared tick's first observer learns it, atomically


# A pool's slots each price every other slot's record (SharedBatch), several lengths a step, and a record changes at
# most once a step: remembered, each is counted about once a tick, not once a slot
@lru_cache(maxsize=1024)
def _tokens_upto(k_max: int, acceptance: float | tuple[float, ...]) -> tuple[float, ...]:
    if isinstance(acceptance, (int, float)):
        a = [acceptance] * k_max
    else:
        a = list(acceptance[:k_max]) + [acceptance[-1]] * (k_max - len(acceptance)) if acceptance else [0.0] * k_max
    out = [1.0]
    tokens = kept = 1.0
    for x in a:  # plain Python: called several times a step, where numpy's call overhead would show
        kept *= x
        tokens += kept
        out.append(tokens)
    return tuple(out)


def _between(sizes: Sequence[int], secs: Sequence[float], n: int) -> float:
    """secs interpolated at n, sizes[0] < n < sizes[-1] (both ascending)."""
    i = bisect.bisect_left(sizes, n)
    return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])


class SharedBatch(CostModel):
    """A slot's prices while other slots ride in the same target batch (EnginePool), as many tokens of each as in the
    last one (`lanes`, this slot's at `lane`): the rule that prices speculation per batch (docs/methods.md).

    A step with k drafts makes the whole batch cost its micro-batches (llama.cpp runs chains of unequal lengths in
    several: lockstep.micro_batches), each at micro_seconds, and commits the others' tokens plus this slot's expected
    ones; the others are counted as committing one token per token they add (a plain step's; drafting slots commit
    fewer, so this under-prices drafting, never over-prices it). So drafting is chosen only where it raises the
    whole batch's tokens per second: with one busy slot it is the base model's choice; with many, on a CPU where a
    batch's cost grows with its size, or wherever a longer chain costs a pass of its own, drafts shrink to what
    still pays, and never below plain continuous batching.

    With `follow`, every slot in the batch is priced as drafting the same k: the draft model's choice while every
    slot is on steps. One slot's chain beside plain steps runs as a micro-batch of its own, so alone no slot would
    start drafting, even where all drafting together pays (where repacked kernels take 4 tokens for less than 2 or 3,
    two slots' 2-token chains cost less than their 2 plain tokens). Each other slot commits what its own drafts are
    expected to keep (`fellows`: their acceptance records, by lane; this slot's where a slot has none yet), so every
    slot prices the same sum and, on the same costs and tick, chooses alike: priced by its own record alone, a slot
    whose drafts are kept more often than the others' drafts while they do not, and its chain runs as a pass of its
    own, a slower tick for every slot (docs/methods.md, "The draft model's length: every slot alike").

    Without `follow` (one slot's guess beside the others' steps: lookup's, or a draft beside a prompt's chunk), the
    batch's tokens a second are counted as its busy slots times the geometric mean of each one's tokens a second
    (proportional fairness): the sum, while every slot commits alike; less, where one slot runs ahead and the others
    wait on its chain. Counted as the sum, one slot's long copy beside plain steps looks like a gain while it holds
    the others' next tokens for several plain ticks; as copies recur, that client finishes ahead of the others, whose
    tail then runs a slot short, and the pool makes fewer tokens a second. Counted so, a guess pays beside n busy
    slots where E(k) exceeds (t_k / t_0)^n: on a CPU beside many slots, short guesses or none; where a longer batch
    costs about what a plain one does (a GPU), much as the sum would.

    Learning (observe) goes to the base model, with the whole batch's size and seconds (policy.adaptive leaves out
    batches that ran in several micro-batches)."""

    def __init__(self, base: CostModel, lanes: Sequence[int], lane: int, follow: bool = False,
                 fellows: dict[int, Sequence[float]] | None = None) -> None:
        self.base, self.lane, self.follow = base, lane, follow  # a view of `base`: no fields of its own
        self.lanes = list(lanes)  # a copy: step_seconds puts each priced chain in this slot's lane
        busy = [i for i, n in enumerate(lanes) if n and i != lane]  # the other busy slots
        self.busy = 1 + len(busy)  # slots in the batch, this one too
        # (k, free) -> step_seconds, until the base learns: a step's plan prices each length several times, and with
        # many slots on `auto` that pricing is a large share of each slot's Python time
        self._steps: dict[tuple[int, bool], float] = {}
        # following: the other busy slots' acceptance records (a slot with none is priced by this slot's)
        fellows = fellows or {}
        self._fellows = [fellows[i] for i in busy if i in fellows]
        self._strangers = len(busy) - len(self._fellows)
        self._fellow_tokens: list[float] = []  # [k]: what the fellows commit, drafting k each (filled on first use)
        # not following: the log of the product of the other busy slots' tokens (their geometric mean's part)
        self._others_log = sum(math.log(lanes[i]) for i in busy)

    @property
    def others(self) -> int:
        """The other slots' tokens in the batch."""
        return sum(self.lanes) - self.lanes[self.lane]

    verify = property(lambda self: self.base.verify)
    draft = property(lambda self: self.base.draft)
    long_sizes = property(lambda self: self.base.long_sizes)
    long_verify = property(lambda self: self.base.long_verify)
    draft_sizes = property(lambda self: self.base.draft_sizes)
    draft_batches = property(lambda self: self.base.draft_batches)
    slots = property(lambda self: self.base.slots)
    slot_verify = property(lambda self: self.base.slot_verify)
    shapes = property(lambda self: self.base.shapes)
    hold = property(lambda self: self.base.hold)
    snapshots = property(lambda self: self.base.snapshots)
    draft_hold = property(lambda self: self.base.draft_hold)
    catch_up = property(lambda self: self.base.catch_up)
    micro_seconds = property(lambda self: self.base.micro_seconds)  # the base's prices, remembered there
    padded_seconds = property(lambda self: self.base.padded_seconds)

    @property
    def shared(self) -> bool:
        return self.busy > 1

    def step_seconds(self, k: int, free: bool = False) -> float:
        seconds = self._steps.get((k, free))
        if seconds is None:
            self.lanes[self.lane] = k + 1
            lanes = tuple(k + 1 if n else 0 for n in self.lanes) if self.follow else tuple(self.lanes)
            longest = len(self.base.verify)  # a step's chain: as the pool pads (draft_max + 1)
            # following, each draft position is one draft batch of every slot's token: priced as one token, the
            # slots' drafts would be taken for a fraction of their cost, and all would draft where none pays
            draft = self.base.draft_seconds(self.busy) if self.follow else self.draft
            seconds = (k * (0.0 if free else draft) + self.base.padded_seconds(lanes, longest)
                       + self.holds(k, free, self.busy if self.follow else 1))
            self._steps[k, free] = seconds
        return seconds

    def rate(self, k: int, tokens: float, free: bool = False) -> float:
        if self.follow:
            if k >= len(self._fellow_tokens):  # every length a step prices, at once
                upto = max(k, len(self.base.verify) - 1)
                self._fellow_tokens = [sum(t) for t in zip(*(self.expected_tokens_upto(upto, a) for a in self._fellows),
                                                           [0.0] * (upto + 1))]
            return (tokens * (1 + self._strangers) + self._fellow_tokens[k]) / self.step_seconds(k, free)
        mean = math.exp((math.log(tokens) + self._others_log) / self.busy)  # geometric, of the busy slots' tokens
        return self.busy * mean / self.step_seconds(k, free)

    def observe(self, *args, **kwargs) -> None:
        self._steps.clear()
        self.base.observe(*args, **kwargs)

    def copy(self) -> CostModel:
        return self.base.copy()


class MtpPrices(CostModel):
    """`base`'s prices with the target's MTP head as the drafter: a draft token is one of its steps (`mtp`), a pool's
    draft batch one of its batches (`mtp_batches`), a token it catches up on a share of its catch-up batch
    (`mtp_catch_up`), and no checkpoint (its memory is attention only, whatever the target's is). A view: learning
    goes to the base, the target's batches as any step's, the head's prices from its own decodes."""

    def __init__(self, base: CostModel) -> None:
        self.base = base

    verify = property(lambda self: self.base.verify)
    long_sizes = property(lambda self: self.base.long_sizes)
    long_verify = property(lambda self: self.base.long_verify)
    slots = property(lambda self: self.base.slots)
    slot_verify = property(lambda self: self.base.slot_verify)
    shapes = property(lambda self: self.base.shapes)
    hold = property(lambda self: self.base.hold)
    snapshots = property(lambda self: self.base.snapshots)
    draft = property(lambda self: self.base.mtp)
    draft_sizes = property(lambda self: self.base.mtp_sizes)
    draft_batches = property(lambda self: self.base.mtp_batches)
    draft_hold = property(lambda self: 0.0)
    catch_up = property(lambda self: self.base.mtp_catch_up or self.base.mtp)
    micro_seconds = property(lambda self: self.base.micro_seconds)
    padded_seconds = property(lambda self: self.base.padded_seconds)

    def observe(self, *args, **kwargs) -> None:
        self.base.observe(*args, mtp=True, **kwargs)

    def copy(self) -> CostModel:
        return self.base.copy()


class ContextCosts:
    """A CostModel per context size (up to CONTEXT_SIZE cached tokens, up to twice that, ...), each
    learning from the steps taken at its size: a batch attends to the whole context, so what a long
    prompt teaches must not price a short one. A size first used starts from the next smaller one."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self._by_size: dict[int, CostModel] = {0: base}

    def at(self, n_ctx: int) -> CostModel:
        size = (max(n_ctx - 1, 0) // CONTEXT_SIZE).bit_length()
        if size not in self._by_size:
            smaller = self._by_size[max(s for s in self._by_size if s < size)]
            self._by_size[size] = smaller.copy()
        return self._by_size[size]


def measure(target: LlamaCppDecoder, draft: Decoder | None, k_max: int, repeats: int = 5,
            long_sizes: Sequence[int] = LONG_BATCHES, long_repeats: int = 2,
            mtp: Decoder | None = None) -> tuple[CostModel, float]:
    """Time target batches of 1..k_max+1 tokens (and of `long_sizes` that fit), a draft token and the MTP head's (a
    step, and a batch catching up on MTP_CATCH_UP tokens) after a short context, and on recurrent memory each model's
    checkpoint (saved and restored: hold); resets them all (a pool's batches of every slot's tokens: measure_together).

    Rounds interleave all sizes, so a busy spell hits every one; each time is the fastest round's (long
    batches take part in the first `long_repeats` rounds: each costs as much as many short ones).
    Also returns the spread (slowest / fastest round, worst short size): large when the machine was busy.
    """
    ctx = list(range(100, 132))
    decoders = [target] + [d for d in (draft, mtp) if d is not None]  # the target first: the head reads its rows
    for d in decoders:
        d.sync(ctx)
        d.hold(anchor=True)  # recurrent memory: every round's rollback returns to this checkpoint
        d.feed([7])  # warm-up
        d.rollback_to(len(ctx))
    room = min(target.n_ctx - len(ctx) - 1, target.options.micro_batch)  # one micro-batch, inside the context
    longs = [n for n in long_sizes if k_max + 1 < n <= room]
    # (decoder, tokens, with every token's logits, long): the drafters' tokens cost a fraction of the target's batches:
    # every round, after the short sizes
    short = [(target, n, True) for n in range(1, k_max + 2)] + ([(draft, 1, True)] if draft is not None else [])
    if mtp is not None:
        short += [(mtp, 1, True), (mtp, MTP_CATCH_UP, False)]
    sizes = [(*size, False) for size in short] + [(target, n, True, True) for n in longs]
    times: list[list[float]] = [[] for _ in sizes]
    holds: dict[int, list[float]] = {id(d): [] for d in decoders if _recurrent(d)}
    for r in range(repeats):
        for (d, n, every, long), out in zip(sizes, times):
            if long and r >= long_repeats:
                continue
            t0 = measure_clock()
            d.feed(list(range(200, 200 + n)), all_logits=every)
            out.append(measure_clock() - t0)
            d.rollback_to(len(ctx))
        for d in decoders:
            if id(d) in holds:
                holds[id(d)].append(_hold_seconds(d, len(ctx)))
    for d in decoders:
        d.rollback_to(0)
    best = [min(t) for t in times]
    spread = max(max(t) / min(t) for t in times[: k_max + 1 + (draft is not None)])
    model = CostModel(best[: k_max + 1], best[k_max + 1] if draft is not None else 0.0, longs, best[len(short):],
                      hold=min(holds.get(id(target), [0.0])), snapshots=getattr(target, "n_rs_seq", 0),
                      draft_hold=min(holds.get(id(draft), [0.0])))
    if mtp is not None:
        model.mtp, model.mtp_catch_up = best[len(short) - 2], best[len(short) - 1] / MTP_CATCH_UP
    return model, spread


def _recurrent(d: Decoder) -> bool:
    """Whether d's memory has a recurrent state (whose rollbacks may need checkpoints)."""
    memory = getattr(d, "memory", None)
    return memory is not None and memory.recurrent


def _hold_seconds(d: Decoder, base: int) -> float:
    """Seconds d takes to save a checkpoint of its recurrent state and to restore it, after `base` tokens (held)."""
    d.feed([9])
    before = d.hold_seconds
    d.hold()  # a new point (base + 1): saved
    d.feed([10])
    d.rollback_to(base + 1)  # a decode of one token: restored from that checkpoint
    seconds = d.hold_seconds - before
    d.rollback_to(base)
    return seconds


def measure_together(lockstep: Lockstep, views: Sequence[LlamaCppDecoder], widths: Sequence[int],
                     repeats: int = 3) -> list[float]:
    """Seconds for one batch of w tokens in each of `views`' sequences (slots of one shared context: the shape a
    pool's steps run in), for each w in `widths`, the fastest of `repeats`, after a short context; resets them.
    measure() times one sequence's tokens, which llama.cpp runs in other kernels than several sequences' as many:
    neither a batch's price nor how it grows with the chains carries over from one to the other. Each view feeds
    from a thread
    of its own (a member of `lockstep`), so their decodes meet in one tick, on the lockstep's decode thread. A
    view's error is raised here, once every thread has stopped."""
    ctx = list(range(100, 132))
    times: dict[int, list[float]] = {w: [] for w in widths}
    together = threading.Barrier(len(views))
    errors: list[BaseException] = []

    def slot(v: LlamaCppDecoder) -> None:
        # a member waiting at the barrier would hold back a tick another thread waits on: each waits only where no
        # thread has a decode pending (and each feed's tick has every member's)
        try:
            v.sync(ctx)
            v.hold(anchor=True)  # recurrent memory: each rollback returns to this checkpoint
            together.wait()
            with lockstep.member():
                together.wait()
                for _ in range(repeats):
                    for w in widths:
                        before = v.decode_seconds
                        v.feed(list(range(200, 200 + w)))
                        if v is views[0]:
                            times[w].append(v.decode_seconds - before)  # the whole batch's seconds
                        v.rollback_to(len(ctx))
                        together.wait()
            v.rollback_to(0)
        except BaseException as e:  # the others stop at the barrier (BrokenBarrierError) rather than wait for ever
            errors.append(e)
            together.abort()

    threads = [threading.Thread(target=slot, args=(v,)) for v in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [min(times[w]) for w in widths]


# A measurement noisier than this (its slowest round over its fastest, worst short size) was taken on a busy
# machine: it is still cached, marked noisy (its `spread`), and refined by the next tries (NOISY_RETRY_AFTER).
# docs/methods.md#measured-constants: MAX_SPREAD
MAX_SPREAD = 1.5
# Measurements a first use takes at most while they stay noisy, each batch's fastest time kept: a busy machine would
# otherwise never cache a quiet one, and measure again before the first token of every run
MEASURE_TRIES = 3
# Seconds after which a noisy entry is measured again (one try, at its next use): a busy spell ends, and each try
# can only make its times faster, closer to what the batches cost
NOISY_RETRY_AFTER = 3600.0
# What a cached entry holds besides the CostModel's fields: the spread of its measurement and when (Unix seconds)
ENTRY_FIELDS = ("spread", "measured")
measure_clock = time.perf_counter  # measure()'s timer: a module attribute, so that a test can make it noisy


def cached_measure(target: LlamaCppDecoder, draft: LlamaCppDecoder | None, k_max: int,
                   long_sizes: Sequence[int] = LONG_BATCHES, mtp: Decoder | None = None) -> CostModel:
    """measure(), remembered per model files, thread settings, CPU and llama.cpp build (machine_cache.machine: a
    home shared by different machines must not share their costs) in machine_cache.costs_path().

    A first use says on stderr what it measures, and takes up to MEASURE_TRIES measurements while they are noisy
    (each batch's fastest time kept); the result is cached even if noisy, marked so (entry_noisy), and a noisy
    entry is used as it is until NOISY_RETRY_AFTER seconds have passed, then refined by one more try at its next
    use. A cached entry is used only when check_costs passes it: a bad one is reported on stderr, measured again
    and written over, so what the cache holds never makes a run fail. `mtp`: the target's MTP head, timed too."""
    if target.options.remote or (draft is not None and draft.options.remote):
        # a network's costs: not this machine's
        notice(f"measuring the target's batch costs through the network for auto: {_what(k_max, draft, mtp)} (at each "
               "load: links change)")
        return _tries(target, draft, k_max, long_sizes, 1, mtp=mtp)[0]
    path = costs_path()
    key = [_identity(target), _identity(draft) if draft else None, k_max, list(long_sizes), machine()]
    key += ["mtp"] if mtp is not None else []  # (entries without the head keep their keys)
    entry = read_entry(path, json.dumps(key), lambda value: check_costs(value, k_max, long_sizes))
    if entry is not None and not _retry_due(entry):
        return cached_model(entry)
    if entry is None:
        notice(f"measuring this machine's batch costs for auto: {_what(k_max, draft, mtp)} (once for these models and "
               f"settings: cached in {path})")
        model, spread = _tries(target, draft, k_max, long_sizes, MEASURE_TRIES, mtp=mtp)
    else:
        notice(f"measuring the batch costs for auto again: the cached ones ({_when(entry['measured'])}) were taken "
               f"on a busy machine (spread {entry['spread']:.2f}); one try, each batch's fastest time kept")
        model, spread = _tries(target, draft, k_max, long_sizes, 1, (cached_model(entry), entry["spread"]), mtp)
    if spread > MAX_SPREAD:
        notice(f"this machine was busy while measuring (spread {spread:.2f}, over {MAX_SPREAD}): its fastest times "
               f"are used and cached, marked noisy, and measured again at a run {NOISY_RETRY_AFTER / 60:.0f} "
               "minutes or more from now")
    write_table(path, {json.dumps(key): {**asdict(model), "spread": spread, "measured": round(time.time())}})
    return model


def _what(k_max: int, draft: Decoder | None, mtp: Decoder | None = None) -> str:
    """What measure() times, for the notices: why the wait."""
    parts = [f"the target's batches of 1 to {k_max + 1} tokens and longer ones",
             *(x for x, d in (("a draft token", draft), ("the MTP head's steps", mtp)) if d is not None)]
    listed = ", ".join(parts[:-1]) + ", and " + parts[-1] if len(parts) > 1 else parts[0]
    return f"{listed}, 5 rounds each"


def _tries(target: LlamaCppDecoder, draft: Decoder | None, k_max: int, long_sizes: Sequence[int], tries: int,
           best: tuple[CostModel, float] | None = None, mtp: Decoder | None = None) -> tuple[CostModel, float]:
    """Up to `tries` measurements, until one is quiet (spread at most MAX_SPREAD), starting from `best` (an
    earlier model and its spread); each batch's fastest time over them all, and the smallest spread. A spinner
    shows on a terminal while they run (waiting)."""
    with waiting("measuring batch costs for auto") as wait:
        for i in range(tries):
            if tries > 1:
                wait.label = f"measuring batch costs for auto, try {i + 1} of at most {tries}"
            model, spread = measure(target, draft, k_max, long_sizes=long_sizes, mtp=mtp)
            best = (model, spread) if best is None else (fastest(best[0], model), min(best[1], spread))
            if spread <= MAX_SPREAD:
                break
    assert best is not None  # tries >= 1
    return best


def fastest(a: CostModel, b: CostModel) -> CostModel:
    """Each time of two measurements of the same batches, the faster one: a busy machine only adds time, so the
    fastest of several noisy measurements is the closest to what each batch costs."""
    pick = lambda xs, ys: [min(x, y) for x, y in zip(xs, ys)]  # noqa: E731
    return replace(a.copy(), verify=pick(a.verify, b.verify), draft=min(a.draft, b.draft),
                   long_verify=pick(a.long_verify, b.long_verify), hold=min(a.hold, b.hold),
                   draft_hold=min(a.draft_hold, b.draft_hold), mtp=min(a.mtp, b.mtp),
                   mtp_catch_up=min(a.mtp_catch_up, b.mtp_catch_up))


def cached_model(entry: dict) -> CostModel:
    """The CostModel of a cache entry that check_costs passed (without ENTRY_FIELDS)."""
    return CostModel(**{k: v for k, v in entry.items() if k not in ENTRY_FIELDS})


def entry_noisy(entry: object) -> bool:
    """Whether a cache entry was measured on a busy machine (with a valid spread and time over MAX_SPREAD; entries
    written before spreads were kept: no)."""
    return isinstance(entry, dict) and _check_measurement(entry) is None and entry.get("spread", 1.0) > MAX_SPREAD


def _retry_due(entry: dict) -> bool:
    """A noisy entry whose NOISY_RETRY_AFTER has passed: its next use measures once more."""
    return entry_noisy(entry) and time.time() - entry.get("measured", 0) >= NOISY_RETRY_AFTER


def _when(unix: float) -> str:
    """A measurement's local time, for notices and doctor."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix))


def cache_report(path: Path) -> list[str]:
    """`ggufspec doctor`'s lines on the cost cache at `path`: what it holds, then one line per noisy entry (its
    models, draft lengths, spread, when it was measured and when it is measured again)."""
    try:
        table = json.loads(path.read_bytes())
    except OSError:
        return [f"cost model cache: {path} (not written yet: auto measures at its first run)"]
    except (ValueError, RecursionError):
        table = None
    if not isinstance(table, dict):
        return [f"cost model cache: {path} (not a JSON table: measured again and replaced at auto's next run)"]
    noisy = [(key, e) for key, e in table.items() if entry_noisy(e)]
    lines = [f"cost model cache: {path} ({len(table)} measured setups, {len(noisy)} of them noisy)"]
    for key, e in noisy:
        retry = e["measured"] + NOISY_RETRY_AFTER
        lines.append(f"  noisy: {_setup(key)}: spread {e['spread']:.2f} (over {MAX_SPREAD}), measured "
                     f"{_when(e['measured'])}; in use as it is, measured again at a run from {_when(retry)}")
    return lines


def _setup(key: str) -> str:
    """A cache key's models and draft lengths, for doctor (a key that is not one of ours: as it is)."""
    try:
        target, draft, k_max = json.loads(key)[:3]
        models = " + ".join(Path(m[0]).name for m in (target, draft) if m)
        return f"{models}, draft lengths up to {k_max}"
    except (ValueError, TypeError, IndexError, KeyError):
        return key


def check_costs(entry: object, k_max: int, long_sizes: Sequence[int] = LONG_BATCHES) -> str | None:
    """What is wrong with a cached CostModel (as asdict wrote it) for draft lengths up to k_max; None if nothing is.

    verify: k_max + 1 seconds; draft: seconds or 0 (no draft model); long_sizes: what measure() takes of
    `long_sizes` (the sizes past verify's, up to those that fit), with one long_verify time each (both may be
    missing); no pool's batches (draft_sizes, slots, shapes: a pool measures or learns them at each load).
    Seconds are finite floats above 0: prices divide by them and interpolate between the sizes. `spread` (a float
    >= 1) and `measured` (whole Unix seconds) come together, or not at all in entries written before them."""
    if not isinstance(entry, dict):
        return f"expected an object, found {_json_type(entry)}"
    unknown = sorted(set(entry) - {"verify", "draft", "long_sizes", "long_verify", "draft_sizes", "draft_batches",
                                   "slots", "slot_verify", "shapes", "hold", "snapshots", "draft_hold",
                                   "mtp", "mtp_catch_up", "mtp_sizes", "mtp_batches", *ENTRY_FIELDS})
    if unknown:
        return f"unknown fields: {', '.join(unknown)}"
    why = _check_measurement(entry)
    if why is not None:
        return why
    verify, draft = entry.get("verify"), entry.get("draft")
    sizes, secs = entry.get("long_sizes", []), entry.get("long_verify", [])
    longs = [n for n in long_sizes if n > k_max + 1]
    if not (isinstance(verify, list) and len(verify) == k_max + 1 and all(map(_seconds, verify))):
        return f"verify: expected {k_max + 1} positive numbers"
    if not (type(draft) is float and math.isfinite(draft) and draft >= 0):
        return "draft: expected a number >= 0"
    for name in ("hold", "draft_hold", "mtp", "mtp_catch_up"):
        value = entry.get(name, 0.0)
        if not (type(value) is float and math.isfinite(value) and value >= 0):
            return f"{name}: expected a number >= 0"
    if not (type(entry.get("snapshots", 0)) is int and entry.get("snapshots", 0) >= 0):
        return "snapshots: expected a whole number >= 0"
    if not (isinstance(sizes, list) and sizes == longs[:len(sizes)]):
        return f"long_sizes: expected the first sizes of {longs}"
    if not (isinstance(secs, list) and len(secs) == len(sizes) and all(map(_seconds, secs))):
        return f"long_verify: expected {len(sizes)} positive numbers, one per long size"
    if entry.get("slots", 0) != 0 or entry.get("shapes", {}) != {} or any(
            entry.get(name, []) != [] for name in ("draft_sizes", "draft_batches", "slot_verify", "mtp_sizes",
                                                    "mtp_batches")):
        return "a pool's batches (draft_sizes, draft_batches, slots, slot_verify, shapes, mtp_sizes, mtp_batches): " \
               "expected none"
    return None


def _check_measurement(entry: dict) -> str | None:
    """What is wrong with an entry's ENTRY_FIELDS (both, or neither as before they were kept); None if nothing."""
    spread, measured = entry.get("spread"), entry.get("measured")
    if spread is None and measured is None:
        return None
    if not (type(spread) is float and math.isfinite(spread) and spread >= 1):
        return "spread: expected a number >= 1, with `measured`"
    if not (type(measured) is int and measured >= 0):
        return "measured: expected a time in seconds, with `spread`"
    return None


def _seconds(x: object) -> bool:
    """A time as measure() writes one: a float, finite (json reads NaN and Infinity too) and above 0."""
    return type(x) is float and math.isfinite(x) and x > 0


def _identity(d: LlamaCppDecoder) -> list[object]:
    st = d.path.stat()
    o = d.options
    return [str(d.path), st.st_size, int(st.st_mtime), o.n_threads, o.n_threads_batch, o.n_gpu_layers, o.flash_attn,
            d.kv_cache, sorted(d.weight_buffers),  # where the weights went: repacked or not costs batches differently
            *([d.n_rs_seq] if getattr(d, "n_rs_seq", 0) else [])]  # snapshots: written by every batch
