"""Prompt lookup, the cost model's choice of draft length, and the on/off behaviour of `auto`."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import llama_cpp
import numpy as np
import pytest

import ggufspec.costs.cache as costs_module  # where cached_measure looks up measure() and machine()
from ggufspec.costs import ContextCosts, CostModel, SharedBatch, measure
from ggufspec.decoder import SLOT_CHUNK
from ggufspec.submission import NO_BATCH, BatchShape
from ggufspec.micro_batches import even_lanes, micro_batches, micro_shapes
from ggufspec.policy import PLAIN, Plan, Timing
from ggufspec.policy.adaptive import (MIN_GAIN, PHRASE_MATCH, PROBE_EVERY, PROBE_GAIN, SHARED_GAIN,
                                      AdaptiveLength)
from ggufspec.policy.auto import AutoPolicy
from ggufspec.policy.shared import PLAN_DRIFT, REACH_TICKS, QuietRun, SlotRecords, TickPlan
from ggufspec.policy.tree_sizer import TreeSizer
from ggufspec.proposers import NO_DRAFT, Context, Draft, Proposer
from ggufspec.proposers.draft_model import DraftModelProposer
from ggufspec.proposers.lookup import LONG_MATCH, LookupProposer
from ggufspec.sampling import SamplingParams, probabilities, softmax
from ggufspec.trees import build_tree
from ggufspec.verifier import Verdict

from conftest import open_decoder


def begin(policy: AutoPolicy, lookup: LookupProposer, model: DraftModelProposer | None = None,
          prompt: list[int] | None = None) -> dict[str, Proposer]:
    """`auto`'s proposers for a generation after `prompt`, as the engine starts one (replay.py too)."""
    proposers: dict[str, Proposer] = {"lookup": lookup, **({"draft": model} if model is not None else {})}
    policy.begin(prompt or [], proposers)
    return proposers


def step(policy: AutoPolicy, proposers: dict[str, Proposer], context: list[int], k: int,
         deferred: int = 0, room: int | None = None) -> tuple[Plan, Draft]:
    """One step of up to k draft tokens after `context`: the policy plans, the proposer it names proposes. `room`:
    the tokens the generation may still commit (k + 1 unless given, which caps the step at k drafts)."""
    ctx = Context(list(context))
    plan = policy.plan(ctx, room=k + 1 if room is None else room, deferred=deferred)
    return plan, proposers[plan.source].propose(ctx, plan.k) if plan.source else NO_DRAFT


def judge(policy: AutoPolicy, plan: Plan, draft: Draft, kept: int, timing: Timing | None = None,
          shape: BatchShape = NO_BATCH) -> None:
    """The target kept the first `kept` tokens of the step's draft (then picked a token of its own); timing None:
    the step is priced from the cost model alone, as replays are; `shape`: the pool's batch it rode in (lane 0)."""
    verdict = Verdict([*draft.tokens[:kept], 0], len(draft.tokens), timing.verify_seconds if timing else 0.0,
                      len(draft.tokens) + 1, 0, shape=shape)
    policy.observe(plan, draft, verdict, timing)


