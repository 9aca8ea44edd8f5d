"""The measured tables and their prices: what a target batch of n tokens costs (one sequence's, or a micro-batch of
several sequences' as a pool runs them), a draft batch, a step of k drafts, and the draft length that commits the most
tokens a second (Prices.best).

On CPUs the target's cost for a batch of n tokens is far from n times one token, and it depends
on the CPU as much as on the weight type (llama.cpp repacks Q4_0 and Q8_0 for small batches, and a CPU's
matrix kernels decide what a 4-token batch costs against one token: docs/cpu-kernels.md), so the
best draft length is found by measuring (costs.timing), not assumed.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..micro_batches import padded_seconds
from . import learn


class Prices(ABC):
    """What a step of k drafts costs and commits, and the draft length that commits the most tokens a second: what a
    source's record (policy.adaptive) prices with. A subclass gives the prices (verify, draft, catch_up, batch_seconds,
    step_seconds) and where learning goes (observe); the choice (rate, expected_rate, best, best_k) is built on them,
    and a subclass may count a step's tokens otherwise (rate). CostModel prices one sequence's steps from its measured
    tables; SharedBatch and MtpPrices (costs.batch) hold a CostModel and price from it."""

    verify: list[float]  # verify[n-1]: seconds for a batch of n tokens of one sequence, with all logits
    draft: float  # seconds for one draft token (a step of the drafter)

    @property
    def shared(self) -> bool:
        """Whether other slots' tokens ride in the batches priced (SharedBatch)."""
        return False

    @property
    @abstractmethod
    def catch_up(self) -> float:
        """What the drafter takes to read a token of text it has not seen."""

    @abstractmethod
    def batch_seconds(self, n: int) -> float:
        """Seconds for a batch of n tokens of one sequence."""

    @abstractmethod
    def step_seconds(self, k: int, free: bool = False) -> float:
        """Drafting k tokens (free: they cost nothing, as prompt lookup's) and verifying them."""

    @abstractmethod
    def observe(self, n_verify: int, verify_s: float, draft_decodes: int, draft_s: float, weight: float = 0.2,
                draft_width: int = 1, verify_seqs: int = 1, verify_shapes: Sequence[tuple[int, int]] = (),
                tick: int = -1, draft_tick: int = -1, mtp: bool = False) -> None:
        """Learn from what one step really cost (CostModel.observe)."""

    def learned(self, tick: int) -> bool:
        """Whether shared target batch `tick` has taught its price already (observe learns from its first step)."""
        return False

    @abstractmethod
    def copy(self) -> CostModel:
        """An independent CostModel to price and learn from (a view's: its CostModel's copy)."""

    @staticmethod
    def expected_tokens(k: int, acceptance: float | Sequence[float]) -> float:
        """Tokens a step with k drafts commits; acceptance[i]: chance draft i is kept once judged
        (a single number: the same at every position; a short list: its last entry for the positions after it)."""
        return Prices.expected_tokens_upto(k, acceptance)[k]

    @staticmethod
    def expected_tokens_upto(k_max: int, acceptance: float | Sequence[float]) -> tuple[float, ...]:
        """expected_tokens(k, acceptance) for k = 0..k_max, in one pass."""
        return _tokens_upto(k_max, acceptance if isinstance(acceptance, (int, float)) else tuple(acceptance))

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



