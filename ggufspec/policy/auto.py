"""`auto`'s policy: lookup where the text repeats itself, else the draft model or the target's MTP head (whichever is
expected to commit more), or Medusa's sized tree, else plain steps, each chosen where the measured cost model expects
it to commit the most tokens a second."""

from __future__ import annotations

from collections.abc import Callable
from ..costs import ContextCosts, CostModel, MtpPrices, SharedBatch
from ..decoder import SLOT_CHUNK
from ..proposers import Context, Draft, Proposer
from ..proposers.lookup import LONG_MATCH
from ..verifier import Verdict
from . import PLAIN, Plan, Timing, check_tree, observe_tree
from .adaptive import COPY_PRIOR, PHRASE_MATCH, AdaptiveLength, Unverified
from .catch_up import catch_up_pays
from .decision import decision
from .shared import REACH_TICKS, QuietRun, SlotRecords, TickPlan, beside_prompt, busy, plan_key
from .tree_sizer import TreeSizer

# While a pool's plan stands (REACH_TICKS ticks where nothing drafts), the cost model learns from one quiet tick in
# this many (its first slot's step): the prices learned meanwhile price only the next plan, and learning from every
# tick cost a pool of 8 quiet slots as much as their planning (docs/methods.md#measured-constants: QUIET_LEARN_EVERY)
QUIET_LEARN_EVERY = 64
# A generation's start moves its drafting records' acceptance halfway back to the prior: where that moves none by more
# than this, the pool's plans (priced by every slot's records) stand; else each is priced again (SlotRecords.renew).
MOVED = 1e-3
MTP_MEMORY = 0.8  # the MTP head's record: each judged guess moves it 20% of the way (other records: 5%)


