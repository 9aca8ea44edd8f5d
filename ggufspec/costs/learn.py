"""Learning from observed passes: a CostModel's prices move toward what each step really cost.

observe() takes what one step saw (its TargetPass and its DraftPasses) and hands the target batch to the function for
its shape: one sequence's batch (learn_one_sequence), a long one (learn_long_batch), a pool's shared batch of one shape
(learn_shared_batch), a batch run in several micro-batches (learn_micro_batches); then the drafter's batches to
learn_drafts (the draft model's, or the MTP head's). A model measured while the machine was busy (or cached from
another load) corrects itself in use.

A shared batch teaches its price once (Ticks): every slot's step in it reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .table import CostModel


@dataclass(slots=True)
class TargetPass:
    """A step's target batch: `tokens` in all (other slots' too, in a pool's shared batch) in `seconds` (0: nothing
    to learn: it ran in several passes that were not a tick's micro-batches), of `seqs` sequences; `shapes`, the
    micro-batches (sequences, tokens each) it ran in where several, `seconds` their total; `tick`, a shared batch's
    number (-1: none), which every slot's step in it reports."""

    tokens: int
    seconds: float
    seqs: int = 1
    shapes: Sequence[tuple[int, int]] = ()
    tick: int = -1


@dataclass(slots=True)
class DraftPasses:
    """A step's draft decodes: `decodes` of them (0: none to learn from) in `seconds`, each a batch of `width` tokens
    (other slots' too, where a pool's slots draft together); `tick`, the step's last draft batch's number (-1: none);
    `mtp`, the drafter was the MTP head (else the draft model)."""

    decodes: int
    seconds: float
    width: int = 1
    tick: int = -1
    mtp: bool = False