def test_lookup_continues_the_latest_longest_match() -> None:
    d = LookupProposer(n_vocab=100, ngram_max=3, ngram_min=1)
    assert d.find([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 3) == [5, 6, 1]  # latest of two 3-gram matches
    assert d.find([1, 2, 3, 4, 5, 9, 4, 5], 2) == [9, 4]  # 3-gram "9 4 5"? no: falls back to "4 5"
    assert d.find([1, 2, 3], 2) == []
    assert d.find([7, 7, 7, 7], 4) == [7] * 4  # a run continues itself (the tail is not its own match)
    loop = [3, 1, 4, 1, 5, 9, 2] * 4  # text in a loop: the guess goes round it, not only to the tail
    assert d.find(loop, 17) == (loop * 2)[:17]
    assert d.find([1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]  # room before the tail: as before
    draft = d.propose(Context([5, 6, 8, 5, 6]), 2)
    assert draft.tokens == [8, 5] and draft.tree is None and draft.q is None  # point guesses: judged as one-hot q


def test_lookup_searches_a_context_once_for_the_policy_and_the_proposal() -> None:
    """`auto` finds lookup's guess to plan with, then the proposal asks again for a prefix of it: one search."""
    d = LookupProposer(n_vocab=100)
    text = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.find(text, 4) == [4, 5, 9, 1] and d.match == 3 and d.searches == 1
    d.match = 0
    assert d.propose(Context(text), 2).tokens == [4, 5] and d.match == 3 and d.searches == 1
    assert d.find(text, 5) == [4, 5, 9, 1, 2] and d.searches == 2  # a longer guess: searched again
    text.append(4)  # the same list, grown: searched again
    assert d.find(text, 2) == [5, 9] and d.searches == 3
    assert d.find(list(text), 2) == [5, 9] and d.searches == 4  # an equal list, not the same one


def test_lookup_prefers_the_copy_to_a_later_chance_match() -> None:
    """A phrase repeated since (a chance match, latest) does not hide the passage the tail copies: the longest
    match wins, the latest among equals."""
    d = LookupProposer(n_vocab=100)
    s = list(range(10, 40))
    text = s + [91, 92, 93] + s[20:24] + [95] + s[:24]  # the tail copies s; its last 4 tokens also stand after 93
    assert d.find(text, 5) == s[24:29] and d.match == LONG_MATCH
    shorter = text[: -24] + s[17:24]  # 7 tokens copied from s, 4 of them also after 93
    assert d.find(shorter, 3) == s[24:27] and d.match == 7
    later = shorter + [96] + s[20:24]  # two 4-token matches of the tail (the 7-token one ended at 96): the latest
    assert d.find(later, 3) == [96] + s[20:22] and d.match == 4


def test_cost_model_prefers_long_drafts_only_when_they_pay() -> None:
    flat = CostModel(verify=[0.045, 0.06, 0.065, 0.07, 0.09], draft=0.008)  # like a Q4_0 target
    linear = CostModel(verify=[0.045 * n for n in range(1, 6)], draft=0.008)  # like a Q8_0 target
    assert flat.best_k(0.8, 4) == 3  # a 5-token batch costs a step more than 4: one draft fewer wins
    assert CostModel(verify=[0.045, 0.06, 0.065, 0.07, 0.072], draft=0.008).best_k(0.8, 4) == 4
    assert flat.best_k(0.0, 4) == 0
    assert flat.best_k(0.6, 4) == 2  # 1.96 tokens per 81 ms beats 1 per 45 ms and 2.18 per 94 ms
    assert linear.best_k(0.6, 4) == 0  # verifying k tokens costs k decodes: drafting never pays
    assert linear.best_k(0.99, 4) == 0  # not even with a perfect draft: k+1 tokens cost k+1 decodes plus drafting
    # per position, as measured on the benchmark pair: 1 + .71 + .71*.86 + .71*.86*.76 = 2.785 tokens a pass
    assert abs(flat.expected_rate(3, [0.71, 0.86, 0.76]) * (3 * 0.008 + 0.07) - 2.785) < 1e-3
    assert flat.best_k([0.5, 0.9, 0.9, 0.9], 4) == 3  # a weak first guess, but sure after it: still pays


# Long batches (16, 32, 64 tokens) priced past the short ones, roughly as on the Xeon here for a compute-bound 64
LONG = CostModel([0.089, 0.1373, 0.1796, 0.1373 * 1.1], 0.0122, [16, 32, 64], [0.30, 0.50, 0.90])


def test_long_batches_are_priced_between_the_measured_sizes_and_learn_alone() -> None:
    c = LONG.copy()
    assert c.k_long == (15, 31, 63)
    assert c.batch_seconds(4) == c.verify[3] and c.batch_seconds(16) == 0.30
    assert c.batch_seconds(10) == pytest.approx(c.verify[3] + (0.30 - c.verify[3]) * 6 / 12)
    assert c.batch_seconds(48) == pytest.approx(0.70) and c.batch_seconds(128) == pytest.approx(1.80)
    assert c.step_seconds(31, free=True) == 0.50
    c.observe(33, 0.60, 0, 0.0)  # a size between the measured ones teaches none of them (the curve is not smooth)
    assert c == LONG
    c.observe(32, 0.60, 0, 0.0)  # a 32-token batch took longer than priced: only its own size learns
    assert c.long_verify[0] == 0.30 and c.long_verify[2] == 0.90 and c.long_verify[1] > 0.50
    assert c.verify == LONG.verify and c.draft == LONG.draft
    assert CostModel([0.1, 0.2], 0.01).batch_seconds(9) == 0.2  # nothing measured past: the largest size


def test_lookup_learns_its_way_to_long_guesses_through_full_short_ones() -> None:
    lookup = AdaptiveLength(LONG.copy(), k_max=3, free=True, longer=LONG.k_long)
    assert lookup.planned() <= 3  # at the prior, a 16-token batch for ~3 tokens does not pay
    for _ in range(60):  # copied text: every guess kept
        k = lookup.choose()
        lookup.update(k, k)
    assert lookup.planned() in LONG.k_long and lookup.acceptance[-1] > 0.95
    for _ in range(30):  # guesses now rejected at once: back to short ones (or none)
        k = lookup.choose()
        lookup.update(k, 0)
    assert lookup.planned() <= 3


def test_a_short_miss_does_not_outweigh_long_runs_kept_whole() -> None:
    """The deep positions' acceptance is the chance that a copy holds for one more token: copies of ~35 tokens
    (two 15-token guesses kept whole, then a miss 5 tokens in) keep long guesses worth verifying where a
    16-token batch costs 7.4 decodes (Zen 4 costs)."""
    costs = CostModel([0.0332, 0.059, 0.085, 0.088], 0.0103, [16, 32, 64], [0.245, 0.476, 0.968])
    copy = AdaptiveLength(costs, 3, prior=0.9, free=True, longer=costs.k_long)
    for _ in range(4):
        for kept in (15, 15, 5):
            copy.update(15, kept)
    copy.update(15, 15)
    assert copy.acceptance[-1] > 0.95 and copy.planned() in costs.k_long


def test_short_guesses_kept_whole_teach_the_deep_positions() -> None:
    """Where a batch of k_max + 1 costs a jump more than one of k_max (this Zen 4: 3.07 against 2.33 decodes), a
    copy's guesses are k_max - 1 long; kept whole, they must still lead to long guesses (they did not: the deep
    entry learned from position k_max - 1 on, and 84 copied tokens went by in 3-token guesses)."""
    costs = CostModel([0.0418, 0.0689, 0.085, 0.0973, 0.1285], 0.0103, [16, 32, 64], [0.2814, 0.5584, 1.0816])
    copy = AdaptiveLength(costs, 4, prior=0.9, free=True, longer=costs.k_long)
    copy.update(3, 3)
    assert copy.planned() == 3  # at the prior, a 16-token batch (6.7 decodes) does not pay
    for _ in range(20):
        k = copy.choose()
        copy.update(k, k)
    assert copy.planned() in costs.k_long and copy.acceptance[-1] > 0.95


def test_a_long_lookup_guess_needs_a_long_copy_before_it() -> None:
    auto = AutoPolicy(LONG.copy(), 3, model=False)
    proposers = begin(auto, LookupProposer(200))
    for length in (auto.lookup_length, auto.copy_length):  # chance n-grams and copies: each keeps its own record
        length.acceptance = [0.99] * len(length.acceptance)
        length.update(3, 3)  # the last guess was kept whole
    text = list(range(10, 90))  # 80 distinct tokens
    assert auto.k_cap == 63
    plan, draft = step(auto, proposers, text + text[:20], auto.k_cap)  # 20 tokens into a copy of it
    guess = draft.tokens
    assert plan == Plan("lookup", len(guess)) and auto.source is auto.copy_length
    assert len(guess) > 3 and guess == text[20 : 20 + len(guess)] and proposers["lookup"].match == LONG_MATCH
    plan, draft = step(auto, proposers, text + [199, 198, 15, 16], auto.k_cap)  # only "15 16" repeats
    assert plan == Plan("lookup", 3) and auto.source is auto.lookup_length
    assert draft.tokens == [17, 18, 19] and proposers["lookup"].match == 2


def test_adaptive_turns_off_probes_and_comes_back() -> None:
    costs = CostModel(verify=[0.045, 0.06, 0.065, 0.07, 0.072], draft=0.008)
    policy = AdaptiveLength(costs, k_max=4, prior=0.8)
    assert policy.choose() == 4
    for _ in range(60):  # everything rejected
        policy.update(policy.choose(), 0)
    assert policy.costs.best_k(policy.acceptance, 4) == 0
    chosen = [policy.choose() for _ in range(256)]
    probe = costs.best_k(policy.acceptance, 4, k_min=1)  # the best length but 0: not blindly 1
    probes = [k for k in chosen if k]
    assert 2 <= len(probes) <= 256 // PROBE_EVERY and set(probes) == {probe} and probe > 1  # off, but probing
    for _ in range(20 * PROBE_EVERY):  # the drafts are good again: the probes bring speculation back
        k = policy.choose()
        policy.update(k, k)
    assert policy.choose() == 4


def test_measure_times_every_batch_size_and_resets(tiny_target, tiny_draft) -> None:
    with open_decoder(tiny_target) as t, open_decoder(tiny_draft) as d:
        t.feed([1, 2, 3])
        costs, spread = measure(t, d, k_max=3, repeats=2)
        assert len(costs.verify) == 4 and all(v > 0 for v in costs.verify) and costs.draft > 0
        assert spread >= 1.0
        assert t.history == [] and d.history == []


def test_a_cost_model_measured_on_a_busy_machine_corrects_itself_in_use() -> None:
    # what a busy moment measured (seen here): every batch and the draft about as slow as each other
    costs = CostModel(verify=[1.35, 1.48, 1.56, 1.51], draft=1.23)
    assert costs.best_k(0.7, 3) == 0
    for step in range(40):  # what the steps then really cost: a Q4_0 target, a cheap draft
        n = 1 if step % 4 else 4
        costs.observe(n, [0.045, 0.06, 0.065, 0.07][n - 1], draft_decodes=n - 1, draft_s=0.008 * (n - 1))
    assert abs(costs.draft - 0.008) < 0.002 and abs(costs.verify[0] - 0.045) < 0.01
    assert costs.best_k(0.7, 3) == 3


def test_a_restart_keeps_what_was_learned() -> None:
    costs = CostModel(verify=[0.045, 0.06, 0.065, 0.07], draft=0.008)
    policy = AdaptiveLength(costs, k_max=3, prior=0.7)
    policy.acceptance = [0.9, 0.7, 0.1]
    policy.update(3, 0)  # only position 1 was judged
    assert policy.acceptance[0] < 0.9 and policy.acceptance[1:] == [0.7, 0.1]
    a0 = policy.acceptance[0]
    assert policy.restart().acceptance == pytest.approx([(a0 + 0.7) / 2, 0.7, 0.4])  # halfway back: a new prompt gets a fair try


def test_failed_probes_back_off_and_linear_targets_are_never_probed() -> None:
    costs = CostModel(verify=[0.045, 0.06, 0.065, 0.07, 0.072], draft=0.008)
    policy = AdaptiveLength(costs, k_max=4)
    policy.acceptance = [0.1] * 4
    gaps, since = [], 0
    for step in range(400):
        if step == 200:
            policy.restart()  # a new generation does not forget the backoff
        k = policy.choose()
        since += 1
        if k:
            gaps.append(since)
            since = 0
        policy.update(k, 0)  # every probe rejected
    assert gaps[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY] and max(gaps) == 128
    linear = CostModel(verify=[0.045 * n for n in range(1, 6)], draft=0.008)  # like Q8_0: drafting cannot pay
    policy = AdaptiveLength(linear, k_max=4)
    assert not any(policy.choose() for _ in range(200))


# Measured on an AVX2-only 2-core machine here (ms): a 4-token batch costs 2.6 decodes of the benchmark target
# and a batch of 8 at 5.4 decodes (d617794:docs/benchmarks-parallel.md, the Zen 3 of runs 1 to 4)
AVX2 = CostModel(verify=[0.0539, 0.0980, 0.1398, 0.1405], draft=0.0103, long_sizes=[8], long_verify=[0.291])


def test_a_batch_run_in_several_micro_batches_teaches_no_batch_price() -> None:
    costs = CostModel(verify=[0.05, 0.09, 0.13, 0.14], draft=0.01)
    length = AdaptiveLength(costs, k_max=3)
    # a slot's 3 tokens beside another's 1, in two passes: (2 sequences, 1 token each), then (1, 2)
    length.update(1, 1, Timing(0.5, 4, 0.01, 1, 1, batch=BatchShape((1, 3))))
    assert costs.verify == [0.05, 0.09, 0.13, 0.14]
    length.update(1, 1, Timing(0.5, 4, 0.01, 1, 1))  # one pass: the same seconds move the price
    assert costs.verify[3] > 0.14


def test_llama_cpp_runs_unequal_chains_of_slots_in_several_micro_batches() -> None:
    # llama_batch_allocr::split_equal over KV streams: consecutive sequences, as many tokens of each
    assert micro_batches([1, 1, 1, 1]) == [4]
    assert micro_batches([1, 1, 4]) == [3, 3]
    assert micro_batches([2, 0, 2]) == [2, 2]  # a gap breaks the run
    assert micro_batches([3, 3, 1]) == [3, 4]
    assert micro_batches([]) == []


# The same Xeon with a pool's batches measured too (EnginePool): 8 tokens cost 2.9 decodes, 16 4.5
XEON_POOL = CostModel([0.0856, 0.1301, 0.1721, 0.1190, 0.1584], 0.0103, [8, 16, 32, 64], [0.25, 0.39, 0.76, 1.5])


def test_uneven_chains_are_padded_to_one_length_where_one_micro_batch_costs_less() -> None:
    # two plain steps among 2-token chains: 4 micro-batches (8, 1, 2, 3 tokens), or one of 16 padded
    assert even_lanes([2, 1, 2, 2, 1, 2, 2, 2], XEON_POOL.micro_seconds, 5) == (2,) * 8
    # one 5-token chain beside plain steps: padding every slot to 5 tokens (40) costs more than a pass of 4
    assert even_lanes([1] * 7 + [5], XEON_POOL.micro_seconds, 5) == (1,) * 7 + (5,)
    # an idle slot between busy ones splits their pass in two: padded where one pass of all costs less
    assert even_lanes([1, 1, 0, 0, 0, 1, 1], XEON_POOL.micro_seconds, 5) == (1,) * 7
    assert even_lanes([2, 1, 0, 2], XEON_POOL.micro_seconds, 5) == (2, 2, 0, 2)  # 4 + 2 tokens: cheaper than 8
    assert even_lanes([128, 100, 1], XEON_POOL.micro_seconds, 5) == (128, 100, 1)  # prompt chunks: not padded
    assert even_lanes([1, 0, 128], XEON_POOL.micro_seconds, 5) == (1, 0, 128)  # nor idle slots beside them
    # priced as it runs: a slot's draft that evens the others' chains costs less than its plain step beside them
    chains = SharedBatch(XEON_POOL, [2, 1, 2, 2, 2, 2, 2, 2], lane=1)
    assert chains.step_seconds(1) == pytest.approx(XEON_POOL.batch_seconds(16) + XEON_POOL.draft)
    assert chains.step_seconds(0) == pytest.approx(XEON_POOL.batch_seconds(16))


def test_a_slot_drafts_in_a_shared_batch_only_where_the_whole_batch_gains() -> None:
    """Priced per micro-batch: beside slots on plain steps a chain runs as a pass of its own, which even a guess
    that is nearly always kept does not pay for on an AVX2 CPU; beside slots verifying 2-token chains, one draft
    token evens the batch into one pass of 8, about what its plain step costs beside them (4 + 3), and commits more."""
    plain = SharedBatch(AVX2, [1, 1, 1, 1], lane=3)
    assert plain.step_seconds(1) == pytest.approx(AVX2.batch_seconds(4) + AVX2.batch_seconds(1) + AVX2.draft)
    assert plain.best_k(0.95, 3, free=True) == 0
    assert AVX2.best_k(0.95, 3, free=True) > 0  # alone, the same guess pays
    chains = SharedBatch(AVX2, [2, 2, 2, 1], lane=3)
    assert chains.step_seconds(1, free=True) == pytest.approx(AVX2.batch_seconds(8))
    assert chains.step_seconds(0, free=True) == pytest.approx(AVX2.batch_seconds(4) + AVX2.batch_seconds(3))
    assert chains.best_k(0.5, 1, free=True) == 1


def test_one_slot_s_guess_beside_busy_slots_pays_only_for_the_others_wait_too() -> None:
    """Costs as learned in run 26 (d617794:docs/benchmarks-parallel.md): 4 slots' plain tokens 132 ms. Counted as the batch's
    sum, a copy guess of 31 tokens kept 98% of the time paid beside 3 plain steps, and held their next tokens for
    6.6 plain ticks; counted as busy slots times their geometric mean, no guess pays beside 3 or 7 plain steps. Beside
    a prompt's chunk, where the batch takes long anyway, a long one does; alone, as before; and while every slot
    commits alike, the count is their sum."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.225, 0.360, 0.568], shapes={(4, 1): 0.132})
    acc, longer = [0.98] * 4 + [1.0], (15, 31, 63)
    four = SharedBatch(pool, [1] * 4, lane=0)
    assert four.step_seconds(0, free=True) == pytest.approx(0.132)
    summed = (3 + four.expected_tokens(31, acc)) / four.step_seconds(31, free=True)
    assert summed > SHARED_GAIN * 4 / four.step_seconds(0, free=True)
    assert four.best_k(acc, 4, free=True, longer=longer) == 0
    assert SharedBatch(pool, [1] * 8, lane=0).best_k(acc, 4, free=True, longer=longer) == 0
    assert SharedBatch(pool, [1, 128, 1, 1], lane=0).best_k(acc, 4, free=True, longer=longer) == 31
    assert pool.best_k(acc, 4, free=True, longer=longer) == 63
    even = SharedBatch(pool, [2, 2, 2, 2], lane=0)
    assert even.rate(1, 2.0, free=True) == pytest.approx(8 / even.step_seconds(1, free=True))


# Measured on an AMX Xeon 2-core machine (AMX left out of the build), long batches too: 4 tokens cost 1.4 decodes
XEON_LONG = CostModel([0.0856, 0.1301, 0.1721, 0.1190, 0.1584], 0.0103, [16, 32, 64], [0.35, 0.70, 1.45])


def test_a_generation_joining_busy_slots_warms_the_draft_only_where_drafting_pays_beside_them(tiny_draft) -> None:
    """Alone, the draft model pays on this CPU, so it prefills the prompt; beside 7 slots on plain steps a chain
    runs as a micro-batch of its own and does not pay, so the prefill (a tick every slot waits for) is skipped."""
    alone, beside = AutoPolicy(XEON_LONG, 4, model=True), AutoPolicy(XEON_LONG, 4, model=True, peers=lambda: 7)
    with open_decoder(tiny_draft) as d:
        proposers = {"lookup": LookupProposer(d.n_vocab),
                     "draft": DraftModelProposer(d, d.n_vocab, SamplingParams(), np.random.default_rng(0))}
        assert alone.begin([1, 2, 3], proposers) == {"draft"}
        assert beside.begin([1, 2, 3], proposers) == set()
    assert alone.lanes == () and beside.lanes == (1,) * 8 and beside.peers == 7
    assert beside.model_length.costs.others == 7  # its first steps are priced in that batch too


def test_the_draft_model_prices_every_slot_drafting_alike_while_all_are_on_steps() -> None:
    """On the AMX Xeon two slots' 2-token chains (4 tokens, one pass) cost less than their two plain tokens: both
    together pay (and so does one alone, the other's token padded into the same pass: even_lanes). With
    four slots on plain steps a batch of 8 costs too much for drafting to pay, together or not."""
    two = SharedBatch(XEON_LONG, [1, 1], lane=1, follow=True)
    assert two.step_seconds(1) == pytest.approx(XEON_LONG.batch_seconds(4) + XEON_LONG.draft)
    assert two.best_k(0.7, 4) == 1
    assert SharedBatch(XEON_LONG, [1, 1], lane=1).best_k(0.7, 4) == 1
    assert SharedBatch(XEON_LONG, [1, 1, 1, 1], lane=0, follow=True).best_k(0.7, 4) == 0
    auto = AutoPolicy(XEON_LONG, 4, model=True)
    auto.lanes, auto.lane = (2, 2), 0
    auto.price_at(10)
    assert auto.model_length.costs.follow and not auto.lookup_length.costs.follow  # lookup's guesses are its own
    auto.lanes = (2, SLOT_CHUNK)  # the other slot prefills a prompt: its next chunk is no step's chain
    auto.price_at(10)
    assert not auto.model_length.costs.follow
    auto.lanes = (2, 40)  # a shorter chunk was its prompt's last: it steps next
    auto.price_at(10)
    assert auto.model_length.costs.follow


def test_following_slots_price_their_drafts_as_one_draft_batch_of_every_slot() -> None:
    """Eight slots drafting one token each run a draft batch of 8 tokens a position. Priced as one draft token,
    drafts kept 70% of the time looked worth a 16-token target batch on the AMX Xeon, and all 8 slots drafted at a
    loss (d617794:docs/benchmarks-parallel.md, run 10); priced as the batch they run in, they do not draft."""
    one_token = SharedBatch(XEON_POOL, [1] * 8, lane=0, follow=True)
    assert one_token.best_k(0.7, 4) == 1 and one_token.step_seconds(1) == pytest.approx(0.39 + XEON_POOL.draft)
    pool = replace(XEON_POOL, draft_sizes=[8], draft_batches=[0.05])
    batch = SharedBatch(pool, [1] * 8, lane=0, follow=True)
    assert batch.step_seconds(1) == pytest.approx(0.39 + 0.05)
    assert batch.best_k(0.7, 4) == 0
    assert SharedBatch(pool, [1] * 8, lane=0).step_seconds(1) == pytest.approx(0.25 + 0.0856 + pool.draft)  # alone
    assert pool.draft_seconds(4) == pytest.approx(pool.draft + (0.05 - pool.draft) * 3 / 7)  # between the sizes
    # learning: a draft decode timed in a batch of 8 corrects every draft price by its ratio to that batch's price
    learned = pool.copy()
    learned.observe(2, 0.0, 1, 0.06, draft_width=8)
    assert learned.draft_batches[0] == pytest.approx(0.05 * 1.04) and learned.draft == pytest.approx(pool.draft * 1.04)
    alone = pool.copy()
    alone.observe(2, 0.0, 1, 0.02)  # one slot's draft token: as before, toward the time seen
    assert alone.draft == pytest.approx(pool.draft + 0.2 * (0.02 - pool.draft))


def test_following_slots_price_what_each_slot_s_drafts_keep() -> None:
    """Following slots price every slot's drafts by that slot's own record, so all choose alike. Priced by its own
    record alone, a slot whose drafts were kept 94% of the time drafted beside 7 that did not, and its chain ran as a
    pass of its own, 282 ms a tick against 201 (costs as learned there: d617794:docs/benchmarks-parallel.md, run 12)."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.220, 0.313, 0.478], draft_sizes=[8], draft_batches=[0.040])
    mine, theirs = [0.94] * 4, [0.6] * 4

    def planned(costs: CostModel, acceptance: list[float]) -> int:
        length = AdaptiveLength(costs, 4)
        length.acceptance = acceptance
        return length.planned()

    assert planned(SharedBatch(pool, [1] * 8, lane=6, follow=True), mine) == 1  # as if all kept as many
    others = {i: theirs for i in range(8) if i != 6}
    assert planned(SharedBatch(pool, [1] * 8, lane=6, follow=True, fellows=others), mine) == 0
    assert planned(SharedBatch(pool, [1] * 8, lane=6, follow=True, fellows={i: mine for i in others}), theirs) == 1
    # a slot with no record yet is priced by this slot's; an idle slot not at all
    half = SharedBatch(pool, [1] * 8, lane=6, follow=True, fellows={i: theirs for i in range(4)})
    assert half.rate(1, 1.94) == pytest.approx((4 * 1.6 + 4 * 1.94) / (0.313 + 0.040))
    idle = SharedBatch(pool, [1, 1, 0, 1], lane=0, follow=True, fellows={1: theirs, 2: mine, 3: theirs})
    assert idle.rate(1, 1.94) == pytest.approx((1.94 + 2 * 1.6) / idle.step_seconds(1))
    # through the slots' policies: each registers its record where the others price it, so all 8 choose alike
    records = SlotRecords()
    slots = [AutoPolicy(pool, 4, model=True, slot_records=records) for _ in range(8)]
    for lane, auto in enumerate(slots):
        auto.model_length.acceptance = list(mine if lane == 6 else theirs)
        auto.observe(PLAIN, NO_DRAFT, Verdict([0], 0, 0.22, 8, 0, batched=8, shape=BatchShape((1,) * 8), lane=lane), None)
    assert records.draft == {lane: auto.model_length for lane, auto in enumerate(slots)} and records.mtp == {}
    for auto in slots:
        auto.price_at(10)
    assert [auto.model_length.planned() for auto in slots] == [0] * 8
    for auto in slots:
        auto.model_length.acceptance = list(mine)
    for auto in slots:
        auto.price_at(10)
    assert [auto.model_length.planned() for auto in slots] == [1] * 8


def test_drafting_beside_other_slots_must_clear_a_wider_margin() -> None:
    """8 slots each drafting a token kept 70% of the time, priced at 1.05 times plain steps (costs as learned on the
    AMX Xeon, d617794:docs/benchmarks-parallel.md, run 12): past MIN_GAIN, short of SHARED_GAIN, so no slot drafts."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.336, 0.478], draft_sizes=[8], draft_batches=[0.0392])
    batch = SharedBatch(pool, [1] * 8, lane=0, follow=True)
    assert MIN_GAIN < batch.expected_rate(1, 0.7) / batch.expected_rate(0, 0) < SHARED_GAIN
    length = AdaptiveLength(batch, 4)
    length.acceptance = [0.7] * 4
    assert length.planned() == 0
    assert batch.shared and not pool.shared and not SharedBatch(pool, [0, 1], lane=1).shared  # alone in its batch


def test_a_pool_where_nothing_pays_steps_plain_unpriced_until_its_plan_is_due(tiny_draft) -> None:
    """Beside 7 busy slots at the Xeon's prices, drafts kept half the time do not pay (nor would a probe, priced by
    every slot's record) and no lookup guess could: one slot works the pool's plan out, and every slot's steps are
    then plain without pricing until the plan is due again (REACH_TICKS ticks); drafts that start paying are then
    drafted by every slot in the same tick."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.30, 0.36], draft_sizes=[8], draft_batches=[0.0392])
    priced: list[tuple[int, int]] = []  # (tick, lane) of every batch price worked out
    padded = pool.padded_seconds
    tick, lane = 0, 0

    def counted(*args, **kwargs):
        priced.append((tick, lane))
        return padded(*args, **kwargs)

    pool.padded_seconds = counted
    records, greedy = SlotRecords(), SamplingParams()
    context = [1, 17, 29, 301]
    with open_decoder(tiny_draft) as d:
        slots = [AutoPolicy(pool, 4, model=True, slot_records=records, peers=lambda: 7) for _ in range(8)]
        proposers = [begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, None), context)
                     for auto in slots]
        for auto in slots:
            auto.model_length.acceptance = [0.5] * 4  # 1.03x plain batching, short of SHARED_GAIN
        plans: list[list[Plan]] = []
        for tick in range(1, 3 * REACH_TICKS):
            if tick == 2 * REACH_TICKS:  # the drafts now pay (the probes' records, as if kept)
                for auto in slots:
                    auto.model_length.acceptance = [0.94] * 4
            plans.append([])
            for lane, (auto, props) in enumerate(zip(slots, proposers)):
                plan, draft = step(auto, props, context, 4, room=500)
                plans[-1].append(plan)
                kept = len(draft.tokens) if tick >= 2 * REACH_TICKS else 0
                verdict = Verdict([*draft.tokens[:kept], 0], len(draft.tokens), 0.0, len(draft.tokens) + 1, 0,
                                  shape=BatchShape((1,) * 8, tick), lane=lane)
                auto.observe(plan, draft, verdict, None)
            d.reset()  # (the context stays: 4 tokens for a probe's draft to catch up on)
    assert not any(p.source for row in plans[: 2 * REACH_TICKS - 1] for p in row)
    # after the first tick (every slot's own prices: the batch's shape is not known yet), a slot's full plan prices
    # the batch once in REACH_TICKS ticks (and a probe due, weighed); never two slots in a tick
    ticks = sorted({t for t, _ in priced if 1 < t < 2 * REACH_TICKS})
    assert 1 <= len(ticks) <= 2 + 2 * REACH_TICKS // PROBE_EVERY, ticks
    assert all(len({ln for t, ln in priced if t == tick}) == 1 for tick in ticks), priced
    drafting = [t + 1 for t, row in enumerate(plans) if any(p.source for p in row)]
    assert drafting and 2 * REACH_TICKS <= drafting[0] <= 3 * REACH_TICKS - 2, drafting
    assert all(len(set(plans[t - 1])) == 1 and plans[t - 1][0].source == "draft" for t in drafting)  # all at once


def test_a_slot_s_quiet_run_counts_its_steps_as_asking_each_one_would(tiny_draft, monkeypatch) -> None:
    """After a quiet step, a slot's next steps are not asked of the pool's plan while it stands for the same batch:
    what each would count (a plain step, a probe falling due deferred where the plan says none would pay) is counted
    when the run ends. Probes fall due on the same ticks as where every step is asked: 4 slots on `auto` beside 4
    plain ones (priced at the record's own acceptance), first where no probe would pay, then (the batches cheaper)
    where probes pay and back off."""

    def drafting(quiet_runs: bool) -> tuple[list[int], list[tuple]]:
        if not quiet_runs:
            monkeypatch.setattr(QuietRun, "start", lambda self, *args: None)
        pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.30, 0.36], draft_sizes=[8], draft_batches=[0.0392])
        records, context = SlotRecords(), [1, 17, 29, 301]
        ticks = []
        with open_decoder(tiny_draft) as d:
            slots = [AutoPolicy(pool, 4, model=True, slot_records=records, peers=lambda: 7) for _ in range(4)]
            proposers = [begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, SamplingParams(),
                                                                                    None), context) for auto in slots]
            for auto in slots:
                auto.model_length.acceptance = [0.3] * 4
            for tick in range(1, 4 * REACH_TICKS):
                if tick == REACH_TICKS + 50:  # probes pay from the next plan on (drafts kept 30% still do not)
                    pool.slot_verify[1:] = [0.26, 0.29]
                    pool.forget_prices()
                for lane, (auto, props) in enumerate(zip(slots, proposers)):
                    plan, draft = step(auto, props, context, 4, room=500)
                    ticks += [tick] * bool(plan.source)
                    verdict = Verdict([0], len(draft.tokens), 0.0, len(draft.tokens) + 1, 0,
                                      shape=BatchShape((1,) * 8, tick), lane=lane)
                    auto.observe(plan, draft, verdict, None)
                d.reset()
            monkeypatch.undo()
            return ticks, [(auto.decision(), auto.steps, auto.unsearched) for auto in slots]

    ran, asked = drafting(True), drafting(False)
    assert ran == asked
    probes = sorted(set(ran[0]))
    assert len(ran[0]) == 4 * len(probes) and len(probes) >= 3, probes  # every slot probes in the same tick
    assert 2 * REACH_TICKS < probes[0] and probes[1] - probes[0] < probes[2] - probes[1], probes  # backing off


