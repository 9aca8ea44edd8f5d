"""Many generations at once (EnginePool): each request's text is the text it gets alone, whatever joins, leaves or
shares its batches."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from conftest import FixedCosts
import ggufspec.costs.cache as costs_module  # where cached_measure looks up measure()
from ggufspec.costs import costs_path, measure, measure_together
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.errors import GGUFSpecError
from ggufspec.lockstep import Lockstep
from ggufspec.pool import EnginePool
from ggufspec.proposers.lookup import LONG_MATCH, AnswerPool, LookupProposer
from ggufspec.sampling import SamplingParams
from test_equivalence import NEAR_TIE, PROMPTS, assert_same_or_near_tie

COSTS = FixedCosts(verify=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5], draft=0.05)  # drafting pays: every method drafts
METHODS = ["autoregressive", "vanilla", "lookup", "auto"]
# A slot's rows are computed as alone whatever else shares the batch, on quantized weights: SmolLM2 exactly. The
# f32 tiny models' matrix products take other kernels for batches of other sizes (as verification batches do)
SHARED_GAP = NEAR_TIE["f32"]
EXACT = 0.0


def _jobs(n: int) -> list[tuple[str, GenerationSettings]]:
    """n requests of mixed prompts, methods and lengths."""
    return [(PROMPTS[i % len(PROMPTS)], GenerationSettings(max_tokens=8 + 7 * (i % 4), method=METHODS[i % len(METHODS)],
                                                           draft_max=2 + i % 3)) for i in range(n)]


def _alone(target, draft, jobs) -> list[list[int]]:
    """Each job on an engine of its own."""
    with SpeculativeEngine.load(target, draft, DecoderOptions(n_ctx=512), costs=COSTS) as engine:
        return [engine.generate(p, s).tokens for p, s in jobs]


def _together(pool: EnginePool, jobs, cancel: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Each job in a thread of its own, all at once; job i stops after cancel[i] tokens (a client leaving)."""
    out: dict[int, list[int]] = {}
    cancel = cancel or {}

    def run(i: int) -> None:
        prompt, s = jobs[i]
        tokens = pool.engine.encode(prompt)
        got: list[int] = []
        with pool.slot(tokens) as slot:
            for r in pool.run(slot, tokens, s, cancelled=lambda: len(got) >= cancel.get(i, 1 << 30)):
                if r.token is not None:
                    got.append(r.token)
        out[i] = got

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a generation hung"
    return out


@pytest.mark.parametrize("parallel", [1, 2, 3, 8])
def test_greedy_requests_together_equal_each_alone(tiny_target, tiny_draft, parallel) -> None:
    jobs = _jobs(10)  # more than the slots: later requests join as slots free
    want = _alone(tiny_target, tiny_draft, jobs)
    with EnginePool.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=512 * parallel), costs=COSTS,
                         parallel=parallel) as pool:
        got = _together(pool, jobs)
        assert pool.lockstep.n_ticks > 0
    for i, (prompt, _) in enumerate(jobs):
        assert_same_or_near_tie(tiny_target, prompt, want[i], got[i], SHARED_GAP)


def test_cancelled_requests_free_their_slots_and_leave_the_others_unchanged(tiny_target, tiny_draft) -> None:
    jobs = _jobs(8)
    want = _alone(tiny_target, tiny_draft, jobs)
    cancel = {1: 2, 4: 0, 6: 5}
    with EnginePool.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=2048), costs=COSTS, parallel=4) as pool:
        got = _together(pool, jobs, cancel)
        assert not any(s.busy for s in pool.slots)
    for i, (prompt, _) in enumerate(jobs):
        if i in cancel:
            assert got[i] == want[i][: len(got[i])] and len(got[i]) <= cancel[i] + 4  # the step in flight ends it
        else:
            assert_same_or_near_tie(tiny_target, prompt, want[i], got[i], SHARED_GAP)


