"""Where draft tokens come from: a draft model, n-gram lookup in the text so far, or `auto`, which picks
between them (and plain steps) with the measured cost model.

A drafter returns up to k tokens after `context`: a chain or a token tree and, when sampling, the
distribution q each was drawn from (one-hot rows for deterministic proposals, which keeps rejection
sampling exact); then it observes how many the target kept.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from .costs import CostModel, ContextCosts
from .decoder import Decoder, LlamaCppDecoder, common_prefix
from .trees import Tree, ordered_tree
from .sampling import SamplingParams, probabilities, sample, softmax

# A greedy draft tree follows the draft's best guesses while the draft itself gives the whole chain at
# least this chance, and spends the nodes left on runner-up guesses (a batch of 4 costs less than 3 on
# repacked Q4_0 here, so stopping short without them saves draft steps but not target time). On the
# bench pair, Spec-Bench 2 prompts x 13 categories: `auto` 2.9% faster than with chains only.
REACH_MIN = 0.3


class Draft(NamedTuple):
    """Proposed tokens: a chain, or with `tree` its nodes after the root (the context's last token)."""

    tokens: list[int]
    q: np.ndarray | None = None  # sampling: the rows the tokens (the tree's nodes) were drawn from
    tree: Tree | None = None


def prefill(d: Decoder, context: list[int]) -> None:
    """Decode `context` into d's cache, reusing its common prefix (an empty context empties it)."""
    if context:
        d.sync(context)
    else:
        d.rollback_to(0)


class Drafter(Protocol):
    def prefill(self, context: list[int]) -> None:
        """Before generating: decode the prompt where drafting will need it (a draft model's cache)."""

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens after `context` (none when k is 0)."""

    def observe(self, drafted: int, kept: int) -> None:
        """What the target did with the last proposal: `kept` of its `drafted` tokens."""


class ModelDrafter:
    """A small model sharing the target's vocabulary; stops early when its top probability < p_min.

    tree_leaves > 1: drafts are trees of up to that many leaves (the target must hold one sequence more);
    else chains.
    """

    reach_min = REACH_MIN

    def __init__(self, draft: Decoder, n_vocab: int, p_min: float = 0.0, tree_leaves: int = 0) -> None:
        self.draft, self.n_vocab, self.p_min, self.tree_leaves = draft, n_vocab, p_min, tree_leaves

    def prefill(self, context: list[int]) -> None:
        prefill(self.draft, context)

    def observe(self, drafted: int, kept: int) -> None:
        pass

    def propose(self, context, k, params, rng):
        if k <= 0:
            return Draft([])
        if self.tree_leaves > 1 and k > 1:
            return self._tree(context, k, params, rng)
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        while True:
            if params.greedy:
                tokens.append(int(logits.argmax()))
            else:
                qs.append(probabilities(logits, params))
                tokens.append(sample(qs[-1], rng))
            if len(tokens) == k or (self.p_min > 0 and softmax(logits).max() < self.p_min):
                break
            logits = self.draft.feed([tokens[-1]], view=True)[-1, : self.n_vocab]
        return Draft(tokens, np.stack(qs) if qs else None)

    def _tree(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """k nodes: the draft's chain (its best guesses when greedy, draws from its q when sampling) while its chance of
        being kept whole (the product of the draft's top probabilities) is at least reach_min, then runner-ups where
        the draft expects them to pay most (chance of the chain before them x their probability): the next-best
        guesses, or when sampling, further draws from the same q without replacement, each with the q it was drawn
        from (see trees.walk)."""
        chain: list[int] = []
        dists: list[np.ndarray] = []  # per depth: the draft's distribution (its plain softmax when greedy)
        reach = [1.0]  # chance of the chain before each depth, then of the whole chain
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        while True:
            z = softmax(logits) if params.greedy else probabilities(logits, params)
            chain.append(int(z.argmax()) if params.greedy else sample(z, rng))
            dists.append(z)
            # the draft's top probability: the chance its best guess is kept when greedy; when sampling, a calibrated
            # estimate of its draw's acceptance (bench pair, 1280 positions of text sampled at 0.7: kept 77.2% of
            # the time, top probability 77.4% on average; the drawn token's own probability, 68.7%, stopped chains early)
            top = float(z.max())
            reach.append(reach[-1] * top)
            if len(chain) == k or reach[-1] < self.reach_min or top < self.p_min:
                break
            logits = self.draft.feed([chain[-1]], view=True)[-1, : self.n_vocab]
        room = min(k - len(chain), self.tree_leaves - 1)  # every runner-up is a leaf, as is the chain's end
        if room <= 0:
            return Draft(chain, None if params.greedy else np.stack(dists))
        rest = [z.copy() for z in dists]  # what is left at each depth to propose
        for d, x in enumerate(chain):
            rest[d][x] = 0.0
        best = [float(r.max()) for r in rest]
        nodes: list[tuple[int, int, np.ndarray | None]] = []  # runner-ups: (depth, token, q drawn from)
        for _ in range(room):
            d = max(range(len(chain)), key=lambda d: reach[d] * best[d])
            if best[d] <= 0:  # sampling with top-k/top-p: nothing left that the draft would propose
                break
            if params.greedy:
                nodes.append((d, int(rest[d].argmax()), None))
            else:
                q = rest[d] / rest[d].sum()
                nodes.append((d, sample(q, rng), q))
            rest[d][nodes[-1][1]] = 0.0
            best[d] = float(rest[d].max())
        if not nodes:
            return Draft(chain, None if params.greedy else np.stack(dists))
        # the chain first: when it is kept, the target's cache needs no repair (see commit_tree_path)
        ranks = [0] * len(chain)
        choices = [(0,) * (d + 1) for d in range(len(chain))]
        for d, _, _ in nodes:
            ranks[d] += 1
            choices.append((0,) * d + (ranks[d],))
        tree = ordered_tree(tuple(choices))
        tokens = chain + [t for _, t, _ in nodes]
        q = None if params.greedy else np.stack(dists + [r for _, _, r in nodes])
        return Draft(tokens, q, tree)


class LookupDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, n_vocab: int, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min
        self.match = 0  # how many tokens before the guess the last find() matched (up to LONG_MATCH)

    def find(self, context: list[int], k: int) -> list[int]:
        ctx = np.asarray(context)
        self.match = 0
        # where an earlier occurrence of the last token ends an n-gram equal to the tail (one pass over the
        # context, then only those places: searched every step, so cheap against a small target's decode)
        ends = np.flatnonzero(ctx[:-1] == ctx[-1])
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            hits = ends[ends >= n - 1]
            for j in range(1, n):
                hits = hits[ctx[hits - j] == ctx[-1 - j]]
            if len(hits):
                # how far back each earlier occurrence matches the tail (up to LONG_MATCH): the longest wins, the
                # latest among equals (text that repeats a phrase often has a later, shorter chance match)
                back = np.arange(LONG_MATCH)
                before = hits[:, None] - back
                same = (before >= 0) & (ctx[np.maximum(before, 0)] == ctx[np.maximum(len(ctx) - 1 - back, 0)])
                lengths = np.where(same.all(axis=1), LONG_MATCH, same.argmin(axis=1))
                at = len(hits) - 1 - int(np.argmax(lengths[::-1]))
                start, self.match = int(hits[at]) + 1, int(lengths[at])
                # a match that runs into the tail is text repeating with this period: the guess goes on repeating
                # it, as a lookup fed its own guess would (a loop of 7 tokens otherwise capped guesses at 7)
                period = len(ctx) - start
                return ctx[start + np.arange(k) % period].tolist()
        return []

    def prefill(self, context: list[int]) -> None:
        pass

    def observe(self, drafted: int, kept: int) -> None:
        pass

    def propose(self, context, k, params, rng):
        return self.draft(self.find(context, k) if k > 0 else [], params)

    def draft(self, tokens: list[int], params: SamplingParams) -> Draft:
        """A guess as a Draft: when sampling, each token with all of q's mass (a point guess)."""
        if params.greedy or not tokens:
            return Draft(tokens)
        q = np.zeros((len(tokens), self.n_vocab))
        q[np.arange(len(tokens)), tokens] = 1.0
        return Draft(tokens, q)


PROBE_EVERY = 16  # plain steps before the first probe while speculation is off; doubled after each failed one
PROBE_EVERY_MAX = 128
OPTIMISTIC = 0.9  # probes are made only if drafts kept this often would beat plain decoding
# by this factor: a probe costs a bigger batch and the draft catching up on every token since its last
# use (measured on an AVX-512 machine here: probes at a 12% optimistic gain made `auto` 8% slower)
PROBE_GAIN = 1.2
MIN_GAIN = 1.05  # drafting only when expected to beat plain decoding by this factor
# A lookup guess longer than the draft length is verified only where the text before it repeats earlier
# text for at least this many tokens: a copy, not a chance n-gram
LONG_MATCH = 16
COPY_PRIOR = 0.9  # what a guess that continues such a copy is expected to keep, before any evidence
# A guess whose context matches earlier text for at least this many tokens is priced apart from shorter matches:
# on copying answers here its first token was kept ~0.8 of the time, against ~0.6 after a 2- or 3-token match
# (docs/benchmarks-2026-11-25-zen4.md), and waiting for LONG_MATCH took 14 plain steps into every copy
PHRASE_MATCH = 4


class AdaptiveLength:
    """Pick k each step to maximise expected tokens per second, drafting only for a gain of at least
    MIN_GAIN; k = 0 turns speculation off.

    Acceptance is a running average per draft position (a draft that got its first token right
    tends to get the next one right too), carried from one generation to the next but pulled
    halfway back to the prior at each start, so every prompt gets a fair try. While off, a probe
    at the best non-zero length keeps the estimates alive: after PROBE_EVERY plain steps, twice
    as long after each probe that did not pay for itself. A probe costs a bigger batch and a draft
    catching up, so none is made when even good drafts would gain little (on CPUs where a batch of
    4 costs ~2.6 decodes, as on the AVX2-only machines here, the best case is a few percent).
    """

    def __init__(self, costs: CostModel, k_max: int, prior: float = 0.7, memory: float = 0.95,
                 target: LlamaCppDecoder | None = None, draft: LlamaCppDecoder | None = None,
                 free: bool = False, longer: tuple[int, ...] = ()) -> None:
        self.costs, self.k_max, self.memory, self.prior, self.free = costs, k_max, memory, prior, free
        self.longer = longer  # lengths past k_max that may be drafted too (lookup's long guesses)...
        self._all_kept = False  # ...only right after a guess kept whole: one long miss, then short ones again
        # per position up to k_max; with `longer`, one more entry: every position from k_max-1 on (a guess
        # that has held that far in copied text tends to hold on)
        self.acceptance = [prior] * (k_max + bool(longer))
        self._off_steps, self.probe_every, self._probing = 0, PROBE_EVERY, False
        self._clocks = (target, draft)  # their decode counters time each step for costs.observe
        self._start = (0.0, 0, 0.0, 0, 0)

    def restart(self) -> AdaptiveLength:
        """Ready for the next generation: keep what was learned, acceptance halfway back to the prior."""
        self.acceptance = [(a + self.prior) / 2 for a in self.acceptance]
        return self

    def _read_clocks(self) -> tuple[float, int, float, int, int]:
        """Target seconds and tokens decoded; draft seconds, decodes and tokens."""
        target, draft = self._clocks
        t = (target.decode_seconds, target.n_decoded_tokens) if target else (0.0, 0)
        if draft is None:
            return *t, 0.0, 0, 0
        return *t, draft.decode_seconds, draft.n_decodes, draft.n_decoded_tokens

    def planned(self) -> int:
        """The length choose() would pick now, probes aside; no side effects."""
        k = self.costs.best_k(self.acceptance, self.k_max, free=self.free, longer=self._longer())
        rate = self.costs.expected_rate
        if k and rate(k, self.acceptance, self.free) < MIN_GAIN * rate(0, 0):
            k = 0  # at break-even the estimate's noise decides, and a wrong guess costs more than it earns
        return k

    def _longer(self) -> tuple[int, ...]:
        return self.longer if self._all_kept else ()

    def choose(self) -> int:
        self._start = self._read_clocks()
        k = self.planned()
        self._probing = False
        if k == 0:
            self._off_steps += 1
            if self._off_steps >= self.probe_every and self._worth_probing():
                self._off_steps, self._probing = 0, True
                return self.costs.best_k(self.acceptance, self.k_max, k_min=1, free=self.free, longer=self._longer())
        return k

    def _worth_probing(self) -> bool:
        k = self.costs.best_k(OPTIMISTIC, self.k_max, free=self.free)
        rate = self.costs.expected_rate
        return k > 0 and rate(k, OPTIMISTIC, self.free) >= PROBE_GAIN * rate(0, 0)

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

    def update(self, drafted: int, accepted: int) -> None:
        self.learn(drafted, accepted)
        if drafted:
            self._all_kept = accepted == drafted
        c = self.costs
        spent = c.step_seconds(drafted, self.free)
        if self._clocks[0] is not None:
            (t0, b0, d0, n0, k0), (t1, b1, d1, n1, k1) = self._start, self._read_clocks()
            spent = (t1 - t0) + (d1 - d0)  # what the step really cost, the draft's catching up included
            # a draft catching up on many tokens in one batch says little about one draft step
            steps = n1 - n0 if k1 - k0 <= n1 - n0 + 1 else 0
            # the batch the target decoded: deferred tokens (see commit_tree_path) may ride in front of the drafts
            c.observe(b1 - b0 or drafted + 1, t1 - t0, steps, d1 - d0)
        if self._probing:  # back off unless the probe itself beat plain steps
            paid = (accepted + 1) * c.verify[0] >= spent
            self.probe_every = PROBE_EVERY if paid else min(2 * self.probe_every, PROBE_EVERY_MAX)


class AutoDrafter:
    """`auto`: prompt lookup when the text repeats itself and verifying its guess pays (priced by how far back its
    match reaches: a chance n-gram, a phrase said again or a copy starting, a copy), else the draft model when
    drafting pays, else a plain step.

    Each source keeps its own acceptance, and lookup's guesses cost no draft decodes, so lookup can
    pay on a machine where the draft model cannot.
    """

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter | None, costs: CostModel, k_max: int,
                 target: LlamaCppDecoder | None = None, draft: LlamaCppDecoder | None = None) -> None:
        self.lookup, self.model, self.k_max = lookup, model, k_max
        self.context_costs = ContextCosts(costs)
        # each kind of lookup match keeps its own record (one estimate for all kept lookup off on summaries where
        # llama.cpp's ngram-mod verified nearly every copied token: docs/benchmarks-2026-11-25-zen4.md)
        # chance n-gram matches, under PHRASE_MATCH tokens
        self.lookup_length = AdaptiveLength(costs, k_max, free=True, target=target)
        # matches of PHRASE_MATCH up to LONG_MATCH tokens: a phrase said again, or the first tokens of a copy
        self.phrase_length = AdaptiveLength(costs, k_max, free=True, target=target)
        # the answer copies earlier text (LONG_MATCH tokens or more): the only kind whose guesses may run past k_max
        self.copy_length = AdaptiveLength(costs, k_max, prior=COPY_PRIOR, free=True, target=target, longer=costs.k_long)
        self.model_length = AdaptiveLength(costs, k_max, target=target, draft=draft) if model is not None else None
        self.target, self.draft = target, draft
        self.source: AdaptiveLength | None = None  # whose proposal the target is judging
        self._unverified: list[tuple[AdaptiveLength, int, list[int]]] = []  # lookup guesses not verified: see propose
        self._proposed: tuple[AdaptiveLength, int, list[int]] | None = None  # the lookup guess just proposed
        self._records = tuple(r for r in (self.lookup_length, self.phrase_length, self.copy_length, self.model_length)
                              if r is not None)

    @property
    def k_cap(self) -> int:
        """The most tokens a step may draft: long guesses that continue a copy, where measured, else k_max."""
        return max((self.k_max, *self.copy_length.longer))

    @property
    def costs(self) -> CostModel:
        """The cost model measured at start-up (short context)."""
        return self.context_costs.base

    def price_at(self, n_ctx: int) -> None:
        """Price the next steps at the costs learned for a context of n_ctx tokens."""
        for length in self._records:
            length.costs = self.context_costs.at(n_ctx)

    def restart(self) -> AutoDrafter:
        for length in self._records:
            length.restart()
        self._unverified.clear()
        return self

    def prefill(self, context: list[int]) -> None:
        """The draft model decodes the prompt only where it is expected to draft (often never on CPUs)."""
        if self.model is not None and self.uses_model(len(context) + 1):
            self.model.prefill(context)

    def uses_model(self, n_ctx: int | None = None) -> bool:
        """Whether the draft model drafts at this point, or after n_ctx tokens of context (probes aside)."""
        if n_ctx is not None:
            self.price_at(n_ctx)
        return self.model_length is not None and self.model_length.planned() > 0

    def propose(self, context, k, params, rng):
        self.source = self._proposed = None
        if k <= 0:
            return Draft([])
        self.price_at(len(context))
        self._judge_unverified(context)
        guess = self.lookup.find(context, k)
        match = self.lookup.match
        self.source = (self.copy_length if match >= LONG_MATCH else
                       self.phrase_length if match >= PHRASE_MATCH else self.lookup_length)
        n = min(self.source.choose(), len(guess))
        judged_later = self.source, len(context), guess[: self.k_max]
        if n and not self._model_beats_lookup(n, self.source):
            self._proposed = judged_later
            return self.lookup.draft(guess[:n], params)
        if guess:
            self._unverified.append(judged_later)
        if self.model_length is not None and self._catch_up_pays(context):
            self.source = self.model_length
            # deferred tokens (see commit_tree_path) ride in the batch: it stays within the measured sizes
            n = min(self.model_length.choose(), k, self.k_max - getattr(self.target, "n_deferred", 0))
            if n:
                return self.model.propose(context, n, params, rng)
        return Draft([])

    def _judge_unverified(self, context: list[int]) -> None:
        """A guess left unverified still teaches its record, once the target has committed the tokens it guessed
        (up to the first miss): the target's own pick, a draw when sampling, equals a guessed token exactly as often
        as verifying would keep it. So a record that is off learns without probes whether it would pay: a copy is
        entered a few tokens in, and phrases said again where the answer does not copy stay unverified."""
        pending = []
        for record, at, tokens in self._unverified:
            seen = context[at : at + len(tokens)]
            kept = common_prefix(seen, tokens)
            if kept < len(seen) or len(seen) == len(tokens):
                record.learn(len(tokens), kept)
            else:
                pending.append((record, at, tokens))
        self._unverified = pending

    def _catch_up_pays(self, context: list[int]) -> bool:
        """The draft model is not started where catching up on the context it has not seen would cost more
        than the plain steps between two probes (charged at a draft step a token, an upper bound): after a long
        prompt it was not prefilled for, the catch-up took 2.3-3.3 s here, more than 64 tokens can win back."""
        if self.draft is None:
            return True
        m = self.model_length
        unseen = len(context) - common_prefix(self.draft.history, context)
        return unseen * m.costs.draft <= m.probe_every * m.costs.verify[0]

    def _model_beats_lookup(self, n: int, length: AdaptiveLength) -> bool:
        """While the draft model drafts, lookup is not free: the draft must still decode every token a lookup
        step commits before it drafts again. Charged here at a draft step per token (a catch-up batch costs
        a little less), lookup's guess is verified only if it still beats the model's own proposal."""
        if not self.uses_model():
            return False
        costs, model = self.costs, self.model_length
        tokens = costs.expected_tokens(n, length.acceptance)  # its last entry: all deeper positions
        lookup_rate = tokens / (costs.step_seconds(n, free=True) + tokens * costs.draft)
        return costs.expected_rate(model.planned(), model.acceptance) > lookup_rate

    def observe(self, drafted: int, kept: int) -> None:
        if self.source is not None:  # the last policy asked: it also times plain steps
            self.source.update(drafted, kept)

    def withdraw(self) -> None:
        """The last proposal was not verified (Medusa's tree ran instead): the next observe learns nothing, and a
        lookup guess is judged as one left unverified."""
        if self._proposed is not None:
            self._unverified.append(self._proposed)
        self.source = self._proposed = None

    def lookup_gain(self, n: int) -> float:
        """Expected tokens per second of verifying the n-token lookup guess just proposed, on the record of its
        kind (a chance match's, a phrase's or a copy's), over a plain step's, both at the current context's costs."""
        costs = self.source.costs
        return costs.expected_rate(n, self.source.acceptance, free=True) / costs.expected_rate(0, 0)