class QuietPool:
    """8 slots on `auto` at the Xeon's prices, where nothing pays beside 7 busy slots (drafts kept 70% of the time), on
    the tiny draft (or on lookup alone), begun together after batch 0: `run` steps them all, each tick's batch `lanes`
    (every slot's step plain), and `priced` holds the tick of every batch price worked out meanwhile."""

    def __init__(self, draft: DraftModelProposer | None) -> None:
        self.pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.30, 0.36], draft_sizes=[8],
                            draft_batches=[0.0392])
        self.priced: list[int] = []
        self.pricers: list[tuple[int, int]] = []  # (tick, lane) of every slot's step that priced
        self.tick, padded = 0, self.pool.padded_seconds

        def counted(*args, **kwargs):
            self.priced.append(self.tick)
            return padded(*args, **kwargs)

        self.pool.padded_seconds = counted
        records, self.context = SlotRecords(), [1, 17, 29, 301]
        model = draft is not None
        self.slots = [AutoPolicy(self.pool, 4, model=model, slot_records=records, peers=lambda: 7,
                                 last_tick=lambda: self.tick) for _ in range(8)]
        n_vocab = draft.n_vocab if model else 512
        self.proposers = [begin(auto, LookupProposer(n_vocab), draft, self.context) for auto in self.slots]

    def run(self, ticks: range, lanes: tuple[int, ...] = (1,) * 8, stepping: tuple[int, ...] = tuple(range(8))
            ) -> list[Plan]:
        """Each tick, the slots in `stepping` step (the others' prompts go on)."""
        plans = []
        for self.tick in ticks:
            for lane in stepping:
                auto, props = self.slots[lane], self.proposers[lane]
                priced = len(self.priced)
                plan, draft = step(auto, props, self.context, 4, room=500)
                if len(self.priced) > priced:
                    self.pricers.append((self.tick, lane))
                plans.append(plan)
                verdict = Verdict([0], len(draft.tokens), 0.0, len(draft.tokens) + 1, 0,
                                  shape=BatchShape(lanes, self.tick), lane=lane)
                auto.observe(plan, draft, verdict, None)
        return plans


