"""What a pool's slots' `auto` policies share: each slot's drafting records by lane, the cost models by context size,
and the plans one slot works out for every slot of a batch (TickPlan), which the others take, a slot's quiet steps
running on one (QuietRun)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..costs import ContextCosts, CostModel, Prices
from ..decoder import SLOT_CHUNK
from .adaptive import AdaptiveLength

# AutoPolicy._lookup_may_pay's answer stands this many ticks while the batch keeps its shape, and so does a pool's
# plan where no model drafts (price_at) unless a probe drafts: prices move a little a tick, and working them out again
# costs the tick's first slot several plain steps' Python (docs/methods.md#measured-constants: REACH_TICKS)
REACH_TICKS = 256
# A plan due after REACH_TICKS ticks stands as many more where nothing it was priced from moved by more than this: no
# price by more than this share of itself, no slot's drafting record's acceptance by more than this (the learned prices
# wander by a few percent on a VM from one check to the next: an answer so small a move would change is a near-tie
# either way), measured from when it was priced, so that a slow drift is caught (docs/methods.md#measured-constants:
# PLAN_DRIFT)
PLAN_DRIFT = 0.05


def beside_prompt(lanes: tuple[int, ...], lane: int) -> bool:
    """Whether another slot's prompt goes on in a batch of `lanes` (a full chunk of it: its next one follows; a
    shorter one was its last), seen from slot `lane`."""
    return max(lanes, default=0) >= SLOT_CHUNK and any(n >= SLOT_CHUNK for i, n in enumerate(lanes) if i != lane)


def busy(lanes: tuple[int, ...]) -> int:
    """The busy slots in a batch of `lanes` (a pool's rests are kept by this count: SlotRecords.rest_plan)."""
    return len(lanes) - lanes.count(0)


def plan_key(costs: CostModel, lanes: tuple[int, ...], lane: int, k_max: int, models: tuple[str, ...],
             own: bool = False) -> tuple | None:
    """The key of a pool's plan (TickPlan) for the steps of slot `lane` after a batch of `lanes` tokens of each
    sequence, at `costs`, drafting up to k_max from `models`: of what AutoPolicy's prices there depend on. Which
    sequences are busy (each other busy slot is priced as stepping next); where some are idle, whether this slot's
    sequence has a busy neighbour; where another's prompt goes on, this slot's place and those chunks (`own`: this
    slot's place whatever it is). None in a batch of its own.
    (llama.cpp runs consecutive sequences' tokens together, micro_batches: beside steps of one token, a chain prices
    alike from any busy sequence of a run, and alike from any between idle ones; beside longer chains, a shorter one
    splits their run, so AutoPolicy.price_at keys a plan where a model drafts by the slot's own place.)"""
    if len(lanes) < 2:
        return None
    if beside_prompt(lanes, lane):
        going = tuple(n if n >= SLOT_CHUNK and i != lane else n > 0 for i, n in enumerate(lanes))
        return (id(costs), going, lane, k_max, models)
    if 0 not in lanes:
        return (id(costs), len(lanes), k_max, models)
    alone = not (lane and lanes[lane - 1]) and not (lane + 1 < len(lanes) and lanes[lane + 1])
    place = ("alone" if alone else "run") if lanes[lane] and not own else lane
    return (id(costs), tuple(map(bool, lanes)), place, k_max, models)


def drift(before: tuple, after: tuple) -> float:
    """How far `after` moved from `before` (SlotRecords.basis): the largest relative move of a price, or absolute
    move of an acceptance; infinite where either changed its size (a shape learned, a first record registered)."""
    (prices, spans), (now, now_spans) = before, after
    if len(prices) != len(now) or len(spans) != len(now_spans):
        return float("inf")
    moved = max((abs(b / a - 1) for a, b in zip(prices, now) if a), default=0.0)
    return max([moved, *(abs(b - a) for a, b in zip(spans, now_spans))])


@dataclass
class TickPlan:
    """AutoPolicy.price_at's answer for a shape of batch (plan_key), which every slot whose batch has
    that shape takes."""

    tick: int  # the batch it was worked out after
    planned: dict[str, int] | None  # each drafting model's length (None: a prompt's chunk goes on beside)
    views: tuple[Prices, ...]  # each record's prices, in AutoPolicy._records' order
    costs: CostModel  # the cost model (by context size) priced from
    key: tuple  # its key in SlotRecords.plans
    lanes: tuple[int, ...]  # the batch it was worked out after, as many tokens of each slot
    basis: tuple = field(default=(), init=False, repr=False)  # what priced it, where it may stand on (SlotRecords.put)
    reach: bool | None = None  # _lookup_may_pay's answer in this batch, once a slot has worked it out
    replaced: bool = False  # a newer plan took its key, or a record it priced restarted (SlotRecords.renew)

    def __post_init__(self) -> None:
        self.idle = self.planned is not None and not any(self.planned.values())  # no model drafts: it may stand
        self.drafts = self.planned is not None and not self.idle  # a model drafts
        # the first tick it no longer prices (price_at): the next where a model drafts; else (none, or beside a
        # prompt's chunks, where each step chooses) REACH_TICKS on, unless a model drafts sooner (AutoPolicy.observe)
        self.lasting = self.idle or self.planned is None  # (a plan priced again next tick never stands longer)
        self.until = self.tick + (REACH_TICKS if self.lasting else 1)
        self.quiet = False  # idle, and no lookup guess pays (set with reach: every quiet step reads it)
        self.worth: dict[int, bool] = {}  # worth_probing's answers, by the record's prices (a view of this plan)

    def cut(self, tick: int) -> None:
        """What it priced changed after batch `tick` (a model drafted): priced again from the next tick."""
        self.until, self.lasting = min(self.until, tick + 1), False

    def worth_probing(self, record: AdaptiveLength) -> bool:
        """Whether a probe of `record`'s drafter could pay at this plan's prices (AdaptiveLength.worth_probing),
        worked out by a slot for every slot: its price reads every slot's record (SharedBatch, following)."""
        worth = self.worth.get(id(record.costs))
        if worth is None:
            worth = self.worth[id(record.costs)] = record.worth_probing()
        return worth

    def reached(self, reach: bool) -> None:
        """_lookup_may_pay's answer, worked out by a slot for every slot."""
        self.reach, self.quiet = reach, self.idle and not reach


@dataclass
class QuietRun:
    """A slot's quiet steps after one AutoPolicy._quiet found on the pool's `plan`: taken without asking it again
    while the plan stands for batches like the one the run began after (AutoPolicy.plan), `left` more at most, and
    counted when the run ends (settle)."""

    plan: TickPlan | None = None
    lanes: tuple[int, ...] = ()  # the batch it began after
    left: int = 0  # the steps it may still take
    granted: int = 0
    rest: tuple[SlotRecords, int, int] | None = None  # riding the pool's rest: (the pool's, busy slots, its epoch)

    def start(self, plan: TickPlan, lanes: tuple[int, ...], records: tuple[AdaptiveLength, ...], room: int,
              pool: SlotRecords | None = None) -> None:
        """A run on `plan` after batch `lanes`: `room` plain steps at most (to the longest context its cost model
        prices: each commits one token), and to the next probe of `records` due, unless the plan says a lone
        drafting model's probes would not pay (each falling due is then deferred, as _quiet defers it). `pool`: the
        pool whose rest `plan` is (SlotRecords.rest_plan), where the run goes on after other batches too (goes_on)."""
        if not (len(records) == 1 and not plan.worth_probing(records[0])):  # (else each probe due is deferred)
            room = min([room, *(r.rests_for() for r in records)])  # (no drafting model: lookup's alone)
        self.plan, self.lanes = plan, lanes
        self.left = self.granted = max(0, room)
        self.rest = (pool, busy(lanes), pool.epoch) if pool is not None else None

    def goes_on(self, lanes: tuple[int, ...], tick: int) -> bool:
        """Whether a run on the pool's rest goes on after batch `tick` of `lanes` (not the one it began after): as
        many busy slots, none of whose steps drafted since (SlotRecords.drafted), or as many as the pool rests at too
        (SlotRecords.rest_plan, at the plan's context size: the run ends at its last). Where it does, the run goes on
        as if it began after `lanes` (the next steps after such batches are not asked this again)."""
        if self.rest is None:
            return False
        pool, count, epoch = self.rest
        now = busy(lanes)
        if (pool.epoch == epoch and now == count) or pool.rest_plan(now, self.plan.costs, tick) is not None:
            self.lanes, self.rest = lanes, (pool, now, pool.epoch)
            return True
        return False

    def settle(self, records: tuple[AdaptiveLength, ...]) -> int:
        """The run's steps taken, counted to `records` as rest() counts each (a probe falling due deferred); the run
        ends. Returns how many."""
        taken = self.granted - self.left
        if taken:
            for record in records:
                record.rested(taken)
        self.left = self.granted = 0
        return taken


@dataclass
class SlotRecords:
    """A pool's slots' drafting-model records by lane, each slot's policy registering its own (AutoPolicy.observe):
    a slot prices the batch it shares by what each other slot's drafter keeps (SharedBatch); and the pool's cost
    models by context size, which every slot's steps teach and price from (a tick's views are made once there)."""

    draft: dict[int, AdaptiveLength] = field(default_factory=dict)  # the draft model's
    mtp: dict[int, AdaptiveLength] = field(default_factory=dict)  # the MTP heads'
    contexts: dict[int, ContextCosts] = field(default_factory=dict)  # by id of the measured cost model
    plans: dict[tuple, TickPlan] = field(default_factory=dict)  # AutoPolicy.price_at's, by plan_key
    quiet_since: dict[int, int] = field(default_factory=dict)  # by busy slots: since which batch none drafted there
    rests: dict[tuple[int, int], TickPlan] = field(default_factory=dict)  # rest_plan's, by busy slots and cost model
    epoch: int = 0  # steps that drafted so far (QuietRun.goes_on)

    def standing(self, key: tuple | None, costs: CostModel, tick: int) -> TickPlan | None:
        """The plan under `key` that prices the steps after batch `tick` at `costs`, where one stands: before its
        `until`, or due but priced from what has not moved since (PLAN_DRIFT: it then stands REACH_TICKS more). A
        plan worked out after a later batch than `tick` stands too (the same shape, newer prices)."""
        plan = self.plans.get(key) if key is not None else None
        return plan if plan is not None and self._stands(plan, costs, tick) else None

    def _stands(self, plan: TickPlan, costs: CostModel, tick: int) -> bool:
        """Whether `plan` prices the steps after batch `tick` at `costs` (standing's rule)."""
        if plan.costs is not costs:
            return False
        if tick < plan.until:
            return True
        if plan.lasting and drift(plan.basis, self.basis(costs)) <= PLAN_DRIFT:
            plan.until = tick + REACH_TICKS
            return True
        return False

    def basis(self, costs: CostModel) -> tuple:
        """What a plan at `costs` is priced from: its prices (CostModel.table), and each drafting model's slots'
        records' lowest and highest acceptance at each length (a slot with no record is priced by the pricing
        slot's)."""
        spans = tuple(x for records in (self.draft, self.mtp) if records
                      for column in zip(*(r.acceptance for r in list(records.values())))
                      for x in (min(column), max(column)))
        return costs.table(), spans

    def put(self, plan: TickPlan) -> TickPlan:
        """`plan` under its key, with what it was priced from where it may stand on (basis: a plan priced again
        next tick never does); the plan it takes the key from is marked replaced (its holders take the new one)."""
        if plan.lasting:
            plan.basis = self.basis(plan.costs)
        old = self.plans.get(plan.key)
        if old is not None:
            old.replaced = True
        self.plans[plan.key] = plan
        return plan

    def rest_plan(self, busy: int, costs: CostModel, tick: int) -> TickPlan | None:
        """The plan the pool rests on at `busy` busy slots and `costs` (a context size's) after batch `tick`, if it
        does: the last quiet plan found there (no model drafts, no lookup guess could pay: `rested`), while it stands
        (as `standing` says: on past its due tick while nothing it was priced from moved), where no step has drafted
        at this many busy slots for REACH_TICKS ticks. A step whose batch has no quiet plan of its own standing
        (another slot's prompt chunk beside it, an idle slot elsewhere, a generation joining) takes it unpriced
        (AutoPolicy._quiet, _join): pricing each such batch anew was most of `auto`'s planning in a busy pool where
        nothing pays (docs/engine-overhead.md). A context size new to the pool is priced."""
        plan = self.rests.get((busy, id(costs)))
        if plan is None or plan.replaced or tick - self.quiet_since.get(busy, tick) < REACH_TICKS:
            return None
        return plan if self._stands(plan, costs, tick) else None

    def rested(self, busy: int, plan: TickPlan, tick: int) -> None:
        """`plan` stands quiet for a step at `busy` busy slots after batch `tick`: the one the pool rests on there."""
        self.quiet_since.setdefault(busy, tick)
        self.rests[busy, id(plan.costs)] = plan

    def drafted(self, busy: int, tick: int) -> None:
        """A step drafted in batch `tick` of `busy` busy slots (beside no prompt's chunk): no rest there for
        REACH_TICKS ticks."""
        self.quiet_since[busy] = tick
        self.epoch += 1

    def renew(self) -> None:
        """A slot's record restarted (a generation begins): every plan priced with the old one is priced again."""
        for plan in self.plans.values():
            plan.replaced = True
        self.plans.clear()

    def context_costs(self, costs: CostModel) -> ContextCosts:
        """The pool's cost models by context size, starting from `costs`."""
        shared = self.contexts.get(id(costs))
        if shared is None or shared.base is not costs:
            shared = self.contexts[id(costs)] = ContextCosts(costs)
        return shared