@dataclass
class CostModel(Prices):
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

    def __post_init__(self) -> None:
        # not fields (never cached, compared or copied):
        self.ticks = learn.Ticks()  # the last shared target and draft batches whose prices were learned (observe)
        # micro_seconds' and padded_seconds' prices until the model learns (replaced then, never cleared: a price
        # worked out meanwhile goes to the old one): a pool's slots price the same few batches, several lengths
        # each, every step
        self._prices: dict[tuple, float] = {}
        # a pool's batches' views of these prices, and what its slots work out from them, as long (SharedBatch.of)
        self.views: dict[tuple, object] = {}

    def copy(self) -> CostModel:
        """An independent copy: the same tables, its own learning from here on (ticks and remembered prices afresh)."""
        return replace(self, verify=list(self.verify), long_sizes=list(self.long_sizes),
                       long_verify=list(self.long_verify), draft_sizes=list(self.draft_sizes),
                       draft_batches=list(self.draft_batches), slot_verify=list(self.slot_verify),
                       shapes=dict(self.shapes), mtp_sizes=list(self.mtp_sizes), mtp_batches=list(self.mtp_batches))

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
        """Seconds for a micro-batch of `each` tokens in each of `seqs` sequences (micro_batches.micro_shapes): for a
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
        (micro_batches.padded_seconds, at micro_seconds' prices)."""
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
        return _drafts(self.draft, self.draft_sizes, self.draft_batches, n)

    def mtp_seconds(self, n: int) -> float:
        """Seconds for a batch of n MTP head steps (every slot's at once), priced as draft_seconds prices drafts."""
        return _drafts(self.mtp, self.mtp_sizes, self.mtp_batches, n)

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

    def observe(self, n_verify: int, verify_s: float, draft_decodes: int, draft_s: float, weight: float = 0.2,
                draft_width: int = 1, verify_seqs: int = 1, verify_shapes: Sequence[tuple[int, int]] = (),
                tick: int = -1, draft_tick: int = -1, mtp: bool = False) -> None:
        """Move toward what one step really cost (costs.learn): its target batch of `n_verify` tokens took `verify_s`
        (0: nothing to learn), of `verify_seqs` sequences, run in the micro-batches `verify_shapes` where several
        (`verify_s` their total), `tick` its number where shared; `draft_decodes` draft decodes took `draft_s`, each
        a batch of `draft_width` tokens, `draft_tick` the last one's number where shared; `mtp`: the drafter was the
        MTP head. Each price moves by `weight` (learn.observe says which, and how far)."""
        if self.learned(tick) and not draft_decodes:  # a tick's later slot: learned from its first
            return
        learn.observe(self, learn.TargetPass(n_verify, verify_s, verify_seqs, verify_shapes, tick),
                      learn.DraftPasses(draft_decodes, draft_s, draft_width, draft_tick, mtp), weight)

    def learned(self, tick: int) -> bool:
        return 0 <= tick == self.ticks.target

    def table(self) -> tuple[float, ...]:
        """Every price it holds, in one order, a learned shape's key beside its price: what a plan priced from it is
        compared with later (policy.shared.SlotRecords.standing)."""
        shapes = (x for (seqs, each), price in sorted(self.shapes.items()) for x in (seqs, each, price))
        return (*self.verify, *self.long_verify, self.draft, *self.draft_batches, *self.slot_verify, *shapes,
                self.hold, self.draft_hold, self.mtp, self.mtp_catch_up, *self.mtp_batches)

    def forget_prices(self) -> None:
        """After learning: micro_seconds' and padded_seconds' remembered prices, and the views priced from them, are
        worked out again."""
        self._prices, self.views = {}, {}


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


def _drafts(one: float, sizes: Sequence[int], batches: Sequence[float], n: int) -> float:
    """A drafter's batch of n tokens at `one` token's price and its measured `batches` of `sizes` tokens: between
    them, interpolated; past the largest, scaled from it; `one` where none was measured."""
    if n <= 1 or not sizes:
        return one
    points, secs = [1, *sizes], [one, *batches]
    if n >= points[-1]:
        return secs[-1] * n / points[-1]
    return _between(points, secs, n)


def _between(sizes: Sequence[int], secs: Sequence[float], n: int) -> float:
    """secs interpolated at n, sizes[0] < n < sizes[-1] (both ascending)."""
    i = bisect.bisect_left(sizes, n)
    return secs[i - 1] + (secs[i] - secs[i - 1]) * (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])