def test_seeded_sampling_together_equals_alone(smollm2_path, smollm2_q4_0) -> None:
    """Each request keeps its own generator: its draws are its own, whatever shares its batches. On SmolLM2 (and its
    Q4_0 draft) a slot's rows are its rows alone bit for bit, so every text is its text alone exactly: on the f32
    tiny pair a draw that fell within 1e-4 of a token's edge of the CDF flipped (other kernels for other batches)."""
    sampling = SamplingParams(temperature=0.9)
    # auto is left out: what it drafts depends on what shares its batches (priced per batch), and a sampled run's
    # draws follow what it drafts (exact in distribution, not draw for draw)
    jobs = [(PROMPTS[i], GenerationSettings(max_tokens=16, method=METHODS[i % 3], sampling=sampling, seed=100 + i))
            for i in range(6)]
    want = _alone(smollm2_path, smollm2_q4_0, jobs)
    with EnginePool.load(smollm2_path, smollm2_q4_0, DecoderOptions(n_ctx=1536), costs=COSTS, parallel=3) as pool:
        got = _together(pool, jobs)
    same = sum(got[i] == want[i] for i in range(len(jobs)))
    assert same == len(jobs), f"{len(jobs) - same} of {len(jobs)} seeded requests differ from their runs alone"


def test_smollm2_requests_together_equal_each_alone(smollm2_path) -> None:
    jobs = [(p, GenerationSettings(max_tokens=24, method=m)) for p in PROMPTS[:4] for m in ("autoregressive", "lookup")]
    want = _alone(smollm2_path, None, jobs)
    with EnginePool.load(smollm2_path, None, DecoderOptions(n_ctx=2048), costs=COSTS, parallel=4) as pool:
        got = _together(pool, jobs)
    for i, (prompt, _) in enumerate(jobs):
        assert_same_or_near_tie(smollm2_path, prompt, want[i], got[i], EXACT)