def test_a_due_plan_stands_on_while_what_priced_it_has_not_moved(tiny_draft) -> None:
    """A pool's plan where nothing drafts is due after REACH_TICKS ticks, and then stands as many more without
    pricing where no price it was priced from moved by more than PLAN_DRIFT since (a tick's noise), nor any slot's
    drafting record: every REACH_TICKS ticks a slot priced it again at the same prices, most of a steady pool's
    planning. A price moved by more, or a record, and it is priced again at the next check, by one slot."""
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        pool.run(range(1, 5))
        assert pool.priced and max(pool.priced) <= 2
        pool.priced.clear()
        costs = pool.pool
        costs.slot_verify = [v * (1 - PLAN_DRIFT / 2) for v in costs.slot_verify]  # (as learning moves them)
        costs.forget_prices()
        assert not any(p.source for p in pool.run(range(5, 3 * REACH_TICKS))) and not pool.priced
        costs.slot_verify = [v * (1 - 2 * PLAN_DRIFT) for v in costs.slot_verify]
        costs.forget_prices()
        assert not any(p.source for p in pool.run(range(3 * REACH_TICKS, 5 * REACH_TICKS)))
        ticks = sorted(set(pool.priced))
        assert ticks and ticks[0] >= 3 * REACH_TICKS and len(ticks) <= 2, ticks  # its next check (and may_pay's)
        assert len({lane for tick, lane in pool.pricers if tick == ticks[0]}) == 1
        pool.priced.clear()
        for auto in pool.slots:  # every slot's record moves (as judged drafts would move it)
            auto.model_length.acceptance = [a - 2 * PLAN_DRIFT for a in auto.model_length.acceptance]
        pool.run(range(5 * REACH_TICKS, 7 * REACH_TICKS))
        assert pool.priced and min(pool.priced) >= 5 * REACH_TICKS


def test_a_pool_that_drafted_nothing_for_reach_ticks_rests_on_its_quiet_plan_beside_prompt_chunks(tiny_draft) -> None:
    """Beside another slot's prompt chunk (a batch no plan stands for), a slot searches for a lookup guess, until the
    pool has drafted nothing at that many busy slots for REACH_TICKS ticks: it then rests on its quiet plan there,
    beside the chunk too, unsearched and unpriced, counted as a plain step; a generation joining takes it too. A
    step that drafts at that many busy slots ends the rest (here 7 of 8: one slot is idle)."""
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        records = pool.slots[0].slot_records
        idle, chunk = (1,) * 7 + (0,), (1, 1, SLOT_CHUNK, 1, 1, 1, 1, 0)
        stepping, beside = tuple(range(7)), (0, 1, 3, 4, 5, 6)
        searches = lambda: sum(p["lookup"].searches for p in pool.proposers)  # noqa: E731

        def joined() -> tuple[AutoPolicy, int]:  # a generation joining 6 busy slots: what pricing it took
            auto = AutoPolicy(pool.pool, 4, model=True, slot_records=records, peers=lambda: 6,
                              last_tick=lambda: pool.tick)
            priced = len(pool.priced)
            begin(auto, LookupProposer(d.n_vocab), pool.proposers[0]["draft"], pool.context)
            return auto, len(pool.priced) - priced

        pool.run(range(1, 5), lanes=idle, stepping=stepping)
        before = searches()
        assert not any(p.source for p in pool.run(range(5, 7), lanes=chunk, stepping=beside))
        assert searches() - before == len(beside)  # (each slot's step beside the chunk: one tick's)
        pool.run(range(7, REACH_TICKS + 10), lanes=idle, stepping=stepping)
        pool.priced.clear()
        before = searches()
        plain = lambda: [(auto.decision(), auto.steps[None])[1] for auto in pool.slots]  # noqa: E731 (settled)
        steps = plain()
        plans = pool.run(range(REACH_TICKS + 10, REACH_TICKS + 20), lanes=chunk, stepping=beside)
        assert not any(p.source for p in plans) and searches() == before and not pool.priced
        assert plain() == [n + 10 * (lane in beside) for lane, n in enumerate(steps)]
        pool.priced.clear()  # (what decision() priced to say why)
        auto, priced = joined()  # (no plan for its batch of 7 steps stands: the rest's)
        assert not priced and step(auto, pool.proposers[0], pool.context, 4, room=500)[0] == PLAIN
        assert not pool.priced
        records.drafted(7, REACH_TICKS + 20)  # (as a slot's step that drafted tells its pool: below)
        pool.run(range(REACH_TICKS + 20, REACH_TICKS + 22), lanes=chunk, stepping=beside)
        assert searches() - before == 2 * len(beside)  # (both ticks' steps beside the chunk)


def test_a_quiet_run_on_the_pool_s_rest_goes_on_after_batches_of_as_many_busy_slots_until_a_step_drafts() -> None:
    """A slot's quiet run on the pool's rest is not asked again after a batch of another shape with as many busy
    slots (another slot's prompt chunk), nor with as many as the pool rests at too, but is after one with fewer where
    it does not, after any step of the pool drafted, and, on a plan of its batch's own, after any other batch."""
    pool, records = SlotRecords(), (AdaptiveLength(XEON_POOL, 4, free=True),)

    def quiet(lanes: tuple[int, ...]) -> TickPlan:
        plan = pool.put(TickPlan(3, {}, (), XEON_POOL, (lanes,), lanes))
        plan.reached(False)
        return plan

    plan, fewer = quiet((1,) * 4), quiet((1, 0, 1, 1))
    run, own = QuietRun(), QuietRun()
    run.start(plan, (1,) * 4, records, 100, pool)
    own.start(plan, (1,) * 4, records, 100)
    assert run.goes_on((1, SLOT_CHUNK, 1, 1), 5) and run.lanes == (1, SLOT_CHUNK, 1, 1)  # (not asked again)
    assert not run.goes_on((1, 0, 1, 1), 5) and not own.goes_on((1, SLOT_CHUNK, 1, 1), 5)
    pool.drafted(4, 9)  # a step beside 3 busy slots drafted
    assert not run.goes_on((1, 1, SLOT_CHUNK, 1), 10)
    run.start(plan, (1,) * 4, records, 100, pool)
    pool.rested(3, fewer, 3)  # the pool rests at 3 busy slots from REACH_TICKS ticks on
    assert not run.goes_on((1, 0, 1, 1), 11) and run.goes_on((1, 0, 1, 1), 3 + REACH_TICKS)


def test_a_step_that_drafts_in_a_pool_tells_its_pool_at_how_many_busy_slots() -> None:
    """A lookup guess that pays beside one other busy slot is verified; the pool's records then hold the tick it
    drafted at (SlotRecords.quiet_since: no rest at 2 busy slots from then on)."""
    records = SlotRecords()
    auto = AutoPolicy(XEON_POOL, 4, model=False, slot_records=records)
    proposers = begin(auto, LookupProposer(4096))
    auto.observe(PLAIN, NO_DRAFT, Verdict([0], 0, 0.0, 1, 0, shape=BatchShape((1, 1, 0), 9), lane=0), None)
    plan, draft = step(auto, proposers, [7, 8, 9, 5, 7, 8, 9, 5, 7, 8], 4)
    assert plan.source == "lookup" and draft.tokens
    auto.observe(plan, draft, Verdict([*draft.tokens, 0], len(draft.tokens), 0.0, len(draft.tokens) + 1, 0,
                                      shape=BatchShape((1 + len(draft.tokens), 1, 0), 10), lane=0), None)
    assert records.quiet_since == {2: 10}


def test_a_plan_worked_out_after_a_later_batch_stands_for_a_slot_whose_last_batch_was_earlier() -> None:
    """A slot whose last batch is older than the plan's (its prompt went on meanwhile) takes it: the same shape at
    newer prices (it priced its own before, and its plan replaced the newer one for every slot)."""
    records, costs = SlotRecords(), replace(XEON_POOL, slots=2, slot_verify=[0.2, 0.3])
    plan = records.put(TickPlan(10, {}, (), costs, ("key",), (1, 1)))
    assert records.standing(("key",), costs, 4) is plan and records.standing(("key",), costs, 10) is plan
    assert records.standing(("key",), costs.copy(), 10) is None  # another context size's prices
    assert records.standing(("key",), costs, 10 + REACH_TICKS) is plan  # due; nothing moved: stands on
    plan.cut(10 + REACH_TICKS)  # a model drafted on it
    assert records.standing(("key",), costs, 11 + REACH_TICKS) is None


