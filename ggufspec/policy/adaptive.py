"""`AdaptiveLength`: one record of how often a source's drafts are kept, and the draft length that pays on it."""

from __future__ import annotations

from ..costs import Prices
from ..history import common_prefix
from . import Timing

PROBE_EVERY = 16  # plain steps before the first probe while speculation is off; doubled after each failed one
PROBE_EVERY_MAX = 128
OPTIMISTIC = 0.9  # probes are made only if drafts kept this often would beat plain decoding
# by this factor: a probe costs a bigger batch and the draft catching up on every token since its last
# use, so a probe that can gain only a little loses. docs/methods.md#measured-constants: PROBE_GAIN
PROBE_GAIN = 1.2
# Drafting only when expected to beat plain decoding by this factor: an estimate at break-even is as likely a loss,
# since the cost model and the acceptance are estimates. docs/methods.md#measured-constants: MIN_GAIN
MIN_GAIN = 1.05
# ...or by this one in a batch shared with other slots (costs.SharedBatch), whose price leaves out what drafting
# does to them: the slots that draft fall out of step with the others, and batches run part-filled at the end.
# docs/methods.md#measured-constants: SHARED_GAIN
SHARED_GAIN = 1.15
COPY_PRIOR = 0.9  # what a guess that continues a copy (lookup.LONG_MATCH) is expected to keep, before any evidence
# A guess whose context matches earlier text for at least this many tokens is priced apart from shorter matches:
# it is kept more often than one after a 2- or 3-token chance match, and waiting for a LONG_MATCH would spend
# plain steps at the start of every copy. docs/methods.md#measured-constants: PHRASE_MATCH
PHRASE_MATCH = 4