def test_a_long_prompt_joining_does_not_stall_the_others(tiny_target) -> None:
    """Its prompt is decoded in chunks, each in one batch with the others' steps: they keep producing tokens."""
    long_prompt = " ".join(f"word{i}" for i in range(150))  # about 650 tokens
    with EnginePool.load(tiny_target, None, DecoderOptions(n_ctx=4096), costs=COSTS, parallel=2) as pool:
        times: dict[str, list[float]] = {"short": [], "long": []}
        started = threading.Event()

        def run(name: str, prompt: str, n: int) -> None:
            tokens = pool.engine.encode(prompt)
            with pool.slot(tokens) as slot:
                if name == "long":
                    times["long"].append(time.perf_counter())  # joined: its prefill starts
                for r in pool.run(slot, tokens, GenerationSettings(max_tokens=n, method="autoregressive")):
                    if r.token is not None:
                        times[name].append(time.perf_counter())
                        if name == "short" and len(times["short"]) == 3:
                            started.set()

        short = threading.Thread(target=run, args=("short", PROMPTS[0], 200))
        short.start()
        started.wait(30)
        long = threading.Thread(target=run, args=("long", long_prompt, 2))
        long.start()
        long.join(60)
        short.join(60)
        n_chunks = -(-len(pool.engine.encode(long_prompt)) // 128)
    with pytest.raises(GGUFSpecError, match="closed"):
        pool.engine.encode(long_prompt)
    joined, first = times["long"][0], times["long"][1]
    during = [t for t in times["short"] if joined < t < first]
    assert len(during) >= n_chunks - 1, f"the short request got {len(during)} tokens during a {n_chunks}-chunk prefill"


def test_each_slot_sees_its_shared_batch_per_sequence(tiny_target) -> None:
    """The lanes a slot's decode reports are the real batch's: every member's tokens under its sequence id."""
    lockstep = Lockstep()
    a, b, c = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=768), 3, lockstep)
    for d, first in ((a, 10), (c, 40)):
        d.sync(list(range(first, first + 8)))
    ready = threading.Barrier(2)

    def step(d: LlamaCppDecoder, tokens: list[int]) -> None:
        with lockstep.member():
            ready.wait()  # both members before either submits: one tick runs both
            d.feed(tokens)

    threads = [threading.Thread(target=step, args=(a, [1])), threading.Thread(target=step, args=(c, [2, 3, 4]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert a.last_batch.lanes == c.last_batch.lanes == (1, 0, 3)
    assert a.last_batch.tick == c.last_batch.tick == 2 and b.last_batch.tick == -1  # the third batch (after a's and c's syncs): the cost model learns
    assert (a.lane, b.lane, c.lane) == (0, 1, 2)   # it once, whichever slot reports it first (CostModel.observe)
    assert a.n_batched_tokens - 8 == 4  # after its 8-token sync alone
    for d in (a, b, c):
        d.close()


def test_a_lone_slots_tree_is_a_batch_of_its_own(tiny_target) -> None:
    """A pool of one slot (`serve --parallel 1`) verifies draft trees, whose tokens sit in its leaves' sequences
    after the slot's own: the batch it reports is its own, not one shared with a slot beside it."""
    lockstep = Lockstep()
    [slot] = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=512, n_seq_max=4), 1, lockstep)
    slot.sync(list(range(10, 18)))
    with lockstep.member():
        slot.tree_logits([5, 6, 7, 8], [-1, 0, 0, 1])  # a root, two children, a grandchild: 2 leaves
    assert (slot.last_batch.lanes, slot.lane) == ((4,), 0)
    deferred = slot.commit_tree_path([0, 2])  # a runner-up kept: its token rides in front of the next batch
    with lockstep.member():
        slot.feed([9])
    assert (deferred, slot.last_batch.lanes) == (1, (2,))
    slot.close()


def test_a_generation_begins_priced_beside_the_slots_generating_then(tiny_target, tiny_draft) -> None:
    """`auto` decides whether the draft model prefills the prompt before the prefill: beside another slot generating
    it counts that slot (test_adaptive: beside busy slots on a CPU the draft's prefill is not worth it)."""
    settings = GenerationSettings(max_tokens=6, method="auto")
    with EnginePool.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=1024), costs=COSTS, parallel=2) as pool:
        first, go = threading.Event(), threading.Event()
        a, b = pool.slots
        assert a.engine.target.peers == b.engine.target.peers == 0

        def run_a() -> None:  # a stream makes its next token only once asked for it (pool.run's runs ahead)
            for _ in a.engine.stream(pool.engine.encode(PROMPTS[0]), settings):
                first.set()
                go.wait(60)  # a stays mid-generation while b begins

        def run_b() -> None:
            list(pool.run(b, pool.engine.encode(PROMPTS[1]), settings))

        ta = threading.Thread(target=run_a)
        ta.start()
        assert first.wait(60)
        assert b.engine.target.peers == 1 and a.engine.target.peers == 1  # from this thread, which takes no part
        tb = threading.Thread(target=run_b)
        tb.start()
        began = time.monotonic() + 60  # b's policy is set up before its prefill, which waits for a's next step
        while (b_auto := b.engine.auto_policies.get((True, False))) is None or b_auto.peers != 1:
            assert time.monotonic() < began, "b did not begin beside a"
            time.sleep(0.01)
        go.set()
        for t in (ta, tb):
            t.join(60)
        assert not ta.is_alive() and not tb.is_alive()
        # requests that arrive together: each counts the slots the others hold, before they take part
        with pool.slot():
            assert a.engine.target.peers == 0
            with pool.slot():
                assert a.engine.target.peers == b.engine.target.peers == 1
        assert a.engine.target.peers == 0
        assert a.engine.auto_policies[True, False].peers == 0  # began alone
        assert b.engine.auto_policies[True, False].peers == 1
        assert a.engine.target.peers == 0


def test_a_prompt_goes_to_the_free_slot_that_holds_its_start(tiny_target) -> None:
    """llama-server's slot similarity: a conversation's next turn goes to the slot whose cache holds its start (at
    least half of it), and decodes only what is new there; else to the lowest-numbered free slot."""
    s = GenerationSettings(max_tokens=4)
    with EnginePool.load(tiny_target, None, DecoderOptions(n_ctx=1024), costs=COSTS, parallel=2) as pool:
        a, b = (pool.engine.encode(PROMPTS[i]) for i in (0, 1))
        with pool.slot(a) as first, pool.slot(b) as second:  # both held: b goes to the second slot
            list(pool.run(first, a, s))
            list(pool.run(second, b, s))
        turn = [*b, *second.engine.target.history[len(b):], *pool.engine.encode(" And then?")]
        with pool.slot(turn) as slot:
            assert slot is second
            result = [r for r in pool.run(slot, turn, s) if r.finish_reason is not None][0].result
        assert result.stats.cached_tokens >= len(b)
        with pool.slot(pool.engine.encode(PROMPTS[2])) as slot:  # a start no slot holds: the lowest-numbered
            assert slot is first