def test_a_pool_on_lookup_alone_steps_plain_unpriced_where_no_guess_could_pay() -> None:
    """Without a drafting model (`auto` on lookup alone) a pool's quiet steps run on its plan too: priced once."""
    pool = QuietPool(None)
    assert not any(p.source for p in pool.run(range(1, 3 * PROBE_EVERY)))
    assert pool.priced and max(pool.priced) <= 2
    assert all(auto.decision().startswith("speculation off") for auto in pool.slots)


@pytest.mark.parametrize("lanes", [(1,) * 8, (1, 1, 0, 1, 1, 1, 0, 1), (1, 1, 40, 1, 1, 1, 1, 1), (3, 1, 1, 1),
                                   (1, 1, SLOT_CHUNK, 1, 1, 1, 1, 1), (1,) * 9 + (SLOT_CHUNK,), (1, 1),
                                   (1, SLOT_CHUNK)])
def test_a_slot_searches_for_lookup_guesses_where_the_best_length_kept_whole_would_pay(lanes) -> None:
    """Lookup searches beside the others' batch (each other slot stepping next, or its prompt's chunk going on) only
    where its best guess, every token kept, would beat a plain step by SHARED_GAIN (Prices.best over k_max's lengths
    and the copy's longer ones): beside busy slots' steps on this CPU none does; beside a prompt's chunk, most do;
    beside 9 slots and a chunk, only a long one."""
    lookup = LookupProposer(4096)
    auto = AutoPolicy(XEON_POOL, 4, model=False, slot_records=SlotRecords())
    proposers = begin(auto, lookup)
    auto.lanes, auto.lane, auto.tick = lanes, 0, 5
    step(auto, proposers, [7, 8, 9, 7, 8], 4)
    view = SharedBatch(XEON_POOL, [n if i == 0 or n >= SLOT_CHUNK else min(n, 1) for i, n in enumerate(lanes)], 0)
    rate, longer = view.rate, auto.copy_length.longer
    _, best = view.best(1.0, 4, k_min=1, free=True, longer=longer)
    pays = best >= SHARED_GAIN * rate(0, 1.0)
    assert lookup.searches == pays and auto.unsearched == (not pays)
    if len(lanes) == 10:
        assert pays and max(rate(k, k + 1.0, free=True) for k in range(1, 5)) < SHARED_GAIN * rate(0, 1.0)


def test_slots_starting_together_price_the_pool_s_plan_once_and_step_quiet_from_their_first_step(tiny_draft) -> None:
    """Generations that begin together beside each other (a batch job's first prompts, a pool's slots refilled at
    once) begin as of the pool's last batch: the first prices the pool's plan, the others take it at their start;
    once the first slot's first step has worked out that no lookup guess pays there, the others' first steps are
    plain unpriced. (Each priced its own start and first step before, and two of them drafted at their first.)"""
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        pool.run(range(1, 5))
        pool.priced.clear()
        priced = []
        pool.tick = 9  # the next generations begin together after batch 9
        for auto, proposers in zip(pool.slots, pool.proposers):
            assert auto.begin(pool.context, proposers) == set()
            priced.append(len(pool.priced))
        assert priced[0] and set(priced) == {priced[0]}, priced  # the first priced the pool's plan, the others took it
        pool.priced.clear()
        assert not any(p.source for p in pool.run(range(10, 11), stepping=(0,)))
        assert pool.priced  # the first slot's first step: whether a lookup guess could pay beside the others
        pool.priced.clear()
        assert not any(p.source for p in pool.run(range(10, 11), stepping=tuple(range(1, 8))))
        assert not pool.priced


def test_a_pool_s_plan_stands_through_a_slot_s_uneven_step_and_a_generation_joining(tiny_draft) -> None:
    """The pool's plan prices each other busy slot as stepping next, whatever it added last: one slot's lookup guess
    in a batch (uneven lanes) leaves it standing for every slot, and a generation joining the busy slots takes it
    at its start and first step; priced again only where a record's restart moved it (a slot that drafted)."""
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        pool.run(range(1, 5))
        assert pool.priced and max(pool.priced) <= 2  # the first ticks' plans, then none
        pool.priced.clear()
        pool.run(range(5, 6), lanes=(1, 1, 5, 1, 1, 1, 1, 1))  # slot 2's 4-token guess rode in tick 5
        assert not any(p.source for p in pool.run(range(6, 20))) and not pool.priced
        slot, proposers = pool.slots[3], pool.proposers[3]
        for moved in (False, True):  # slot 3's next generation, its record at the prior, then after drafting
            slot.model_length.acceptance = [0.2 if moved else slot.model_length.prior] * 4  # (a restart moves it
            assert slot.begin(pool.context, proposers) == set()  # halfway back to the prior; the draft not prefilled)
            assert bool(pool.priced) == moved  # its start priced only where the restart renewed the pool's plans
            pool.priced.clear()
            start = 20 + 10 * moved
            assert not any(p.source for p in pool.run(range(start, start + 10)))
            assert sorted(set(pool.priced)) == ([start] if moved else [])  # then the next tick's, once
            pool.priced.clear()


def test_slots_beside_a_long_prompt_price_a_step_only_where_lookup_found_a_guess(tiny_draft) -> None:
    """Beside another slot's prompt going on chunk after chunk, while the pool's steps draft from no model, a
    stepping slot searches first and prices its place beside the chunk only where lookup found a guess: each chunk
    makes a batch no tick had, and every slot pricing its place in each took most of a busy pool's planning."""
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        pool.run(range(1, 5))
        pool.priced.clear()
        chunk = (1, 1, 1, SLOT_CHUNK, 1, 1, 1, 1)
        stepping = (0, 1, 2, 4, 5, 6, 7)
        pool.run(range(5, 6), lanes=chunk)  # slot 3 began a long prompt: its first chunk
        assert not any(p.source for p in pool.run(range(6, 12), lanes=chunk, stepping=stepping))
        assert not pool.priced and all(pool.proposers[i]["lookup"].searches for i in stepping)  # searched, no guess
        pool.context = list(range(5, 30)) * 2  # slot 0's answer copies: its guess rides the chunk nearly free
        (plan,) = pool.run(range(12, 13), lanes=chunk, stepping=(0,))
        assert plan.source == "lookup" and plan.k and set(pool.priced) == {12} and pool.slots[0].guessed == 1
        pool.priced.clear()
        pool.context = [1, 17, 29, 301]
        pool.run(range(13, 14), lanes=(1, 1, 1, 40, 1, 1, 1, 1), stepping=stepping)  # its last chunk, shorter
        assert not any(p.source for p in pool.run(range(14, 20))) and not pool.priced  # all stepping: the plan


def test_busy_slots_beside_idle_ones_take_one_plan_for_each_place(tiny_draft) -> None:
    """Where some slots are idle, a chain beside one-token steps prices alike from any busy sequence of a run and
    alike from any between idle ones (llama.cpp runs consecutive sequences' tokens together: micro_batches), so a
    pool where no model drafts works out one plan for each of the two places, not one for every slot, at the
    prices each would have worked out for itself; where the draft model drafts beside them, each slot its own."""
    lanes, stepping = (1, 1, 0, 1, 1, 1, 0, 1), (0, 1, 3, 4, 5, 7)
    pool = QuietPool(None)
    pool.run(range(1, 5))
    pool.run(range(5, 8), lanes=lanes, stepping=stepping)
    assert [(tick, lane) for tick, lane in pool.pricers if tick > 5] == [(6, 0), (6, 7)]  # the first of each place
    lengths = (*range(5), *pool.slots[0].copy_length.longer)
    for lane in stepping:
        own = SharedBatch(pool.pool, lanes, lane)
        taken = pool.slots[lane].copy_length.costs
        assert [taken.step_seconds(k, True) for k in lengths] == [own.step_seconds(k, True) for k in lengths]
    with open_decoder(tiny_draft) as d:
        pool = QuietPool(DraftModelProposer(d, d.n_vocab, SamplingParams(), None))
        pool.run(range(1, 5))
        pool.run(range(5, 7), lanes=lanes, stepping=stepping)
        assert [lane for tick, lane in pool.pricers if tick == 6] == list(stepping)
        assert pool.slots[0].model_length.planned()  # (at these prices, 2-token chains beside idle slots)


def test_a_pool_s_steps_are_priced_by_their_shape_as_measured_together() -> None:
    """llama.cpp computes 8 sequences' tokens with other kernels than one sequence's 8 (on the AMX Xeon 232 ms
    against 353): a micro-batch of every slot's 1 to 3 tokens is priced as measured together, of fewer slots'
    between that and one sequence's, any other by its tokens; a tick teaches only the slots' shape it ran as."""
    assert micro_shapes([1, 1, 4]) == [(3, 1), (1, 3)] and micro_shapes([2, 0, 2]) == [(1, 2), (1, 2)]
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.372, 0.50])
    assert pool.micro_seconds(8, 1) == 0.232 and pool.micro_seconds(8, 2) == 0.372
    assert pool.micro_seconds(8, 4) == pool.batch_seconds(32) and pool.micro_seconds(1, 8) == pool.batch_seconds(8)
    # fewer slots' tokens: between one sequence's and every slot's, by the sequences
    assert pool.micro_seconds(5, 2) == pytest.approx(pool.verify[1] + (0.372 - pool.verify[1]) * 4 / 7)
    assert even_lanes([2, 2, 2, 2, 2, 0, 2, 2], pool.micro_seconds, 5) == (2,) * 8  # one pass, not two
    assert SharedBatch(pool, [1] * 8, lane=0, follow=True).step_seconds(1) == pytest.approx(0.372 + pool.draft)
    learned = pool.copy()
    learned.observe(16, 0.40, 0, 0.0, verify_seqs=8)
    assert learned.slot_verify[1] > 0.372 and learned.long_verify == pool.long_verify and learned.verify == pool.verify
    learned = pool.copy()
    learned.observe(7, 0.40, 0, 0.0, verify_seqs=7)  # 7 slots' tokens: that shape alone, from its interpolated price
    seen = pool.micro_seconds(7, 1)
    assert learned.shapes == {(7, 1): pytest.approx(seen * (0.40 / seen) ** 0.2)} and pool.shapes == {}
    assert learned.slot_verify == pool.slot_verify and learned.verify == pool.verify
    assert learned.micro_seconds(6, 1) == pool.micro_seconds(6, 1)
    learned.observe(2 * 128, 4.0, 0, 0.0, verify_seqs=2)  # two prompts' chunks: no step's shape
    assert learned.shapes.keys() == {(7, 1)}