class Ticks:
    """The last shared target batch and draft batch whose prices a cost model learned. A shared batch teaches its
    price once: learned from each of n slots at weight w, one slow tick would move a price 1 - (1 - w)^n of the way to
    its time (0.83 for 8 slots at 0.2), and the pool would act on that one tick for long. So do the draft batches of
    slots drafting together. Atomic: member threads (cost measurements) may report a shared tick at once. Never
    cached or copied (a copy learns afresh)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.target = -1  # the last shared target batch learned
        self.draft = -1  # the last shared draft batch learned

    def first_target(self, tick: int) -> bool:
        """Whether target batch `tick` is not learned yet (it is from now on)."""
        with self._lock:
            first, self.target = self.target != tick, tick
        return first

    def first_draft(self, tick: int) -> bool:
        """Whether draft batch `tick` is not learned yet (it is from now on)."""
        with self._lock:
            first, self.draft = self.draft != tick, tick
        return first


def observe(costs: CostModel, target: TargetPass, drafts: DraftPasses, weight: float) -> None:
    """Move `costs` toward what one step really cost, each price by `weight` (see each learn_* function); a shared
    batch (a tick) only from the first slot's step that reports it. A plain step (no draft decodes) also moves the
    drafters' prices with the target's where its batch is one token a sequence."""
    plain = not drafts.decodes
    seconds = target.seconds if target.tick < 0 or costs.ticks.first_target(target.tick) else 0.0
    if seconds > 0:
        if len(target.shapes) > 1:
            learn_micro_batches(costs, target.shapes, seconds, weight)
        elif target.seqs > 1:
            learn_shared_batch(costs, target.tokens, target.seqs, seconds, weight, plain)
        elif target.tokens > len(costs.verify) and costs.long_sizes:
            learn_long_batch(costs, target.tokens, seconds, weight)
        else:
            learn_one_sequence(costs, target.tokens, seconds, weight, plain)
    decodes = drafts.decodes if drafts.tick < 0 or costs.ticks.first_draft(drafts.tick) else 0
    if decodes:
        learn_drafts(costs, decodes, drafts.seconds, drafts.width, weight, drafts.mtp)
    if seconds > 0 or decodes:  # learned (a shared tick is learned from one slot's step only)
        costs.forget_prices()


def learn_one_sequence(costs: CostModel, tokens: int, seconds: float, weight: float, plain: bool) -> None:
    """One sequence's batch of `tokens` (up to verify's sizes) took `seconds`: its size moves by `weight`, the others
    by half of it (after a plain step, one token: every size and the drafters at `weight`). Plain steps scale every
    cost alike: they slow down as the context grows (the draft's too), and taking that as batches or drafts getting
    relatively cheaper would switch drafting on where it does not pay."""
    n = min(tokens, len(costs.verify)) - 1
    ratio = seconds / costs.verify[n]
    others = weight if n == 0 else weight / 2
    costs.verify = [v * ratio ** (weight if i == n else others) for i, v in enumerate(costs.verify)]
    if n == 0 and plain:
        scale_drafters(costs, ratio ** weight)


def learn_long_batch(costs: CostModel, tokens: int, seconds: float, weight: float) -> None:
    """A batch longer than verify's sizes took `seconds`."""
    # only a measured size learns, from a batch of its own size: between sizes the price is not smooth (a
    # batch of 7 tokens can cost more than one of 8), so a neighbour's batches would price it wrong
    if tokens in costs.long_sizes:
        i = costs.long_sizes.index(tokens)
        costs.long_verify[i] *= (seconds / costs.long_verify[i]) ** weight


def learn_shared_batch(costs: CostModel, tokens: int, seqs: int, seconds: float, weight: float, plain: bool) -> None:
    """A batch of `seqs` sequences' tokens, one pass, took `seconds`: it teaches only the shape it ran as
    (micro_seconds), if it is a step's. Every slot's plain tokens move their chains' and the drafters' prices too
    (scale_slots)."""
    each = tokens // seqs
    if each * seqs == tokens and each <= len(costs.verify):  # a step's shape, not a prompt's chunks
        moved = learn_shape(costs, seqs, each, seconds, weight)
        if each == 1 and seqs == costs.slots and plain:
            scale_slots(costs, moved)  # every slot's plain tokens: as measured, the chains and the draft alike


def learn_micro_batches(costs: CostModel, shapes: Sequence[tuple[int, int]], seconds: float, weight: float) -> None:
    """A batch that ran in several micro-batches (`shapes`, `seconds` their total) teaches each of their shapes of
    several sequences by how far their priced sum was off, if all are steps'. Unlearned, a batch the pool ran
    unpadded because its price was below the padded one's would keep that price, and run unpadded tick after tick
    where padding costs less."""
    if all(each <= len(costs.verify) for _, each in shapes):  # steps' shapes, not a prompt's chunks
        priced = {shape: costs.micro_seconds(*shape) for shape in shapes}
        off = seconds / sum(priced[shape] for shape in shapes)
        for (seqs, each), price in priced.items():
            if seqs > 1:  # one sequence's tokens are priced by `verify`, which learns from its own batches
                learn_shape(costs, seqs, each, price * off, weight)


def learn_drafts(costs: CostModel, decodes: int, seconds: float, width: int, weight: float, mtp: bool) -> None:
    """`decodes` draft decodes took `seconds`, each a batch of `width` tokens: the drafter's prices (the draft model's,
    or with `mtp` the MTP head's, which learn from its own decodes) move toward them at `weight` per decode, every
    batch size alike."""
    price = costs.mtp_seconds(width) if mtp else costs.draft_seconds(width)
    seen = seconds / decodes / price
    scale_drafters(costs, 1 + (1 - (1 - weight) ** decodes) * (seen - 1), "mtp" if mtp else "draft")


def learn_shape(costs: CostModel, seqs: int, each: int, seconds: float, weight: float) -> float:
    """A micro-batch of `each` tokens in each of `seqs` sequences took `seconds`: that shape's price alone moves
    toward it (every slot's measured one, or fewer slots' from what micro_seconds priced it at). Returns the
    factor it moved by."""
    if seqs == costs.slots and each <= len(costs.slot_verify):
        factor = (seconds / costs.slot_verify[each - 1]) ** weight
        costs.slot_verify[each - 1] *= factor
    else:
        seen = costs.micro_seconds(seqs, each)
        factor = (seconds / seen) ** weight
        costs.shapes[seqs, each] = seen * factor
    costs.forget_prices()
    return factor


def scale_slots(costs: CostModel, factor: float) -> None:
    """Every slot's plain tokens moved by `factor`: their chains' measured prices and the draft's move alike, as
    one sequence's plain steps move every size (learn_one_sequence). Moved alone, the slots' plain price would rise
    with their contexts while their chains, rarely run, kept the start-up price, and drafting (and the draft model's
    prefill) would look cheaper than it is. Fewer slots'
    shapes are not moved so: their first ticks correct an interpolated price, which says nothing of the others'."""
    costs.slot_verify[1:] = [v * factor for v in costs.slot_verify[1:]]  # observe, its caller, forgets the prices
    scale_drafters(costs, factor)


def scale_drafters(costs: CostModel, factor: float, which: str | None = None) -> None:
    """The draft model's prices (`which` "draft"), the MTP head's ("mtp") or both (None: the machine's pace)."""
    if which != "mtp":
        costs.draft *= factor
        costs.draft_batches = [s * factor for s in costs.draft_batches]
    if which != "draft":
        costs.mtp *= factor
        costs.mtp_catch_up *= factor
        costs.mtp_batches = [s * factor for s in costs.mtp_batches]