def test_slots_verify_together_after_drafting(tiny_target, tiny_draft) -> None:
    """Drafts first: a slot's target decode waits while another slot drafts, so both verify in one target batch."""
    lockstep = Lockstep()
    ta, tb = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=512), 2, lockstep)
    da, db = LlamaCppDecoder.slots(tiny_draft, DecoderOptions(n_ctx=512), 2, lockstep, leads=True)
    for d in (ta, tb, da):
        d.sync(list(range(10, 18)))

    def drafting() -> None:
        da.feed([1])  # a draft token: this tick runs the draft context alone
        da.feed([2])
        ta.feed([1, 2, 3])  # the chain, verified

    def plain() -> None:
        tb.feed([4])  # held until the other slot's chain comes

    _side_by_side(lockstep, drafting, plain)
    assert ta.last_batch.lanes == tb.last_batch.lanes == (3, 1)
    assert da.last_batch.lanes == (1,)
    assert ta.last_batch.tick == tb.last_batch.tick > da.last_batch.tick  # one target batch, after the drafts
    for d in (ta, tb, da, db):
        d.close()


def _pads_beside_a_chain(tiny_target, price) -> tuple[tuple[int, ...], int, np.ndarray]:
    """Slot a verifies a 3-token chain while slot b decodes one token, then b decodes one more alone: the batch's
    lanes, b's last cached position, and b's last logits."""
    lockstep = Lockstep()
    ta, tb = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=512), 2, lockstep)
    ta.pad_chains(price, 3)
    for d in (ta, tb):
        d.sync(list(range(10, 18)))
    out = {}

    def plain() -> None:
        tb.feed([4])
        out["lanes"] = tb.last_batch.lanes
        out["logits"] = tb.feed([5])

    _side_by_side(lockstep, lambda: ta.feed([1, 2, 3]), plain)
    last = tb.kv_positions()[1]
    for d in (ta, tb):
        d.close()
    return out["lanes"], last, out["logits"]


def _side_by_side(lockstep: Lockstep, *bodies: Callable[[], object]) -> None:
    """Each body in a thread of its own, all members of `lockstep` from the start (so their first decodes meet)."""
    ready = threading.Barrier(len(bodies))

    def member(body: Callable[[], object]) -> None:
        with lockstep.member():
            ready.wait()
            body()

    threads = [threading.Thread(target=member, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def test_a_shorter_chain_is_padded_into_one_micro_batch_and_its_pads_leave_no_trace(tiny_target) -> None:
    """Where a pass costs the same whatever its size, slot b's one token is padded to a's 3 (one micro-batch, not
    two); the pads' cells are removed, so b's next token sits where it would and gets the same logits (to 1e-4: a
    pass of another size may take other kernels)."""
    padded = _pads_beside_a_chain(tiny_target, lambda seqs, each: 1.0)
    plain = _pads_beside_a_chain(tiny_target, None)
    assert padded[0] == (3, 3) and plain[0] == (3, 1)
    assert padded[1] == plain[1] == 9  # 8 tokens, 4, 5: no pad left behind
    np.testing.assert_allclose(padded[2], plain[2], rtol=0, atol=1e-4)


def _steps_beside_an_idle_slot(tiny_target, price) -> tuple[tuple[int, ...], tuple[int, int], np.ndarray, np.ndarray]:
    """Slots a and c decode a token each while slot b, between them, holds a cached prompt and decodes nothing; then
    b decodes a token: the batch's lanes, b's cached positions after it, c's logits and b's next logits."""
    lockstep = Lockstep()
    ta, tb, tc = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=768), 3, lockstep)
    ta.pad_chains(price, 3)
    for d in (ta, tb, tc):
        d.sync(list(range(10, 18)))
    out = {}

    def c() -> None:
        out["logits"] = tc.feed([4])
        out["lanes"] = tc.last_batch.lanes

    _side_by_side(lockstep, lambda: ta.feed([4]), c)
    kept = tb.kv_positions()
    after = tb.feed([4])
    for d in (ta, tb, tc):
        d.close()
    return out["lanes"], kept, out["logits"], after