def test_fewer_slots_shapes_are_priced_as_their_ticks_ran() -> None:
    """On the AMX Xeon 2 slots' tokens took 147 ms a tick, priced 112 between one sequence's and every slot's, and
    their 2 tokens each 145, priced 194: two slots drafting a token each priced below their plain steps and never
    drafted (d617794:docs/benchmarks-parallel.md, run 16). The ticks teach each shape its own price."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.372, 0.50], draft_sizes=[8], draft_batches=[0.0392],
                   shapes={})
    length = AdaptiveLength(SharedBatch(pool, [1, 1], lane=0, follow=True), 4)
    length.acceptance = [0.7] * 4
    assert length.planned() == 0
    for _ in range(20):
        length.update(0, 0, Timing(0.147, 2, batch=BatchShape((1, 1))))  # plain steps of the two slots, in one pass
    assert pool.micro_seconds(2, 1) == pytest.approx(0.147, rel=0.02) and pool.shapes.keys() == {(2, 1)}
    length.costs = SharedBatch(pool, [1, 1], lane=0, follow=True)  # the next step's prices
    assert length.planned() == 1


def test_a_tick_of_several_passes_teaches_each_shape_by_how_far_their_sum_was_off() -> None:
    """7 slots' plain tokens beside an idle slot run in two passes, (3, 1) and (4, 1): unlearned, a price that made
    that look cheaper than padding to 8 was never corrected, and the pool ran it tick after tick at 300-438 ms where
    padded ticks took 238-347 (d617794:docs/benchmarks-parallel.md, run 19). A prompt's chunk among the passes teaches
    nothing: micro_batches does not price llama.cpp's cuts at n_ubatch."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.372, 0.50], shapes={(3, 1): 0.09, (4, 1): 0.10})
    lanes = [1, 1, 1, 0, 1, 1, 1, 1]
    assert even_lanes(lanes, pool.micro_seconds, 5) == tuple(lanes)  # two passes priced 0.19, one of 8: 0.232
    length = AdaptiveLength(pool, 4)
    for _ in range(10):  # the two passes take 0.33 s a tick
        length.update(0, 0, Timing(0.33, 7, batch=BatchShape(tuple(lanes))))
    assert pool.shapes[3, 1] / pool.shapes[4, 1] == pytest.approx(0.9)  # each moved alike, toward the sum's time
    assert pool.shapes[3, 1] + pool.shapes[4, 1] > 0.3 and pool.slot_verify[0] == 0.232
    assert even_lanes(lanes, pool.micro_seconds, 5) == (1,) * 8  # the idle slot is padded now
    chunk = Timing(2.0, 71, batch=BatchShape((1, 1, 1, 68)))
    learned = dict(pool.shapes)
    length.update(0, 0, chunk)
    assert pool.shapes == learned
    # one slot's 3-token chain beside 3 plain steps: (4, 1) then (1, 2), the 4 slots' tokens learn; one
    # sequence's 2 stay priced by `verify`
    length.update(0, 0, Timing(0.5, 6, batch=BatchShape((1, 1, 1, 3))))
    assert pool.shapes.keys() == {(3, 1), (4, 1)} and pool.shapes[4, 1] > learned[4, 1]


def test_a_shared_tick_is_learned_once_however_many_slots_report_it() -> None:
    """Every slot's step in a shared batch reports the batch: learned from each of 8 slots at weight 0.2, one slow
    tick of 626 ms moved the price of 8 slots' tokens from about 290 ms to 540, and all drafted on that one price
    for 185 ticks (d617794:docs/benchmarks-parallel.md, run 20). The batch's number (`tick`) makes it one observation."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.29, 0.40, 0.50])
    slots = [AutoPolicy(pool, 4, model=True) for _ in range(8)]
    for lane, auto in enumerate(slots):  # tick 5: all 8 slots' plain tokens, 626 ms
        auto.source = auto.model_length
        auto.observe(PLAIN, NO_DRAFT, Verdict([0], 0, 0.626, 1, 0, batched=8, shape=BatchShape((1,) * 8, 5), lane=lane),
                     Timing(0.626, 8, batch=BatchShape((1,) * 8, 5)))
    assert pool.slot_verify[0] == pytest.approx(0.29 * (0.626 / 0.29) ** 0.2)  # one step of 0.2, not eight
    assert pool.slot_verify[1] / pool.slot_verify[0] == pytest.approx(0.40 / 0.29)  # its chains alike
    slots[0].observe(PLAIN, NO_DRAFT, Verdict([0], 0, 0.29, 1, 0, batched=8, shape=BatchShape((1,) * 8, 6), lane=0),
                     Timing(0.29, 8, batch=BatchShape((1,) * 8, 6)))  # the next tick teaches again
    assert pool.slot_verify[0] == pytest.approx(0.29 * (0.626 / 0.29) ** 0.16)
    before = pool.draft_seconds(8)
    for _ in range(8):  # so does a draft batch of every slot's token: the draft's price moves once
        pool.observe(0, 0.0, 1, 0.08, draft_width=8, draft_tick=4)
    assert pool.draft_seconds(8) == pytest.approx(0.8 * before + 0.2 * 0.08)
    alone = CostModel(verify=[0.05, 0.09], draft=0.01)  # a context of its own reports no tick: every step learns
    for _ in range(2):
        alone.observe(1, 0.1, 0, 0.0)
    assert alone.verify[0] == pytest.approx(0.05 * 2 ** 0.36)  # 0.2 of the way, then 0.2 of what was left


def test_every_slot_s_plain_ticks_move_their_chains_and_the_draft_alike() -> None:
    """8 slots' plain tokens cost more as their contexts grow; moved alone, their price rose while their chains kept
    the start-up price, and at 8 clients and temperature 0.7 slots that began beside 7 others prefilled the draft
    model and drafted (d617794:docs/benchmarks-parallel.md, run 24). Plain ticks move every slot's shapes and the draft alike,
    as one sequence's plain steps move every size."""
    pool = replace(XEON_POOL, slots=8, slot_verify=[0.232, 0.372, 0.50], draft_sizes=[8], draft_batches=[0.040])

    def planned() -> int:
        length = AdaptiveLength(SharedBatch(pool, [1] * 8, lane=0, follow=True), 4)
        length.acceptance = [0.75] * 4
        return length.planned()

    assert planned() == 0
    for tick in range(30):  # the contexts have grown: every slot's plain tokens take 0.33 s a tick
        pool.observe(8, 0.33, 0, 0.0, verify_seqs=8, tick=tick)
    assert pool.slot_verify == pytest.approx([0.33, 0.372 * 0.33 / 0.232, 0.50 * 0.33 / 0.232], rel=0.01)
    assert pool.draft_batches[0] == pytest.approx(0.040 * 0.33 / 0.232, rel=0.01)
    assert planned() == 0
    pool.observe(16, 0.40, 0, 0.0, verify_seqs=8, tick=30)  # a tick of chains moves its own shape alone
    assert pool.slot_verify[0] == pytest.approx(0.33, rel=0.01)


def test_a_lookup_guess_is_priced_beside_the_others_next_steps_not_their_last_chains() -> None:
    """Seven slots' last batch had other slots' lookup chains in it; they rarely go on in step, so a guess is priced
    beside the plain steps the draft model's shared choice (none, at 8 slots on this Xeon) makes of them: its chain
    is a micro-batch of its own, which a guess kept 95% of the time does not pay for. Beside two slots, where the
    model drafts one token each, the guess is priced beside the other's 2-token chain."""
    auto = AutoPolicy(XEON_LONG, 4, model=True)
    auto.lookup_length.acceptance = [0.95] * 4
    auto.lanes, auto.lane = (1, 4, 1, 4, 1, 1, 1, 1), 0
    auto.price_at(10)
    assert auto.lookup_length.costs.lanes[1:] == [1] * 7
    assert auto.lookup_length.planned() == 0
    assert SharedBatch(XEON_LONG, auto.lanes, 0).best_k(0.95, 4, free=True) > 0  # priced beside the last chains
    auto.lanes = (1, 1)
    auto.price_at(10)
    assert auto.model_length.planned() == 1 and auto.lookup_length.costs.lanes[1] == 2
    auto.lanes = (1, SLOT_CHUNK)  # a prompt's full chunk: the next one follows it
    auto.price_at(10)
    assert auto.lookup_length.costs.lanes[1] == SLOT_CHUNK
    auto.lanes = (1, 40)  # its last chunk: a step follows, as the model's shared choice makes it
    auto.price_at(10)
    assert auto.lookup_length.costs.lanes[1] == auto.model_length.planned() + 1


def test_no_probes_where_even_good_drafts_would_gain_little() -> None:
    # drafts kept 90% of the time would earn 6% here: a failed probe costs far more than that
    assert AVX2.expected_rate(3, 0.9) / AVX2.expected_rate(0, 0) < 1.1
    policy = AdaptiveLength(AVX2, k_max=3)
    assert not any(policy.choose() for _ in range(300))
    # lookup's guesses cost no draft decodes: at 90% they would earn 30%, so lookup is still tried
    lookup = AdaptiveLength(AVX2, k_max=3, free=True)
    assert AVX2.expected_rate(3, 0.9, free=True) / AVX2.expected_rate(0, 0) > 1.25
    assert any(lookup.choose() for _ in range(300))


# Measured on an AVX-512 (Zen 4) 2-core machine here: single tokens are fast, a 4-token batch costs 2.4 of them
ZEN4 = CostModel(verify=[0.0386, 0.0726, 0.1027, 0.0940], draft=0.0082)


def test_no_model_probes_where_a_perfect_run_would_gain_only_a_little() -> None:
    # drafts kept 90% of the time would earn 12%: less than a failed probe and the draft's catching up cost
    assert 1.1 < ZEN4.expected_rate(3, 0.9) / ZEN4.expected_rate(0, 0) < PROBE_GAIN
    model, lookup = AdaptiveLength(ZEN4, k_max=3), AdaptiveLength(ZEN4, k_max=3, free=True)
    assert not any(model.choose() for _ in range(300))
    assert any(lookup.choose() for _ in range(300))  # lookup's guesses cost no draft: 41% at 90%


def test_a_probe_is_charged_the_draft_catching_up() -> None:
    """A probe pays only if it beat plain steps counting every second it took, the draft's catch-up batch too."""
    fast = CostModel([0.082, 0.138, 0.194, 0.131], 0.012)  # where drafting pays (4 tokens for 1.6 decodes)
    gaps = {}
    for catch_up in (0.0, 0.4):
        policy = AdaptiveLength(CostModel(list(fast.verify), fast.draft), k_max=3)
        policy.acceptance = [0.3] * 3  # off, probing
        gaps[catch_up], since = [], 0
        for _ in range(150):
            k = policy.choose()
            since += 1
            # the step as timed: the target's batch at its priced cost; a probe's draft catches up on 16 tokens in
            # one batch, then drafts k
            timing = Timing(policy.costs.verify[k], k + 1)
            if k:
                gaps[catch_up].append(since)
                since = 0
                timing = Timing(policy.costs.verify[k], k + 1, catch_up + k * fast.draft, k + 1, k + 16)
            policy.update(k, 2 if k else 0, timing)  # 3 tokens for one 4-token batch: worth it, unless the catch-up
            policy.acceptance = [0.3] * 3
    assert gaps[0.0][:3] == [PROBE_EVERY] * 3
    assert gaps[0.4][:3] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]


def test_auto_uses_lookup_where_the_draft_model_cannot_pay(tiny_target, tiny_draft) -> None:
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    with open_decoder(tiny_draft) as d:
        costs = CostModel(list(AVX2.verify), AVX2.draft)
        auto = AutoPolicy(costs, 3, model=True)
        proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
        auto.lookup_length.acceptance = [0.95] * 3  # lookup has been right: verifying its guesses pays
        repeat = [1, 2, 8, 9, 5, 6, 7, 3, 4, 8, 9]  # "8 9" said again: a chance match, priced on its record
        plan, draft = step(auto, proposers, repeat, 3)
        assert plan == Plan("lookup", 3) and draft.tokens == [5, 6, 7] and auto.source is auto.lookup_length
        judge(auto, plan, draft, 0)
        # no earlier match: the draft model, which cannot pay here, is not run; a plain step (timed by its record,
        # whose probe could afford to catch up on these 4 tokens with 100 left to generate)
        plan, draft = step(auto, proposers, [11, 12, 13, 14], 3, room=100)
        assert plan == PLAIN and draft == Draft([])
        assert auto.source is auto.model_length and d.n_decodes == 0
        judge(auto, plan, draft, 0)
        # where the draft model pays (a Q4_0 target on an AVX-512 machine here), it drafts
        fast = CostModel([0.082, 0.138, 0.194, 0.131], 0.012)
        auto = AutoPolicy(fast, 3, model=True)
        proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
        auto.model_length.acceptance = [0.8] * 3
        plan, draft = step(auto, proposers, [11, 12, 13, 14], 3)
        assert plan == Plan("draft", 3) and len(draft.tokens) == 3
        assert auto.source is auto.model_length and d.n_decodes > 0