class AdaptiveLength:
    """Pick k each step to maximise expected tokens per second, drafting only for a gain of at least
    MIN_GAIN (SHARED_GAIN beside other slots); k = 0 turns speculation off.

    Acceptance is a running average per draft position (a draft that got its first token right
    tends to get the next one right too), carried from one generation to the next but pulled
    halfway back to the prior at each start, so every prompt gets a fair try. While off, a probe
    at the best non-zero length keeps the estimates alive: after PROBE_EVERY plain steps, twice
    as long after each probe that did not pay for itself (one not worth making: defer). A probe
    costs a bigger batch and a draft catching up, so none is made when even good drafts would gain
    little (on CPUs where a batch of 4 costs ~2.6 decodes, as on the AVX2-only machines here, the
    best case is a few percent).
    """

    def __init__(self, costs: Prices, k_max: int, prior: float = 0.7, memory: float = 0.95,
                 free: bool = False, longer: tuple[int, ...] = ()) -> None:
        self.costs, self.k_max, self.memory, self.prior, self.free = costs, k_max, memory, prior, free
        self.longer = longer  # lengths past k_max that may be drafted too (lookup's long guesses)...
        self._all_kept = False  # ...only right after a guess kept whole: one long miss, then short ones again
        # per position up to k_max; with `longer`, one more entry: every position from k_max-1 on (a guess
        # that has held that far in copied text tends to hold on)
        self.acceptance = [prior] * (k_max + bool(longer))
        self._off_steps, self.probe_every, self._probing = 0, PROBE_EVERY, False

    @property
    def probing(self) -> bool:
        """Whether the last choose() returned a probe: a length drafted although planned() was 0, to learn whether
        drafting pays again; False after a choose() that returned the planned length, and before any."""
        return self._probing

    def restart(self) -> AdaptiveLength:
        """Ready for the next generation: keep what was learned, acceptance halfway back to the prior."""
        self.acceptance = [(a + self.prior) / 2 for a in self.acceptance]
        return self

    def planned(self) -> int:
        """The length choose() would pick now, probes aside; no side effects."""
        c = self.costs
        k, rate = c.best(self.acceptance, self.k_max, free=self.free, longer=self._longer())
        if k and rate < (SHARED_GAIN if c.shared else MIN_GAIN) * c.rate(0, 1.0):
            k = 0  # at break-even the estimate's noise decides, and a wrong guess costs more than it earns
        return k

    def _longer(self) -> tuple[int, ...]:
        return self.longer if self._all_kept else ()

    def choose(self, planned: int | None = None) -> int:
        """The length to draft now: planned() (given, where the caller priced it on the same costs), or a probe."""
        k = self.planned() if planned is None else planned
        self._probing = False
        if k == 0:
            self._off_steps += 1
            if self._off_steps >= self.probe_every:
                if not self.worth_probing():
                    self.defer()
                    return 0
                self._off_steps, self._probing = 0, True
                return self.costs.best_k(self.acceptance, self.k_max, k_min=1, free=self.free, longer=self._longer())
        return k

    def defer(self) -> None:
        """A probe due but not made (not worth it at these prices, or its drafter's catching up would not pay) is
        weighed again after as many plain steps: weighed every step, a pool's plain steps were each priced in full.
        (Not twice as long, as after a probe that did not pay: in a pool a probe becomes worth it when the other
        slots' records change, and waiting twice as long, the bench pair's pool drafted less than before.)"""
        self._off_steps = 0

    def rests(self) -> bool:
        """Whether choose(0) would now return 0 without pricing: no probe is due this step."""
        return self._off_steps + 1 < self.probe_every

    def rest(self) -> bool:
        """choose(0) where it would return 0 without pricing (True: a plain step counted toward the next probe);
        False, counting nothing, where a probe is due."""
        if self._off_steps + 1 >= self.probe_every:  # (rests(), inlined: every quiet check asks)
            return False
        self._off_steps += 1
        self._probing = False
        return True

    def rests_for(self) -> int:
        """How many rest() calls from now would each count a plain step before a probe is due."""
        return max(0, self.probe_every - 1 - self._off_steps)

    def rested(self, n: int) -> None:
        """n plain steps counted at once, as n rest() calls would count them, each probe falling due among them
        deferred (defer()): probe_every - 1 rests, then a deferral (from 0 again), and so on. (Where n <=
        rests_for(), none falls due.)"""
        self._probing = False
        self._off_steps = (self._off_steps + n) % self.probe_every

    def worth_probing(self) -> bool:
        """Whether drafts kept OPTIMISTIC of the time would beat plain steps by PROBE_GAIN at these prices."""
        k = self.costs.best_k(OPTIMISTIC, self.k_max, free=self.free)
        rate = self.costs.expected_rate
        return k > 0 and rate(k, OPTIMISTIC, self.free) >= PROBE_GAIN * rate(0, 0)

    def may_pay(self) -> bool:
        """Whether any of its lengths (the longer ones too), every token kept, would beat a plain step by SHARED_GAIN
        at its prices (Prices.best's rates), longest first: beside a prompt's chunk, most do."""
        c, floor = self.costs, SHARED_GAIN * self.costs.rate(0, 1.0)
        return any(c.rate(k, k + 1.0, self.free) >= floor for k in (*self.longer[::-1], *range(self.k_max, 0, -1)))

    def learn(self, drafted: int, accepted: int) -> None:
        """Acceptance only: of `drafted` guessed tokens, the first `accepted` were (or would have been) kept."""
        # tokens after the first rejection were never judged: they say nothing about acceptance
        a, m, judged = self.acceptance, self.memory, min(drafted, accepted + 1)
        for i in range(min(judged, self.k_max)):
            a[i] = m * a[i] + (1 - m) * (i < accepted)
        # the deep positions share one entry, observed by each judged position after the first: the chance that a
        # copy holds for one more token (as one observation a step, a short miss weighed like a long run kept whole,
        # and guesses stayed at 15 tokens in copies of 100+).
        # From the second position, since where a batch of k_max + 1 costs a jump more than one of k_max, copy
        # guesses stay shorter than k_max and must still be able to price long guesses in.
        for i in range(1, judged) if self.longer else ():
            a[-1] = m * a[-1] + (1 - m) * (i < accepted)

    def update(self, drafted: int, accepted: int, timing: Timing | None = None) -> None:
        """After a step this record chose: acceptance, and with `timing`, what the step cost (the cost model learns it).
        A free source's own time (lookup's search) is not charged."""
        self.learn(drafted, accepted)
        if drafted:
            self._all_kept = accepted == drafted
        c = self.costs
        if timing is None:
            spent = c.step_seconds(drafted, self.free)
        elif not (drafted or timing.draft_decodes or self._probing) and c.learned(timing.batch.tick):
            return  # a plain step in a shared batch another slot's step has taught already: nothing to learn
        else:
            t = timing
            draft_s, decodes, tokens = (0.0, 0, 0) if self.free else (t.propose_seconds, t.draft_decodes, t.draft_tokens)
            spent = t.verify_seconds + draft_s  # what the step really cost, the draft's catching up included
            # a draft catching up on many tokens in one batch says little about one draft step
            steps = decodes if tokens <= decodes + 1 else 0
            # several passes' time is no batch's price, but their shapes' together (CostModel.observe)
            passes = t.passes
            width = round(t.draft_batched / decodes) if steps and t.draft_batched else 1  # slots drafting at once
            c.observe(t.verify_tokens or drafted + 1, t.verify_seconds, steps, draft_s, draft_width=width,
                      verify_seqs=passes[0][0], verify_shapes=tuple(passes) if len(passes) > 1 else (),
                      tick=t.batch.tick, draft_tick=t.draft_tick)
        if self._probing:  # back off unless the probe itself beat plain steps
            paid = (accepted + 1) * c.verify[0] >= spent
            self.probe_every = PROBE_EVERY if paid else min(2 * self.probe_every, PROBE_EVERY_MAX)


class Unverified:
    """Lookup guesses left unverified, each (record, where it starts in the context, its tokens). A guess left
    unverified still teaches its record, once the target has committed the tokens it guessed (up to the first miss):
    the target's own pick, a draw when sampling, equals a guessed token exactly as often as verifying would keep it.
    So a record that is off learns without probes whether it would pay: a copy is entered a few tokens in, and
    phrases said again where the answer does not copy stay unverified."""

    def __init__(self) -> None:
        self._guesses: list[tuple[AdaptiveLength, int, list[int]]] = []

    def __bool__(self) -> bool:
        return bool(self._guesses)

    def append(self, guess: tuple[AdaptiveLength, int, list[int]]) -> None:
        self._guesses.append(guess)

    def clear(self) -> None:
        self._guesses.clear()

    def judge(self, context: list[int]) -> None:
        """Teach each guess's record as far as `context` has caught up with it (the rest later)."""
        pending = []
        for record, at, tokens in self._guesses:
            seen = context[at : at + len(tokens)]
            kept = common_prefix(seen, tokens)
            if kept < len(seen) or len(seen) == len(tokens):
                record.learn(len(tokens), kept)
            else:
                pending.append((record, at, tokens))
        self._guesses = pending