def test_an_idle_slot_between_busy_ones_is_padded_into_their_pass_and_keeps_its_cache(tiny_target) -> None:
    """Where a pass costs the same whatever its size, slots 0 and 2's tokens run in one micro-batch with a pad in
    idle slot 1 (llama.cpp would split them into two: a gap breaks the run of consecutive sequences); the pad's cell
    is removed, so slot 1's cache holds its prompt only and its next token gets the same logits (to 1e-4)."""
    padded = _steps_beside_an_idle_slot(tiny_target, lambda seqs, each: 1.0)
    plain = _steps_beside_an_idle_slot(tiny_target, None)
    assert padded[0] == (1, 1, 1) and plain[0] == (1, 0, 1)
    assert padded[1] == plain[1] == (0, 7)
    np.testing.assert_allclose(padded[2], plain[2], rtol=0, atol=1e-4)
    np.testing.assert_allclose(padded[3], plain[3], rtol=0, atol=1e-4)


def test_a_pool_times_its_slots_batches_as_they_run_together(tiny_target, tiny_draft, tmp_path, monkeypatch) -> None:
    """measure() times one sequence's tokens; a pool's steps run one token (or chain) in each slot's sequence, which
    llama.cpp computes with other kernels: those batches are timed as one tick of every slot's, and leave no trace."""
    lockstep = Lockstep()
    views = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=768), 3, lockstep)
    before = views[0].n_decodes
    seconds = measure_together(lockstep, views, (1, 2), repeats=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert views[0].n_decodes - before == 1 + 2 * 2  # its context, then each width twice
    assert views[0].last_batch.lanes == (2, 2, 2)  # the last one: every slot's 2 tokens in one batch
    assert [v.kv_positions() for v in views] == [(-1, -1)] * 3
    for v in views:
        v.close()
    small = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=3 * 16), 3, lockstep)  # 16 tokens a slot
    with pytest.raises(Exception, match="do not fit"):  # the views' error, not a hang at the barrier
        measure_together(lockstep, small, (1,))
    for v in small:
        v.close()
    monkeypatch.setenv("GGUFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs_module, "measure", lambda *a, **kw: (measure(*a, **kw)[0], 1.0))  # cached however noisy
    with EnginePool.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=8 * 256), parallel=8) as pool:
        costs = pool.engine.costs
        assert {8, 16} <= set(costs.long_sizes) and costs.draft_sizes == [8] and len(costs.draft_batches) == 1
        assert all(s.engine.costs is costs for s in pool.slots)
        assert costs.slots == 8 and len(costs.slot_verify) == 3 and all(s > 0 for s in costs.slot_verify)
    [cached] = json.loads(costs_path().read_text()).values()  # one sequence's, as measure() times them
    assert cached["slots"] == 0 and cached["slot_verify"] == [] and cached["long_verify"] == costs.long_verify
    assert cached["draft_sizes"] == cached["draft_batches"] == []  # 8 slots' draft tokens: timed at each load


def test_slots_refuse_what_a_shared_context_cannot_do(tiny_target) -> None:
    lockstep = Lockstep()
    with pytest.raises(ValueError, match="n_seq_max must be 1"):
        LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=512, n_seq_max=2), 2, lockstep)
    a, b = LlamaCppDecoder.slots(tiny_target, DecoderOptions(n_ctx=512), 2, lockstep)
    assert (a.n_ctx, b.n_ctx) == (256, 256)
    with pytest.raises(GGUFSpecError, match="context of its own"):
        a.decode_sequences([1], [0], [0])
    a.sync(list(range(10, 30)))
    b.sync(list(range(40, 50)))
    assert a.kv_positions() == (0, 19) and b.kv_positions() == (0, 9)
    a.reset()  # one slot's reset leaves the other's cache
    assert a.kv_positions() == (-1, -1) and b.kv_positions() == (0, 9)
    with pytest.raises(Exception, match="do not fit"):
        a.feed(list(range(300)))
    with pytest.raises(GGUFSpecError, match="between 1 and 256"):
        EnginePool.load(tiny_target, None, DecoderOptions(n_ctx=512), parallel=300)