class AutoPolicy:
    """Lookup's guess when verifying it pays (priced by how far back its match reaches: a chance n-gram, a phrase said
    again or a copy starting, a copy), else the drafting model (the draft model, or the target's MTP head: `mtp`) whose
    chain is expected to commit the most tokens a second when drafting pays, else (with Medusa heads instead of a
    draft model) the sizer's tree when it pays, else a plain step.

    Each source keeps its own acceptance record, and lookup's guesses cost no draft decodes, so lookup can pay on a
    machine where the draft model cannot; the MTP head is priced at its own steps (costs.MtpPrices). Kept across
    generations: what it learned carries over (see restart).
    """

    def __init__(self, costs: CostModel, k_max: int, model: bool, sizer: TreeSizer | None = None,
                 mtp: bool = False, slot_records: SlotRecords | None = None,
                 peers: Callable[[], int] = lambda: 0, last_tick: Callable[[], int] = lambda: -1) -> None:
        """`sizer`: Medusa's tree sizer (its heads draft too); `mtp`: the target's MTP head drafts; `slot_records`:
        a pool's, shared by its slots' policies; `peers`: how many other slots generate now, and `last_tick`: the
        pool's last batch's number (both read at begin)."""
        self.k_max, self.sizer = k_max, sizer
        self.context_costs = slot_records.context_costs(costs) if slot_records else ContextCosts(costs)
        # each kind of lookup match keeps its own record: a copy's guesses are kept far more often than a chance
        # n-gram's, and one record for all would let failed chance guesses keep lookup off through whole copies
        # chance n-gram matches, under PHRASE_MATCH tokens
        self.lookup_length = AdaptiveLength(costs, k_max, free=True)
        # matches of PHRASE_MATCH up to LONG_MATCH tokens: a phrase said again, or the first tokens of a copy
        self.phrase_length = AdaptiveLength(costs, k_max, free=True)
        # the answer copies earlier text (LONG_MATCH tokens or more): the only kind whose guesses may run past k_max
        self.copy_length = AdaptiveLength(costs, k_max, prior=COPY_PRIOR, free=True, longer=costs.k_long)
        self.model_length = AdaptiveLength(costs, k_max) if model else None
        # an MTP head's guesses are kept far more often on some texts than on others (0% to 100% from one prompt to the
        # next), so its record follows a generation within a few guesses: at the default memory the head drafted on
        # for several steps at a loss at the start of each prompt where it guessed badly.
        # docs/methods.md#measured-constants: MTP_MEMORY
        self.mtp_length = AdaptiveLength(MtpPrices(costs), k_max, memory=MTP_MEMORY) if mtp else None
        self.source: AdaptiveLength | None = None  # the record whose choice the target is judging
        self._unverified = Unverified()  # lookup guesses not verified
        self._proposed: tuple[AdaptiveLength, int, list[int]] | None = None  # the lookup guess just planned
        self._lookup_records = (self.lookup_length, self.phrase_length, self.copy_length)
        self._records = tuple(r for r in (*self._lookup_records, self.model_length, self.mtp_length) if r is not None)
        self.lookup = self.model = self.mtp = None  # this generation's proposers, consulted while planning
        # the last target batch's tokens per sequence and this slot's sequence there (EnginePool): steps are priced
        # per batch while other slots share it
        self.lanes: tuple[int, ...] = ()
        self.lane = 0
        self.tick = -1  # the last target batch's number (-1: none yet, or one of its own)
        self._peers, self._last_tick = peers, last_tick
        self.peers = 0  # other slots generating when this generation began
        self.slot_records = slot_records
        pool = slot_records
        self._models = [m for m in (("draft", self.model_length, pool.draft if pool else None),
                                    ("mtp", self.mtp_length, pool.mtp if pool else None)) if m[1] is not None]
        self._model_names = tuple(name for name, _, _ in self._models)
        self._model_records = tuple(record for _, record, _ in self._models)
        self._quiet_source = self._model_records[0] if self._models else self.lookup_length  # the record timing one
        self._mtp_prices: dict[int, MtpPrices] = {}  # a view per cost model (ContextCosts keeps them)
        # this generation's steps by what drafted them (None: plain), and the steps lookup had a guess at: decision()
        self.steps: dict[str | None, int] = {None: 0}
        self.guessed = 0
        self.unsearched = 0  # steps whose batch left lookup no guess worth searching for (_lookup_may_pay)
        self._reach: tuple[int, tuple, bool] | None = None  # _lookup_may_pay's last answer: (tick, shape, answer)
        self._tick_plan: TickPlan | None = None  # the pool's plan the last price_at took (None: priced its own)
        self._last_ctx = 0  # the longest context priced by the same cost model as the last price_at's
        self._quiet_step, self._run = False, QuietRun()  # the step planned is quiet (_quiet); those after it (run)
        self._models_off = False  # the last plan priced for the pool's steps has no drafting model drafting

    @property
    def k_cap(self) -> int:
        """The most tokens a step may draft: long guesses that continue a copy, where measured, else k_max."""
        return max((self.k_max, *self.copy_length.longer))

    @property
    def guess_planned(self) -> bool:
        """Whether the step just planned holds a lookup guess for the target to verify: True from a plan() that
        chose one until the next plan() or begin(), or until a tree takes its place (the guess is then judged as one
        left unverified)."""
        return self._proposed is not None

    @property
    def costs(self) -> CostModel:
        """The cost model measured at start-up (short context)."""
        return self.context_costs.base

    def models(self) -> list[tuple[str, AdaptiveLength, dict[int, AdaptiveLength] | None]]:
        """The drafting models: (source name, record, the pool's records of its slots by lane)."""
        return self._models

    def _prices(self, record: AdaptiveLength, costs: CostModel) -> CostModel | MtpPrices:
        """`costs` as `record` reads them: the MTP head's record at its own steps' prices."""
        if record is not self.mtp_length:
            return costs
        view = self._mtp_prices.get(id(costs))
        if view is None or view.base is not costs:
            view = self._mtp_prices[id(costs)] = MtpPrices(costs)
        return view

    def price_at(self, n_ctx: int) -> dict[str, int] | None:
        """Price the next steps at the costs learned for a context of n_ctx tokens, in a batch shared with the other
        slots of the last one. Returns each drafting model's planned length where pricing it took it, else None."""
        costs = self.context_costs.at(n_ctx)
        self._last_ctx = self.context_costs.last_at(n_ctx)
        if not (self.lanes and sum(self.lanes) > self.lanes[self.lane]):  # a batch of its own
            self._tick_plan = None
            for length in self._records:
                length.costs = self._prices(length, costs)
            return None
        # each other busy slot is priced as stepping next (or as its prompt's chunk), so every slot in a batch of the
        # same shape (where some are idle or a prompt goes on, in the same place) prices the same: worked out by the
        # tick's first slot, taken by the others; where no model drafts, for REACH_TICKS ticks and on while what priced
        # it stands (SlotRecords.standing; what the slots' full steps teach the cost model prices the next plan)
        key = self._plan_key(costs) if self.tick >= 0 else None
        kept = self.slot_records.standing(key, costs, self.tick) if key is not None else None  # (key: a pool's)
        if kept is not None:
            if kept is not self._tick_plan:  # (the records hold its views from this slot's last step otherwise)
                self._take(kept, n_ctx)
            return kept.planned  # (read only)
        planned = self._price_shared(costs)
        self._note(planned)
        self._tick_plan = None
        if key is not None and planned and any(planned.values()):
            key = self._plan_key(costs, own=True)  # the others step k + 1 tokens: this slot's place prices its chain
        if key is not None:
            views = tuple(r.costs for r in self._records)
            self._tick_plan = self.slot_records.put(TickPlan(self.tick, planned, views, costs, key, self.lanes))
        return planned

    def _plan_key(self, costs: CostModel, own: bool = False) -> tuple | None:
        """The key of the pool's plan for a batch like the last one (shared.plan_key); None without a pool."""
        pool = self.slot_records is not None
        return plan_key(costs, self.lanes, self.lane, self.k_max, self._model_names, own) if pool else None

    def _join(self, n_ctx: int) -> bool:
        """Where this generation joins busy slots whose pool's plan prices every slot busy (no record moved since:
        SlotRecords.renew), take it as of the batch it was worked out after, for begin and the first step (the next
        batch's number tells whether it stood that long); else the plan the pool rests on (SlotRecords.rest_plan).
        Whether it did."""
        if self.slot_records is None or not self.peers:
            return False
        costs = self.context_costs.at(n_ctx)
        plan = self.slot_records.plans.get(self._plan_key(costs))
        if plan is not None and plan.costs is costs:
            self.tick = plan.tick
        elif (plan := self.slot_records.rest_plan(busy(self.lanes), costs, self.tick)) is None:
            return False
        self._take(plan, n_ctx)
        return True

    def _take(self, plan: TickPlan, n_ctx: int) -> None:
        """Price the next steps after n_ctx tokens as the pool's `plan` does: its views for every record."""
        self._tick_plan = plan
        self._last_ctx = self.context_costs.last_at(n_ctx)
        for length, view in zip(self._records, plan.views):
            length.costs = view
        self._note(plan.planned)

    def _note(self, planned: dict[str, int] | None) -> None:  # (a plan's lengths taken: whether none drafts)
        if planned is not None:
            self._models_off = not any(planned.values())

    def _price_shared(self, costs: CostModel) -> dict[str, int] | None:
        """price_at's, in a batch shared with other slots."""
        # the draft model's choice prices every slot drafting alike (SharedBatch) while each steps next (no other
        # slot's prompt going on): pricing each chain alone beside the others' last ones, two slots would swap turns,
        # each evening the other's last batch into a new uneven one.
        # A full chunk of a prompt is followed by its next one; a shorter chunk was its last, and a long guess rarely
        # goes on in step, so those slots step next: priced as still there, a prompt's last chunk would make guesses
        # look as if they rode the prompt, and they would run beside plain steps instead. With
        # `-b` under SLOT_CHUNK a pool's chunks are shorter, and every one is priced as its prompt's last.
        # The MTP head's choice is priced so too, on its own records.
        going_on = [i != self.lane and n >= SLOT_CHUNK for i, n in enumerate(self.lanes)]
        steps = not any(going_on)
        planned: dict[str, int] | None = {} if steps else None
        for name, record, slots in self.models() if steps else ():
            # every slot's record (one copy under the GIL: a member thread's slot may add to it)
            fellows = lambda slots=slots or {}: {i: r.acceptance for i, r in slots.copy().items()}  # noqa: E731
            record.costs = SharedBatch.of(self._prices(record, costs), self.lanes, self.lane, self.tick, follow=True,
                                          fellows=fellows)
            planned[name] = record.planned()
        # Lookup's guesses are priced beside the others' steps as the draft model's shared choice makes them (k + 1
        # tokens each, or 1), not as their last chains: those were lookup's guesses too, which rarely continue in
        # step, and a chain priced as evening them out would run, beside plain steps, as a micro-batch of its own,
        # for more target time than plain batching.
        k = max(planned.values(), default=0) if planned else 0
        lanes = [n if i == self.lane or going_on[i] else (k + 1 if n else 0) for i, n in enumerate(self.lanes)]
        beside = SharedBatch.of(costs, lanes, self.lane, self.tick)
        for length in self._lookup_records:
            length.costs = beside
        for _, record, _ in () if steps else self.models():
            record.costs = SharedBatch.of(self._prices(record, costs), lanes, self.lane, self.tick)
        return planned

    def begin(self, prompt: list[int], proposers: dict[str, Proposer]) -> set[str]:
        """Every record's acceptance halfway back to its prior; the draft model decodes the prompt only where it is
        expected to draft (often never on CPUs), priced beside the `peers` generating now, each taken to add one
        token a batch: a slot joining a busy pool on a CPU rarely drafts, and the draft's prefill (a tick that
        every slot waits for) would be lost."""
        self._settle()
        self.lookup, self.model, self.mtp = proposers["lookup"], proposers.get("draft"), proposers.get("mtp")
        if self.sizer is not None:
            check_tree(self.sizer, proposers)
        moved = False
        for length in self._records:
            before = length.acceptance
            length.restart()
            if length in self._model_records:
                moved |= max(abs(a - b) for a, b in zip(before, length.acceptance)) > MOVED
        if self.slot_records is not None and moved:  # (the pool's plans price every slot's drafting record)
            self.slot_records.renew()
        self._unverified.clear()
        self.source = self._proposed = None
        # passes by what they drafted from: the prompt's, which picks the first token, drafts nothing
        self.steps, self.guessed, self.unsearched = {None: 1}, 0, 0
        self.peers = self._peers()
        self.lanes, self.lane = ((1,) * (1 + self.peers), 0) if self.peers else ((), 0)
        # priced as of the pool's last batch, where no plan for it is there to join: slots starting together price once
        self.tick = self._last_tick() if self.peers else -1
        self._tick_plan = None
        planned = self._tick_plan.planned if self._join(len(prompt) + 1) else self.price_at(len(prompt) + 1)
        return {name for name, record, _ in self.models() if self._proposer(name) is not None
                and (record.planned() if planned is None else planned[name]) > 0}

    def _proposer(self, name: str) -> Proposer | None:
        return self.model if name == "draft" else self.mtp

    def plan(self, context: Context, room: int, deferred: int) -> Plan:
        run = self._run  # a quiet run goes on while the pool's plan stands for batches like the one it began after
        if (run.left and not run.plan.replaced and self.tick < run.plan.until
                and (self.lanes == run.lanes or run.goes_on(self.lanes, self.tick))):
            run.left -= 1
            return PLAIN
        self._settle()
        # (Medusa's steps are planned in full: its sizer plans a tree every step)
        self._quiet_step = self.slot_records is not None and self.sizer is None and self._quiet(context)
        if self._quiet_step:
            return PLAIN
        nodes = None
        if self.sizer is not None and context.hidden is not None:
            nodes = self.sizer.plan(max_depth=room - 1)
        # deferred tokens ride in front of the batch: it stays within the measured sizes
        plan = self._chain(context.tokens, max(0, min(self.k_cap - deferred, room - 1)), deferred, room)
        if self.sizer is None:
            return plan
        # against a plain step lookup's own choice stands (a probe's too); against a tree, gains over a plain step:
        # lookup prices the current context, the sizer the start-up measurement
        if plan.k and (nodes is None or len(nodes) == 1 or self.lookup_gain(plan.k) > self.sizer.gain):
            return plan
        if nodes is not None and len(nodes) > 1:
            self._withdraw()  # lookup times only its own and plain steps
        if nodes is not None and self.sizer.wants_heads(len(nodes)):
            return Plan("medusa", nodes=nodes)
        return PLAIN

    def _chain(self, context: list[int], k: int, deferred: int, room: int) -> Plan:
        """Lookup's guess, the draft model's chain (or tree), or nothing; `source` is the record that chose; `room`:
        the tokens this generation may still commit."""
        self.source = self._proposed = None
        if k <= 0:
            return PLAIN
        if self._models_off and beside_prompt(self.lanes, self.lane):
            return self._beside_prompt(context, k)
        # the drafting models' lengths, priced once a step: catch_up_pays and choose take them from here
        planned = self.price_at(len(context))
        self._unverified.judge(context)
        reach = self._lookup_may_pay()
        self.unsearched += not reach
        guess = self.lookup.find(context, k) if reach else []
        plan = self._guess(context, guess, models=True)
        return plan if plan is not None else self._model_plan(context, room, min(k, self.k_max - deferred), planned)

    def _guess(self, context: list[int], guess: list[int], models: bool) -> Plan | None:
        """Lookup's `guess` after `context` as the step, where verifying it pays (and, with `models`, beats each
        drafting model's own chain); else None, the guess left unverified (judged later). `source`: its record."""
        match = self.lookup.match if guess else 0
        self.guessed += bool(guess)
        self.source = (self.copy_length if match >= LONG_MATCH else
                       self.phrase_length if match >= PHRASE_MATCH else self.lookup_length)
        # no guess, nothing to choose: no price, no plain step counted toward a probe, no probe with nothing to verify
        # (its record still times the plain step). Priced, they took a fifth of `auto`'s planning in an 8-slot pool.
        if not guess:
            return None
        n = min(self.source.choose(), len(guess))
        judged_later = self.source, len(context), guess[: self.k_max]
        if n and not (models and self._model_beats_lookup(n, self.source)):
            self._proposed = judged_later
            return Plan("lookup", n)
        self._unverified.append(judged_later)
        return None

    def _beside_prompt(self, context: list[int], k: int) -> Plan:
        """_chain's step beside another slot's prompt chunk while the pool's steps draft from no model: the models
        rest (a probe falling due is deferred), and lookup's guess is priced only where it found one: each slot's
        place beside each new chunk was priced anew, most of a busy pool's planning (docs/engine-overhead.md)."""
        self._unverified.judge(context)
        for record in self._model_records:
            if not record.rest():
                record.defer()
        guess = self.lookup.find(context, k)
        if guess:
            self.price_at(len(context))
        plan = self._guess(context, guess, models=False)
        if plan is None:
            self.source = self._quiet_source  # the record that times a plain step, as _quiet's
        return plan if plan is not None else PLAIN

    def _quiet(self, context: Context) -> bool:
        """A pool's plain step known without pricing it, as most are where nothing pays (beside many busy slots on a
        CPU): the pool's plan that priced this slot's last step, or the one standing for this context and batch (as
        price_at takes it), else the one the pool rests on (SlotRecords.rest_plan), has no model drafting and no
        lookup guess worth searching for, and no probe is due (or the one due is not worth it at the plan's prices:
        deferred here, as the full plan would). Counted as the full plan would count it; the first drafting model's
        record times it (the full plan's catch-up rule is weighed when a probe is made); guesses left unverified judged
        as far as the context has caught up with them (the rest later: what was committed stays). The steps after it
        run on the plan unasked (QuietRun), on the pool's rest after other batches of as many busy slots too."""
        if self._unverified:
            self._unverified.judge(context.tokens)
        n_ctx = len(context)
        now = self._tick_plan
        if now is None or now.replaced or n_ctx > self._last_ctx or self.lanes != now.lanes or self.tick >= now.until:
            costs = self.context_costs.at(n_ctx)  # the pool's plan that price_at would take, where one stands
            now = self.slot_records.standing(self._plan_key(costs), costs, self.tick)
            if now is not None:
                self._take(now, n_ctx)
        if now is not None and now.drafts:
            return False
        count = busy(self.lanes)
        if now is not None and now.quiet:  # (where the pool rests, it rests on the last one found)
            self.slot_records.rested(count, now, self.tick)
        rest = self.slot_records.rest_plan(count, self.context_costs.at(n_ctx), self.tick)
        if now is None or not now.quiet:  # none quiet for this batch: the pool's rest, if it rests
            if rest is None:
                return False
            now = rest
            self._take(now, n_ctx)
        records = self._model_records
        if len(records) > 1 and not all(record.rests() for record in records):  # (none counts unless all rest)
            return False
        for record in records:
            if not record.rest():  # a probe is due: the full plan makes it, unless the pool's plan says none pays
                if len(records) > 1 or now.worth_probing(record):
                    return False
                record.defer()
        self.source = self._quiet_source
        self._proposed = None
        self.unsearched += 1
        self.steps[None] += 1
        self._run.start(now, self.lanes, self._model_records, self._last_ctx - n_ctx,
                        self.slot_records if now is rest else None)
        return True

    def _settle(self) -> None:
        """The quiet run's steps taken (plan) counted as _quiet counts each: a plain step that searched nothing."""
        taken = self._run.settle(self._model_records)
        self.steps[None] += taken
        self.unsearched += taken

    def _lookup_may_pay(self) -> bool:
        """Whether any lookup guess could pay in the batch priced: where even one of the longest kept whole would not
        (beside many busy slots on a CPU), the search is skipped, and so is what its records would learn from it.
        Worked out again after REACH_TICKS ticks, or when the batch's shape changes (a pool's slots all at once: the
        tick's view remembers it); a batch of its own always searches."""
        c, longer = self.copy_length.costs, self.copy_length.longer
        if not c.shared:
            return True
        tick = self._tick_plan  # where every slot's batch is alike, one slot works it out for all
        if tick is not None and tick.reach is not None:
            return tick.reach
        shape = (self.lanes, self.lane, id(c.base), longer)
        if (tick is None and self._reach is not None and self._reach[1] == shape
                and 0 <= self.tick - self._reach[0] < REACH_TICKS):
            return self._reach[2]
        reach = self.copy_length.may_pay()
        self._reach = (self.tick, shape, reach)
        if tick is not None:
            tick.reached(reach)
        return reach

    def _model_plan(self, context: list[int], room: int, k: int, planned: dict[str, int] | None) -> Plan:
        """The drafting model whose chain is expected to commit the most tokens a second, of those whose catching up
        pays (at most k drafts); else a plain step, timed by the first of them (each probes on its own record)."""
        best: tuple[float, str, AdaptiveLength, int] | None = None
        first = None
        for name, record, _ in self.models():
            proposer = self._proposer(name)
            at = record.planned() if planned is None else planned[name]
            if proposer is None:
                continue
            if not catch_up_pays(proposer, record, context, room, at, busy(self.lanes) or 1):
                if not at and not record.rests():
                    record.defer()
                continue
            first = first or record
            n = min(record.choose(at), k)
            rate = record.costs.expected_rate(n, record.acceptance) if n else 0.0
            if n and (best is None or rate > best[0]):
                best = (rate, name, record, n)
        if best is None:
            self.source = first or self.source
            return PLAIN
        self.source = best[2]
        return Plan(best[1], best[3])

    def observe(self, plan: Plan, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
        shape = verdict.shape
        self.lanes, self.lane, self.tick = shape.lanes, verdict.lane, shape.tick
        if self._quiet_step:  # a plain step of a pool whose records are registered (the full plan came first)
            if shape.tick % QUIET_LEARN_EVERY == 0 and timing is not None and not self.source.costs.learned(shape.tick):
                self.source.update(0, 0, timing)  # (the tick's first slot teaches the cost model)
            return
        # the pool's steps draft at this many busy slots: no rest there (a guess beside a prompt's chunk, which the
        # rest forgoes, does not end it: it would, whenever one was found before the pool rested again)
        if draft.tokens and self.slot_records is not None and not beside_prompt(shape.lanes, self.lane):
            self.slot_records.drafted(busy(shape.lanes), shape.tick)
        for _, record, slots in self.models() if verdict.shape.lanes else ():
            if slots is not None:
                slots[self.lane] = record
        if plan.source in self._model_names and self._tick_plan is not None:  # what it priced changes: the pool's
            self._tick_plan.cut(self.tick)  # plan is priced again next tick
        source = plan.source if draft.tokens else None  # a step that drafted nothing ran as a plain one
        self.steps[source] = self.steps.get(source, 0) + 1
        drafted = kept = 0
        if plan.source in ("lookup", "draft", "mtp"):
            drafted, kept = len(draft.tokens), verdict.kept
        elif self.sizer is not None:
            observe_tree(self.sizer, draft, verdict, timing)
        if self.source is not None:  # the record that chose: it also times plain steps
            self.source.update(drafted, kept, timing)

    def decision(self) -> str:
        """What this generation drafted from, and why nothing, or why a drafting model stayed off, at the costs of
        the last context (decision.decision): for the stats line and --json."""
        self._settle()
        return decision(self)

    def _withdraw(self) -> None:
        """The lookup guess just planned is not verified (the tree runs instead): the step teaches its record
        nothing, and the guess is judged as one left unverified."""
        if self._proposed is not None:
            self._unverified.append(self._proposed)
        self.source = self._proposed = None

    def lookup_gain(self, n: int) -> float:
        """Expected tokens per second of verifying the n-token lookup guess just planned, on the record of its
        kind (`source`), over a plain step's, both at the current context's costs; no side effects. plan() verifies
        the guess instead of a Medusa tree only where this beats the tree's gain. Needs a planned lookup guess."""
        costs = self.source.costs
        return costs.expected_rate(n, self.source.acceptance, free=True) / costs.expected_rate(0, 0)

    def _model_beats_lookup(self, n: int, length: AdaptiveLength) -> bool:
        """While a drafting model drafts, lookup is not free: the model must still read every token a lookup step
        commits before it drafts again. Charged here at costs.catch_up per token (a draft model's step: a catch-up
        batch costs a little less), lookup's guess is verified only if it still beats each model's own proposal."""
        tokens = self.costs.expected_tokens(n, length.acceptance)  # its last entry: all deeper positions
        for _, model, _ in self.models():
            planned = model.planned()
            if not planned:
                continue
            costs = self._prices(model, self.costs)
            lookup_rate = tokens / (costs.step_seconds(n, free=True) + tokens * costs.catch_up)
            if costs.expected_rate(planned, model.acceptance) > lookup_rate:
                return True
        return False