# One cost model measured on an Intel Xeon (AVX-512) 2-core machine here: a 4-token batch 1.54 decodes, the draft 0.14
XEON = CostModel(verify=[0.0890, 0.1373, 0.1796, 0.1373], draft=0.0122)


def test_lookup_gives_way_to_a_better_draft_model(tiny_draft) -> None:
    """While the draft model drafts, a lookup guess must beat it after paying for the draft's catch-up."""
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    repeat = [1, 2, 8, 9, 5, 6, 7, 3, 4, 8, 9]  # "8 9" said again: a chance match, priced on its record
    with open_decoder(tiny_draft) as d:
        # acceptance by position measured there on HumanEval: lookup 62/74/79%, the draft model 76/82/85%
        model_kept, lookup_kept = [0.76, 0.82, 0.85], [0.62, 0.74, 0.79]
        # taken as free, lookup looked better (2.44 tokens a 4-token batch against 2.91 for a batch and 3 drafts),
        # and `auto` ran at 0.9x of vanilla there; charged the draft's catch-up, it does not
        assert XEON.expected_rate(3, lookup_kept, free=True) > XEON.expected_rate(3, model_kept)
        for kept, source in ((lookup_kept, "draft"), ([0.98] * 3, "lookup")):
            auto = AutoPolicy(CostModel(list(XEON.verify), XEON.draft), 3, model=True)
            proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
            auto.model_length.acceptance = list(model_kept)
            auto.lookup_length.acceptance = list(kept)
            plan, draft = step(auto, proposers, repeat, 3, room=100)  # room to win the draft's catch-up back
            record = auto.lookup_length if source == "lookup" else auto.model_length
            assert plan.source == source and auto.source is record
            assert (draft.tokens == [5, 6, 7]) == (source == "lookup")
        # where the draft model does not draft at all, lookup is truly free and is used at 60% too
        auto = AutoPolicy(CostModel(list(XEON.verify), XEON.draft), 3, model=True)
        proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
        auto.model_length.acceptance = [0.1] * 3
        auto.lookup_length.acceptance = list(lookup_kept)
        plan, draft = step(auto, proposers, repeat, 3)
        assert plan == Plan("lookup", 3) and draft.tokens == [5, 6, 7] and auto.source is auto.lookup_length


@pytest.mark.parametrize("costs,prefilled", [(XEON, True), (AVX2, False)])
def test_auto_prefills_the_draft_only_where_it_drafts_with_it(tiny_target, tiny_draft, costs, prefilled) -> None:
    """Where the draft model pays, its prompt prefill belongs before generation, as for vanilla; elsewhere the
    draft catches up at its first use, which may never come."""
    from ggufspec import GenerationSettings, SpeculativeEngine

    prompt = "Once upon a time, in a land far away, there lived"
    with SpeculativeEngine.load(tiny_target, tiny_draft, costs=CostModel(list(costs.verify), costs.draft)) as engine:
        n = len(engine.encode(prompt))
        # one token: the prompt's pass picks it, so only the prefill touches the draft
        engine.generate(prompt, GenerationSettings(max_tokens=1, method="auto", draft_max=3))
        assert len(engine.draft.history) == (n if prefilled else 0)


def test_no_drafting_at_break_even_and_probes_must_pay_for_themselves() -> None:
    lookup = AdaptiveLength(AVX2, k_max=3, free=True)
    lookup.acceptance = [0.74] * 3  # verifying 3 lookup tokens would gain 3%: not worth the risk
    gain = AVX2.expected_rate(3, 0.74, free=True) / AVX2.expected_rate(0, 0)
    assert AVX2.best_k(0.74, 3, free=True) == 3 and 1 < gain < MIN_GAIN
    assert lookup.choose() == 0
    lookup = AdaptiveLength(AVX2, k_max=3, free=True)  # at its prior, off but probing with 3 tokens
    gaps, since = [], 0
    for _ in range(200):
        k = lookup.choose()
        since += 1
        if k:
            gaps.append((since, k))
            since = 0
        lookup.update(k, 1 if k else 0)  # each probe keeps one token: 2 tokens for 2.6 decodes, a loss
    assert gaps[:3] == [(PROBE_EVERY, 3), (2 * PROBE_EVERY, 3), (4 * PROBE_EVERY, 3)]


def test_plain_steps_slowing_with_the_context_do_not_make_drafting_look_cheaper() -> None:
    costs = CostModel(list(AVX2.verify), AVX2.draft)
    for _ in range(50):  # plain steps at a long context: 30% slower than measured
        costs.observe(1, AVX2.verify[0] * 1.3, 0, 0.0)
    assert costs.verify[0] == pytest.approx(AVX2.verify[0] * 1.3, rel=1e-3)
    assert [v / costs.verify[0] for v in costs.verify] == pytest.approx([v / AVX2.verify[0] for v in AVX2.verify])
    assert costs.draft / costs.verify[0] == pytest.approx(AVX2.draft / AVX2.verify[0])
    policy = AdaptiveLength(costs, k_max=3)
    assert not any(policy.choose() for _ in range(300))  # still no probes


def test_cost_cache_is_per_machine(tiny_target, tiny_draft, tmp_path, monkeypatch) -> None:
    calls, real_machine = [], costs_module.machine

    def counted(target, draft, k_max, long_sizes=costs_module.LONG_BATCHES, **kw):
        calls.append(k_max)
        return measure(target, draft, k_max, long_sizes=long_sizes, **kw)[0], 1.0  # a quiet measurement: cached

    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_module, "measure", counted)
    with open_decoder(tiny_target) as t, open_decoder(tiny_draft) as d:
        first = costs_module.cached_measure(t, d, 2)
        again = costs_module.cached_measure(t, d, 2)
        assert len(calls) == 1 and again == first  # same files, settings and machine: read back
        monkeypatch.setattr(costs_module, "machine", lambda: "another CPU | another llama.cpp build")
        costs_module.cached_measure(t, d, 2)
        assert len(calls) == 2  # another machine's costs are never reused
    assert llama_cpp.__version__ in real_machine()  # a new llama.cpp build re-measures too


def test_costs_learned_at_a_long_context_do_not_price_a_short_one() -> None:
    """Lookup steps time themselves too, and what batches cost after 700 tokens (here 2.4 decodes for 4 tokens,
    where flash attention changes kernels) turns lookup off there, yet leaves it on after 100 tokens."""
    auto = AutoPolicy(CostModel(list(XEON.verify), XEON.draft), 3, model=False)
    proposers = begin(auto, LookupProposer(100))
    costs_at_700 = [0.125, 0.21, 0.26, 0.30]
    verified = []
    for _ in range(15):
        # at the XEON costs, 0.6 pays; at those after 700 tokens, not (this text is a copy of itself: both estimates)
        auto.lookup_length.acceptance = auto.phrase_length.acceptance = auto.copy_length.acceptance = [0.6] * 3
        plan, draft = step(auto, proposers, [5, 6, 7, 8, 9] * 140, 3)
        n = len(draft.tokens)
        assert plan.k == n and plan.source == ("lookup" if n else None)
        judge(auto, plan, draft, min(1, n), Timing(costs_at_700[n], n + 1))  # the target's batch took this long
        verified.append(n)
    assert verified[0] == 3 and verified[-5:] == [0] * 5
    auto.lookup_length.acceptance = auto.phrase_length.acceptance = auto.copy_length.acceptance = [0.6] * 3
    plan, draft = step(auto, proposers, [5, 6, 7, 8, 9] * 20, 3)
    assert plan == Plan("lookup", 3) and draft.tokens == [5, 6, 7]
    assert auto.costs.verify == XEON.verify  # the start-up measurement prices short contexts still


def test_copies_are_priced_by_their_own_record() -> None:
    """Where chance n-gram guesses have failed (lookup off at these Zen 4 costs), a guess that continues a 16-token
    copy of earlier text is still verified, on the record of copies alone."""
    auto = AutoPolicy(CostModel(list(ZEN4.verify), ZEN4.draft), 3, model=False)
    proposers = begin(auto, LookupProposer(1000))
    auto.lookup_length.acceptance = [0.3] * 3
    text = list(range(100, 140))
    chance = text + [7, 8, 9] + list(range(200, 210)) + [7, 8]  # only a 2-gram stands before the guess
    plan, draft = step(auto, proposers, chance, 3)
    assert plan == PLAIN and draft.tokens == [] and auto.source is auto.lookup_length
    copy = text + text[:20]  # the last 20 tokens repeat earlier text
    plan, draft = step(auto, proposers, copy, 3)
    assert plan == Plan("lookup", 3) and draft.tokens == text[20:23] and auto.source is auto.copy_length
    assert auto.lookup_gain(3) > 1  # Medusa's `auto` weighs the guess against its tree on the copies' record too
    judge(auto, plan, draft, 0)
    for _ in range(11):  # copies whose guesses are not kept turn it off too (before its first probe)
        judge(auto, *step(auto, proposers, copy, 3), 0)
    plan, draft = step(auto, proposers, copy, 3)
    assert plan == PLAIN and draft.tokens == []


def test_unverified_guesses_teach_their_record() -> None:
    """Guesses after a match of PHRASE_MATCH to LONG_MATCH tokens (a phrase said again, a copy's first tokens) keep
    their own record, which learns from guesses left unverified too, judged by the tokens the target commits: an
    answer that starts copying is verified after a few plain steps (not 16), a phrase that does not go on stays off."""
    auto = AutoPolicy(CostModel(list(ZEN4.verify), ZEN4.draft), 3, model=False)
    proposers = begin(auto, LookupProposer(1000))
    text = list(range(100, 140))
    plan, draft = step(auto, proposers, text + [7] + text[:3], 3)
    assert plan == PLAIN and draft.tokens == [] and auto.source is auto.lookup_length
    answer = text + [7] + text[:PHRASE_MATCH]
    plain = 0
    while (plan := step(auto, proposers, answer, 3))[0] == PLAIN:  # the target copies text, token by token
        assert auto.source is auto.phrase_length and plain < 10
        judge(auto, *plan, 0)
        answer, plain = answer + [text[len(answer) - 41]], plain + 1
    (plan, draft) = plan
    # the first guess, judged once its 3 tokens came
    assert plain == 3 and plan == Plan("lookup", 3) and draft.tokens == text[len(answer) - 41 :][:3]
    begin(auto, proposers["lookup"])  # the next generation
    for n in range(12):  # the phrase is said again, then the answer goes elsewhere, time after time
        elsewhere = text + [7] + text[:PHRASE_MATCH] + [900 + n] * 3
        for i in range(len(text) + 1 + PHRASE_MATCH, len(elsewhere) + 1):
            judge(auto, *step(auto, proposers, elsewhere[:i], 3), 0)
    assert auto.phrase_length.acceptance[0] < 0.5  # learned from guesses it never verified
    plan, draft = step(auto, proposers, text + [7] + text[:PHRASE_MATCH], 3)
    assert plan == PLAIN and draft.tokens == []