def test_answer_pool_is_bounded_and_keeps_answers_apart() -> None:
    pool = AnswerPool(max_tokens=10)
    pool.add([1, 2, 3, 4])
    pool.add([5])  # too short to continue anything
    pool.add([1, 2, 9, 9, 9])
    assert pool.tokens.tolist() == [1, 2, 3, 4, -1, 1, 2, 9, 9, 9]  # the oldest tokens went
    pool.add([7, 7, 7, 7])
    assert pool.tokens.tolist() == [1, 2, 9, 9, 9, -1, 7, 7, 7, 7]
    lookup = LookupProposer(100, answers=pool)
    assert lookup.find([50, 51, 2, 9], 5) == [9, 9]  # the answer's continuation, cut at its end
    assert lookup.find([8, 3, 4], 3) == []  # no earlier answer holds 3, 4 any more
    pool.add([3, 4, 42, 43])
    assert lookup.find([8, 3, 4], 3) == [42, 43]  # up to the answer's end, never into the next
    assert lookup.find([3, 4, 5, 3, 4], 2) == [5, 3]  # the text's own match comes first


def _longest_match_in(source: list[int], context: list[int], ngram_min: int, ngram_max: int) -> int | None:
    """Lookup by its definition, one place at a time: where the place in `source` that matches the context's tail
    furthest back (up to LONG_MATCH) ends, the latest among equals, if that reaches ngram_min; else None."""
    best, reach = None, 0
    for end in range(len(source) - 1):  # a guess follows the place
        n = 0
        while n < min(LONG_MATCH, len(context)) and end - n >= 0 and source[end - n] == context[-1 - n]:
            n += 1
        if n and n >= reach:
            best, reach = end, n
    return best if best is not None and min(reach, ngram_max) >= ngram_min else None


@pytest.mark.parametrize("ngram_min,ngram_max", [(2, 4), (1, 3), (3, 3)])
def test_lookup_finds_the_longest_latest_match(ngram_min: int, ngram_max: int) -> None:
    """What lookup's search finds, in the text (its index of token pairs, kept as the text grows) and in earlier answers
    (the pool's), is what a scan of every place finds: on text of a few token values (many matches, of every length),
    growing or not, in a pool that drops its oldest tokens."""
    rng = np.random.default_rng(ngram_min * 10 + ngram_max)
    answers = AnswerPool(max_tokens=200)
    for _ in range(60):
        answers.add(rng.integers(0, 4, size=int(rng.integers(2, 30))).tolist())
        lookup = LookupProposer(100, ngram_max=ngram_max, ngram_min=ngram_min, answers=answers)
        grown = rng.integers(0, 4, size=3).tolist()
        for step in range(10):
            # a generation's context (each step's is the last one's and what it committed), and one of its own
            grown = grown + rng.integers(0, 4, size=int(rng.integers(1, 4))).tolist()
            context = grown if step % 2 else rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
            k = int(rng.integers(1, 8))
            end = _longest_match_in(context, context, ngram_min, ngram_max)
            if end is not None:  # the text's own match: its continuation, repeating where it runs into the tail
                period = len(context) - end - 1
                assert lookup.find(context, k) == [context[end + 1 + i % period] for i in range(k)], (context, k)
            pool = answers.tokens.tolist()
            end = _longest_match_in(pool, context, ngram_min, ngram_max)
            guess = pool[end + 1 : end + 1 + k] if end is not None else []  # cut at the answer's end
            guess = guess[: guess.index(AnswerPool.SEPARATOR)] if AnswerPool.SEPARATOR in guess else guess
            assert lookup.find_in_answers(context, k) == guess, (context, k)


def test_auto_continues_earlier_answers_and_keeps_the_text(smollm2_path) -> None:
    costs = FixedCosts(verify=[1.0, 1.02, 1.04, 1.06, 1.08], draft=1.0)  # lookup pays at any acceptance; the model not
    s = GenerationSettings(max_tokens=40, method="auto")
    with SpeculativeEngine.load(smollm2_path, None, DecoderOptions(n_ctx=1024), costs=costs) as engine:
        first = engine.generate("Write a haiku about autumn leaves.", s)
        engine.answers = AnswerPool()  # forget it: the same request alone
        alone = engine.generate("Write a poem about autumn leaves, in three lines.", s)
        engine.reset()
        engine.answers.add(first.tokens)
        engine.answers.add(alone.tokens)
        again = engine.generate("Write a poem about autumn leaves, in three lines.", s)
    assert again.tokens == alone.tokens
    assert again.stats.accepted > alone.stats.accepted + 10, (alone.stats.accepted, again.stats.accepted)
