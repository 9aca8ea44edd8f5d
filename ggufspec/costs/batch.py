"""Prices seen from one slot, each a view that holds a CostModel and prices from it: a batch shared with other
slots (SharedBatch), and the target's MTP head as the drafter (MtpPrices). What a view learns goes to its CostModel."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .table import CostModel, Prices


class SharedBatch(Prices):
    """A slot's prices while other slots ride in the same target batch (EnginePool), as many tokens of each as in the
    last one (`lanes`, this slot's at `lane`): the rule that prices speculation per batch (docs/methods.md).

    A step with k drafts makes the whole batch cost its micro-batches (llama.cpp runs chains of unequal lengths in
    several: micro_batches.micro_batches), each at micro_seconds, and commits the others' tokens plus this slot's
    expected ones; the others are counted as committing one token per token they add (a plain step's; drafting slots
    commit fewer, so this under-prices drafting, never over-prices it). So drafting is chosen only where it raises the
    whole batch's tokens per second: with one busy slot it is the base model's choice; with many, on a CPU where a
    batch's cost grows with its size, or wherever a longer chain costs a pass of its own, drafts shrink to what
    still pays, and never below plain continuous batching.

    With `follow`, every slot in the batch is priced as drafting the same k: the draft model's choice while every
    slot is on steps. One slot's chain beside plain steps runs as a micro-batch of its own, so alone no slot would
    start drafting, even where all drafting together pays (where repacked kernels take 4 tokens for less than 2 or 3,
    two slots' 2-token chains cost less than their 2 plain tokens). Each slot commits what its own drafts are
    expected to keep (`fellows`: every slot's acceptance record by lane; the one priced with where a slot has none), so
    every slot prices the same sum and, on the same costs and tick, chooses alike: priced by its own record alone, a slot
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

    def __init__(self, base: CostModel | MtpPrices, lanes: Sequence[int], lane: int, follow: bool = False,
                 fellows: Mapping[int, Sequence[float]] | None = None) -> None:
        """`fellows`: following, the busy slots' acceptance records by lane (this slot's too, where it has one)."""
        self.base, self.lane, self.follow = base, lane, follow  # a view of `base`: its prices, its learning
        self.lanes = list(lanes)  # a copy: step_seconds puts each priced chain in this slot's lane
        busy = [i for i, n in enumerate(lanes) if n]
        self.busy = len(busy) + (not lanes[lane])  # slots in the batch, this one too
        # (k, free) -> step_seconds, until the base learns: a step's plan prices each length several times, and with
        # many slots on `auto` that pricing is a large share of each slot's Python time
        self._steps: dict[tuple[int, bool], float] = {}
        self._best: dict[tuple, tuple[int, float]] = {}  # best()'s answers
        # following: the busy slots' acceptance records (a slot with none is priced by the record priced with)
        fellows = fellows or {}
        self._fellows = [fellows[i] for i in busy if i in fellows] if follow else []
        self._strangers = self.busy - len(self._fellows)
        self._fellow_tokens: list[float] = []  # [k]: what the fellows commit, drafting k each (filled on first use)
        # not following: the log of the product of the other busy slots' tokens (their geometric mean's part)
        self._others_log = 0.0 if follow else sum(math.log(lanes[i]) for i in busy if i != lane)

    @classmethod
    def of(cls, base: CostModel | MtpPrices, lanes: Sequence[int], lane: int, tick: int, follow: bool = False,
           fellows: Callable[[], Mapping[int, Sequence[float]]] = dict) -> SharedBatch:
        """The view of batch `tick` (after `lanes`) from `lane`, made once and kept until `base` learns: following,
        one for every slot of the tick (its prices are every slot's), so a tick's draft length is worked out once for
        the whole pool; else one for each slot, shared by its records (one for all where every other slot adds as
        many tokens). `fellows()`: as __init__'s, read when made.
        A view of its own where `tick` is -1 (no batch ran yet)."""
        if tick < 0:
            return cls(base, lanes, lane, follow, fellows())
        mtp = isinstance(base, MtpPrices)
        if follow:  # what the view prices is which slots are busy (and this one where it is not among them)
            key: tuple = ("follow", mtp, tick, tuple(map(bool, lanes)), -1 if lanes[lane] else lane)
        else:  # where every other slot adds as many tokens, which slot this is changes no price
            others = {n for i, n in enumerate(lanes) if i != lane}
            even = len(others) == 1 and 0 not in others
            key = ("even", mtp, tick, len(lanes), *others) if even else ("beside", mtp, tick, tuple(lanes), lane)
        view = base.views.get(key)
        if view is None:
            view = base.views[key] = cls(base, lanes, lane, follow, fellows())
        return view

    @property
    def others(self) -> int:
        """The other slots' tokens in the batch."""
        return sum(self.lanes) - self.lanes[self.lane]

    verify = property(lambda self: self.base.verify)
    draft = property(lambda self: self.base.draft)
    catch_up = property(lambda self: self.base.catch_up)
    k_long = property(lambda self: self.base.k_long)

    def batch_seconds(self, n: int) -> float:
        """One sequence's batch of n tokens: the base's price (a step in this batch: step_seconds)."""
        return self.base.batch_seconds(n)

    @property
    def shared(self) -> bool:
        return self.busy > 1

    def step_seconds(self, k: int, free: bool = False) -> float:
        seconds = self._steps.get((k, free))
        if seconds is None:
            base = self.base
            self.lanes[self.lane] = k + 1
            # following, each draft position is one draft batch of every slot's token: priced as one token, the
            # slots' drafts would be taken for a fraction of their cost, and all would draft where none pays
            if self.follow:
                lanes, slots = tuple([k + 1 if n else 0 for n in self.lanes]), self.busy
                draft = base.draft_seconds(slots) if k and not free else 0.0
            else:
                lanes, slots, draft = tuple(self.lanes), 1, 0.0 if free else base.draft
            longest = len(base.verify)  # a step's chain: as the pool pads (draft_max + 1)
            seconds = k * draft + base.padded_seconds(lanes, longest) + base.holds(k, free, slots)
            self._steps[k, free] = seconds
        return seconds

    def rate(self, k: int, tokens: float, free: bool = False) -> float:
        if self.follow:
            if k >= len(self._fellow_tokens):  # every length a step prices, at once
                upto = max(k, len(self.base.verify) - 1)
                self._fellow_tokens = [sum(t) for t in zip(*(self.expected_tokens_upto(upto, a) for a in self._fellows),
                                                           [0.0] * (upto + 1))]
            return (tokens * self._strangers + self._fellow_tokens[k]) / self.step_seconds(k, free)
        mean = math.exp((math.log(tokens) + self._others_log) / self.busy)  # geometric, of the busy slots' tokens
        return self.busy * mean / self.step_seconds(k, free)

    def best(self, acceptance: float | Sequence[float], k_max: int, k_min: int = 0, free: bool = False,
             longer: Sequence[int] = ()) -> tuple[int, float]:
        """Prices.best's, remembered with the view: following with every busy slot's record known, worked out once
        for every slot; else once for each record's acceptance (a probe's is every slot's)."""
        if self.follow and not self._strangers:
            mine = None  # priced by the fellows' records alone
        else:
            mine = acceptance if isinstance(acceptance, (int, float)) else tuple(acceptance)
        key = (mine, k_max, k_min, free, tuple(longer))
        answer = self._best.get(key)
        if answer is None:
            answer = self._best[key] = super().best(acceptance, k_max, k_min, free, longer)
        return answer

    def learned(self, tick: int) -> bool:
        return self.base.learned(tick)

    def observe(self, *args: Any, **kwargs: Any) -> None:
        """CostModel.observe's, to the base (this view's remembered prices forgotten where it learned)."""
        views = self.base.views
        self.base.observe(*args, **kwargs)
        if self.base.views is not views:  # it learned (forget_prices), rather than a tick's other slot before
            self._steps.clear()
            self._best.clear()

    def copy(self) -> CostModel:
        return self.base.copy()


class MtpPrices(Prices):
    """`base`'s prices with the target's MTP head as the drafter: a draft token is one of its steps (`mtp`), a pool's
    draft batch one of its batches (`mtp_batches`), a token it catches up on a share of its catch-up batch
    (`mtp_catch_up`), and no checkpoint (its memory is attention only, whatever the target's is). A view: learning
    goes to the base, the target's batches as any step's, the head's prices from its own decodes."""

    def __init__(self, base: CostModel) -> None:
        self.base = base

    verify = property(lambda self: self.base.verify)
    draft = property(lambda self: self.base.mtp)
    catch_up = property(lambda self: self.base.mtp_catch_up or self.base.mtp)
    k_long = property(lambda self: self.base.k_long)
    micro_seconds = property(lambda self: self.base.micro_seconds)  # the base's prices, remembered there
    views = property(lambda self: self.base.views)
    padded_seconds = property(lambda self: self.base.padded_seconds)

    def batch_seconds(self, n: int) -> float:
        return self.base.batch_seconds(n)

    def draft_seconds(self, n: int) -> float:
        """A batch of n of the head's steps (every following slot's at once)."""
        return self.base.mtp_seconds(n)

    def holds(self, k: int, free: bool, slots: int = 1) -> float:
        """The target's checkpoints (CostModel.holds); the head takes none."""
        if not k:
            return 0.0
        return slots * (self.base.hold if k > self.base.snapshots else 0.0)

    def step_seconds(self, k: int, free: bool = False) -> float:
        return k * (0.0 if free else self.draft) + self.base.batch_seconds(k + 1) + self.holds(k, free)

    def learned(self, tick: int) -> bool:
        return self.base.learned(tick)

    def observe(self, *args: Any, **kwargs: Any) -> None:
        """CostModel.observe's, to the base, the drafter's decodes as the head's."""
        self.base.observe(*args, mtp=True, **kwargs)

    def copy(self) -> CostModel:
        return self.base.copy()