def test_a_guess_that_loses_to_a_tree_is_judged_as_one_left_unverified() -> None:
    """Medusa's `auto` withdraws a lookup guess when the sized tree is expected to commit more: the guess still
    teaches its record once the target has committed the tokens it named."""
    costs = CostModel(list(ZEN4.verify), ZEN4.draft)
    tree = build_tree([(0,), (0, 0), (0, 0, 0)])  # Medusa heads as sure of a chain as the copy is of its guess
    sizer = TreeSizer(tree, costs)
    sizer.kept[:] = 1.0  # at these costs, a 4-token batch committing 4 tokens beats the copy's 3-token guess
    auto = AutoPolicy(costs, 3, model=False, sizer=sizer)
    proposers = {"lookup": LookupProposer(1000), "medusa": SimpleNamespace(tree=tree)}  # the heads' tree: the sizer's
    auto.begin([], proposers)
    text = list(range(100, 140))
    copying = text + [7] + text[:LONG_MATCH]
    hidden = np.zeros(8, dtype=np.float32)  # the target's hidden state: the heads can propose
    # without the heads' input, the copy's guess is verified
    plan, draft = step(auto, proposers, copying, 3)
    assert plan.source == "lookup" and draft.tokens and auto.source is auto.copy_length
    before = list(auto.copy_length.acceptance)
    plan = auto.plan(Context(copying, hidden), room=4, deferred=0)
    # with it, the tree is expected to commit more: the guess is withdrawn, and the heads run
    assert plan.source == "medusa" and list(plan.nodes) == [0, 1, 2, 3] and auto.source is None
    # the tree's step: its nodes rejected, the target's own pick 999 (the target left the copy)
    nodes = np.array([copying[-1], text[LONG_MATCH], text[LONG_MATCH + 1], text[LONG_MATCH + 2]])
    tree_draft = Draft(nodes[1:].tolist(), tree.subtree(plan.nodes), source="medusa", candidates=nodes)
    auto.observe(plan, tree_draft, Verdict([999], 3, 0.1, 4, 0), Timing(0.1, 4))
    assert auto.copy_length.acceptance == before  # the tree's step teaches lookup's records nothing...
    step(auto, proposers, copying + [999], 3)  # ...but the guess would have been rejected: it is judged so
    assert auto.copy_length.acceptance[0] < before[0]


def test_each_context_size_learns_its_own_costs() -> None:
    sizes = ContextCosts(CostModel([0.1, 0.15], 0.01))
    assert sizes.at(1) is sizes.at(256) is sizes.base
    longer = sizes.at(257)
    assert longer is sizes.at(512) and longer is not sizes.base and longer.verify == sizes.base.verify
    longer.observe(2, 0.3, 0, 0.0)
    assert sizes.base.verify == [0.1, 0.15] and sizes.at(2000).verify == longer.verify  # a new size starts from below


def test_the_draft_model_is_not_started_where_its_catch_up_cannot_pay(tiny_draft) -> None:
    """The draft model catches up on the context it has not seen only where its expected gain wins that back on the
    tokens left (at most CATCH_UP_HORIZON): not after a long prompt it was not prefilled for, nor near the end of an
    answer, nor for a small gain (three slots drafting at 1.05 first caught up on 450 tokens, a 1.2 s tick)."""
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    fast = CostModel([0.082, 0.138, 0.194, 0.131], 0.012)  # where the draft model pays
    with open_decoder(tiny_draft) as d:
        auto = AutoPolicy(fast, 3, model=True)
        proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
        auto.model_length.acceptance = [0.8] * 3  # 1.45 times plain steps' rate: 25 ms saved a token
        long_prompt = list(range(10, 310))  # 300 unseen tokens at 12 ms > 128 tokens x 25 ms
        for context, room, kept in ((long_prompt, 500, 0.8), (long_prompt[:40], 10, 0.8),
                                    (long_prompt[:80], 500, 0.6)):  # 0.6: 1.07 times, 5 ms a token
            auto.model_length.acceptance = [kept] * 3
            assert auto.model_length.planned() == 3  # drafting would pay, but for the catch-up
            plan, draft = step(auto, proposers, context, 3, room=room)
            assert plan == PLAIN and draft == Draft([]) and d.n_decodes == 0
            judge(auto, plan, draft, 0)
        auto.model_length.acceptance = [0.8] * 3
        plan, draft = step(auto, proposers, long_prompt[:80], 3, room=500)  # 80 tokens: worth catching up on
        assert plan == Plan("draft", 3) and len(draft.tokens) == 3
        assert auto.source is auto.model_length and d.n_decodes > 0


def test_a_probe_catches_up_only_where_the_tokens_left_can_afford_it(tiny_draft) -> None:
    """A probe's catching up is what exploring costs: at most a tenth of the plain steps left (and less than those
    between two probes). After a long prompt, a short answer is not made to pay the drafter's catch-up for a probe
    (docs/methods.md, PROBE_CATCH_UP_SHARE: the MTP head caught up for a probe on a RAG prompt, 0.93x
    autoregressive); a long one is."""
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    fast = CostModel([0.082, 0.138, 0.194, 0.131], 0.012)  # where the draft model pays
    with open_decoder(tiny_draft) as d:
        auto = AutoPolicy(fast, 3, model=True)
        proposers = begin(auto, LookupProposer(d.n_vocab), DraftModelProposer(d, d.n_vocab, greedy, rng))
        auto.model_length.acceptance = [0.2] * 3
        assert auto.model_length.planned() == 0  # off: only probes draft
        context = list(range(10, 90))  # 80 unseen tokens at 12 ms: less than 16 plain steps (1.3 s)
        # a tenth of 64 plain steps: 0.5 s; of 128: 1.05 s; beside 3 other busy slots, a tenth of 128 batches of 4
        # tokens is 1.7 s, less than the catch-up's 1 s for each of the 4 slots that wait on it (and probe in turn)
        for room, lanes, probes in ((64, (), False), (500, (), True), (500, (1, 1, 1, 1), False)):
            ran, decodes = [], d.n_decodes
            judge(auto, PLAIN, NO_DRAFT, 0, shape=BatchShape(lanes, 0))
            for tick in range(PROBE_EVERY):
                plan, draft = step(auto, proposers, context, 3, room=room)
                ran.append(plan.source)
                judge(auto, plan, draft, 0, shape=BatchShape(lanes, tick + 1))
            assert ("draft" in ran) == probes and (d.n_decodes > decodes) == probes, (room, lanes, ran)
            d.reset()


def test_greedy_draft_trees_follow_the_draft_while_it_is_confident(tiny_draft) -> None:
    """The chain goes on while the draft gives it >= reach_min; the nodes left go to its likeliest runner-ups."""
    greedy, context = SamplingParams(), [1, 17, 29, 301, 5]
    with open_decoder(tiny_draft) as d:
        def ranked(prefix: list[int]) -> tuple[list[int], np.ndarray]:
            p = softmax(d.sync(prefix)[-1, : d.n_vocab])
            return np.argsort(-p)[:3].tolist(), np.sort(p)[::-1][:3]

        chain = DraftModelProposer(d, d.n_vocab, greedy, None).propose(Context(context), 3)
        assert chain.tree is None and len(chain.tokens) == 3
        drafter = DraftModelProposer(d, d.n_vocab, greedy, None, tree_leaves=3)
        drafter.reach_min = 0.0  # always confident: the plain chain
        assert drafter.propose(Context(context), 3) == chain
        drafter.reach_min = 1.01  # never: one guess and its two runner-ups
        top, _ = ranked(context)
        n0 = d.n_decodes
        one = drafter.propose(Context(context), 3)
        assert one.tokens == top and one.tree.choices == ((0,), (1,), (2,)) and d.n_decodes - n0 <= 1
        leaves2 = DraftModelProposer(d, d.n_vocab, greedy, None, tree_leaves=2)
        leaves2.reach_min = 1.01
        leaves2 = leaves2.propose(Context(context), 3)
        assert leaves2.tokens == top[:2] and leaves2.tree.choices == ((0,), (1,))  # a leaf for the chain's end
        # sampling: the guess is drawn from q and the runner-ups from what is left of it, each with the row it was
        # drawn from (walk's recursive rejection sampling needs them)
        sampler = DraftModelProposer(d, d.n_vocab, SamplingParams(0.8), np.random.default_rng(0), tree_leaves=3)
        sampler.reach_min = 1.01
        sampled = sampler.propose(Context(context), 3)
        q0 = probabilities(d.sync(context)[-1, : d.n_vocab], SamplingParams(0.8))
        assert sampled.tree.choices == ((0,), (1,), (2,)) and len(set(sampled.tokens)) == 3
        assert np.allclose(sampled.q[0], q0) and sampled.q[1][sampled.tokens[0]] == 0
        assert np.allclose(sampled.q[1], np.where(np.arange(len(q0)) == sampled.tokens[0], 0, q0) / (1 - q0[sampled.tokens[0]]))
        # in between (a threshold that the chain's first two guesses together fall under): two chain
        # nodes, and the node left goes to the likelier of the two runner-ups
        (top0, p0), (top1, p1) = ranked(context), ranked(context + chain.tokens[:1])
        assert p0[0] * p1[0] < p0[0]
        drafter.reach_min = p0[0] * (1 + p1[0]) / 2
        got = drafter.propose(Context(context), 3)
        runner_up = (1,) if p0[1] > p0[0] * p1[1] else (0, 1)
        assert got.tree.choices == ((0,), (0, 0), runner_up)  # the chain first: kept, it needs no cache repair
        want = {(0,): top0[0], (0, 0): top1[0], (1,): top0[1], (0, 1): top1[1]}
        assert got.tokens == [want[c] for c in got.tree.choices]


def test_a_context_after_the_history_joins_it_when_read() -> None:
    """Context.after (the loop's, each step): the tokens are the history then the last token, joined at the first
    read and kept; a lookup on it proposes as on a context built whole."""
    history = [5, 6, 8, 5]
    lazy = Context.after(history, 6)
    assert lazy.tokens == [5, 6, 8, 5, 6] and lazy.hidden is None
    history.append(100)  # the next pass commits: a context read before it keeps what it read
    assert lazy.tokens == [5, 6, 8, 5, 6]
    d = LookupProposer(n_vocab=200)
    assert d.propose(Context.after([5, 6, 8, 5], 6), 2).tokens == d.propose(Context([5, 6, 8, 5, 6]), 2).tokens == [8, 5]


def test_lookup_reuses_its_array_only_for_a_context_that_continues_the_last() -> None:
    """The proposer keeps the last context as an array and extends it when the next context continues it (each step);
    through contexts that grow, are cut, edited, or mutated in place, every guess equals a fresh proposer's."""
    rng = np.random.default_rng(3)
    kept = LookupProposer(n_vocab=100)
    ctx = [int(t) for t in rng.integers(0, 5, 12)]
    for step in range(200):
        r = rng.random()
        if r < 0.6:
            ctx = ctx + [int(t) for t in rng.integers(0, 5, rng.integers(1, 5))]
        elif r < 0.7:
            ctx = ctx[: int(rng.integers(1, len(ctx) + 1))]
        elif r < 0.85:
            ctx = list(ctx)
            ctx[int(rng.integers(len(ctx)))] = int(rng.integers(0, 5))
        else:
            ctx.append(int(rng.integers(0, 5)))  # the same list, longer
        fresh = LookupProposer(n_vocab=100)
        assert kept.find(ctx, 4) == fresh.find(ctx, 4) and kept.match == fresh.match, step


def test_the_mtp_heads_record_stops_drafting_within_three_missed_guesses() -> None:
    """A head's guesses are kept 0% on one prompt and 100% on the next: where it starts a prompt at its prior and
    misses, its record turns drafting off after three judged guesses (at the other records' memory, after eight)."""
    costs = CostModel(verify=[0.040, 0.044, 0.050, 0.056, 0.062], draft=0.010, mtp=0.010, mtp_catch_up=0.001)
    policy = AutoPolicy(costs, 4, model=False, mtp=True)
    head, other = policy.mtp_length, AdaptiveLength(head_prices := policy.mtp_length.costs, 4)
    assert head.costs is head_prices and head.planned() > 0 and other.planned() > 0  # the prior pays
    for _ in range(3):
        k = head.planned()
        head.learn(k, 0)
        other.learn(other.planned(), 0)
    assert head.planned() == 0
    assert other.planned() > 0  # the default memory: still drafting at a loss
