"""Speculation on hybrid and recurrent models (tiny random lfm2, qwen35 and mamba2 models written with gguf-py): their
recurrent state goes back by llama.cpp's snapshots or by checkpoints, and the text stays the target's own."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from conftest import open_decoder
from ggufspec.decoder import SLOT_CHUNK, DecoderOptions, LlamaCppDecoder
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.llama_batch import Batch
from ggufspec.lockstep import Lockstep
from ggufspec.pool import EnginePool
from ggufspec.recurrent import MemoryKind
from test_server import Server, openai_client

PROMPTS = ["def fibonacci(n):\n", "7 8 9 7 8 9 7 8 9 7"]  # the second repeats itself: lookup guesses there
# A batch and single tokens run different kernels: a gated delta net's chunked and step-by-step forms differed by up to
# 5e-3 in the logits on these tiny models (short convolutions: 2e-5), while a state left wrong by a rollback was off
# by 3 to 40. So logits within 0.05 of a fresh context's are the same state, and argmaxes flip only at such near-ties.
SAME_STATE = 0.05
NEAR_TIE = 0.05


def assert_greedy_equal(target_path, prompt: str, want: list[int], got: list[int]) -> None:
    """got is the target's greedy text, but where its top two logits nearly tie (then both are the target's)."""
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    with open_decoder(target_path) as d:
        top2 = np.sort(d.feed(d.vocab.tokenize(prompt) + want[:i])[-1])[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, f"diverges at token {i} ({want[i:i + 3]} vs {got[i:i + 3]}), top-2 gap " \
                                         f"{top2[1] - top2[0]:.4f}"


@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "mamba2"])
def test_memory_kind_and_snapshots(hybrid, arch) -> None:
    target, _ = hybrid(arch)
    with open_decoder(target, n_rs_seq=4) as d:
        assert d.memory is (MemoryKind.RECURRENT if arch == "mamba2" else MemoryKind.HYBRID)
        # llama.cpp keeps snapshots for lfm2 and qwen35; for mamba2 it sets n_rs_seq back to 0 (checkpoints only)
        assert d.n_rs_seq == (0 if arch == "mamba2" else 4)
    with open_decoder(target, n_seq_max=8) as d:  # sequences for token trees: none on recurrent memory
        assert d.options.n_seq_max == 1


def test_micro_batches_on_cpu(hybrid, tiny_target) -> None:
    """On CPU an attention model's prefill runs in 64-token micro-batches, a hybrid one's in llama.cpp's 512 (what its
    recurrent layers gain from, docs/methods.md), a pool's as long as its shared batch; --n-ubatch sets either."""
    target, _ = hybrid("qwen35")
    for path, n_ubatch, want in ((tiny_target, None, 64), (target, None, 512), (target, 32, 32)):
        with open_decoder(path, n_ubatch=n_ubatch) as d:
            assert d.n_ubatch == want, (path.name, n_ubatch)
    slots = LlamaCppDecoder.slots(target, DecoderOptions(n_ctx=1024), 2, Lockstep())
    assert [slot.n_ubatch for slot in slots] == [2 * SLOT_CHUNK] * 2
    for slot in slots:
        slot.close()


def _fresh_logits(path, tokens: list[int]) -> np.ndarray:
    with open_decoder(path) as f:
        return f.feed(tokens)


@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "mamba2"])
def test_rollbacks_leave_the_state_a_fresh_context_has(hybrid, arch) -> None:
    """Chains rolled back by snapshot, single-token runs and chains past n_rs_seq from checkpoints, rollbacks below
    every checkpoint by decoding again: after each, the next tokens' logits are a fresh context's."""
    target, _ = hybrid(arch)
    rng = np.random.default_rng(0)
    with open_decoder(target, n_rs_seq=3) as d:
        d.sync(list(map(int, rng.integers(100, 40000, 20))))
        d.hold(anchor=True)
        worst = 0.0
        for step in range(12):
            k = int(rng.integers(1, 7))  # past n_rs_seq from 4 on: a checkpoint
            d.hold(k)
            d.feed(list(map(int, rng.integers(100, 40000, k + 1))))
            d.rollback_to(len(d.history) - k + int(rng.integers(0, k + 1)))
            d.hold()  # a draft model's single-token guesses
            for t in rng.integers(100, 40000, int(rng.integers(1, 4))):
                d.feed([int(t)])
            d.rollback_to(len(d.history) - int(rng.integers(0, 3)))
            if step % 4 == 3:  # below both checkpoints: decoded again from the start
                d.rollback_to(5)
            nxt = list(map(int, rng.integers(100, 40000, 2)))
            worst = max(worst, float(np.abs(d.feed(nxt) - _fresh_logits(target, d.history)[-2:]).max()))
        counts = d.rollbacks
    assert worst < SAME_STATE, f"logits after rollbacks are {worst:.4f} off a fresh context's"
    assert counts.restores > 10 and counts.replays >= 3 and counts.saves > 10
    assert (counts.snapshots > 5) == (arch != "mamba2"), counts


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_a_rollback_past_the_last_decode_is_wrong_in_llama_cpp_and_right_here(hybrid, arch) -> None:
    """What the rules guard against: llama.cpp's seq_rm reports success undoing a single-token decode within n_rs_seq,
    and leaves a wrong state; the decoder takes a checkpoint or decodes again instead."""
    target, _ = hybrid(arch)
    prompt, guesses, nxt = list(range(100, 120)), [500, 501], [600, 601]
    want = _fresh_logits(target, prompt + nxt)[-2:]
    with open_decoder(target, n_rs_seq=4) as d:
        d.feed(prompt)
        for t in guesses:
            d.feed([t])
        assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(d.llama_context), 0, len(prompt), -1)
        wrong = np.abs(_feed_raw(d, nxt, len(prompt)) - want).max()
    with open_decoder(target, n_rs_seq=4) as d:
        d.feed(prompt)
        for t in guesses:
            d.feed([t])
        d.rollback_to(len(prompt))  # no checkpoint held: decoded again
        right = np.abs(d.feed(nxt) - want).max()
    assert wrong > 1.0 > SAME_STATE > right, (wrong, right)


def _feed_raw(d: LlamaCppDecoder, tokens: list[int], pos: int) -> np.ndarray:
    """Decode `tokens` at `pos` with llama.cpp's API alone (the decoder's history no longer says what its cache holds)."""
    batch = Batch(len(tokens))
    batch.fill(tokens, pos, True)
    assert llama_cpp.llama_decode(d.llama_context, batch.struct) == 0
    batch.close()
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits(d.llama_context), shape=(len(tokens), d.n_vocab)).copy()


def _greedy_runs(engine: SpeculativeEngine, target, methods: dict[str, list[int]], max_tokens: int = 24) -> int:
    """Every method at every draft length gives the target's greedy text on PROMPTS; the tokens drafted."""
    drafted = 0
    for prompt in PROMPTS:
        ref = engine.generate(prompt, GenerationSettings(max_tokens=max_tokens, method="autoregressive"))
        for method, lengths in methods.items():
            for k in lengths:
                got = engine.generate(prompt, GenerationSettings(max_tokens=max_tokens, method=method, draft_max=k))
                assert_greedy_equal(target, prompt, ref.tokens, got.tokens)
                drafted += got.stats.drafted
    return drafted


EVERY_LENGTH = {method: list(range(1, 9)) for method in ("vanilla", "lookup", "auto")}


@pytest.mark.parametrize("pair", ["lfm2", "qwen35", "mamba2", "llama+lfm2", "lfm2+qwen35"])
def test_greedy_text_is_the_targets_alone(hybrid, tiny_target, pair) -> None:
    """Hybrid and recurrent targets and drafts (a llama target with an lfm2 draft; lfm2 with a qwen35 draft)."""
    if "+" in pair:
        t, d = pair.split("+")
        target = tiny_target if t == "llama" else hybrid(t)[0]
        draft = hybrid(d)[1]
    else:
        target, draft = hybrid(pair)
    with SpeculativeEngine.load(target, draft, DecoderOptions(n_ctx=1024)) as engine:
        drafted = _greedy_runs(engine, target, EVERY_LENGTH)
        rollbacks = [d.rollbacks for d in (engine.target, engine.draft) if d.rollbacks is not None]
    assert drafted > 100
    assert rollbacks and all(r.restores + r.snapshots > 10 for r in rollbacks), rollbacks


def test_chains_longer_than_the_snapshots_go_back_from_checkpoints(hybrid) -> None:
    """A target with 2 snapshots verifying chains of 8 drafts (forced: an engine sets n_rs_seq to --draft-max)."""
    target, draft = hybrid("qwen35")
    opts = DecoderOptions(n_ctx=1024, n_rs_seq=2)
    with SpeculativeEngine(LlamaCppDecoder(target, opts), LlamaCppDecoder(draft, opts)) as engine:
        drafted = _greedy_runs(engine, target, {"vanilla": [8]})
        counts = engine.target.rollbacks
    assert drafted > 30 and counts.restores > 5 and counts.snapshots > 0, counts


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_greedy_text_is_the_targets_with_two_slots(hybrid, arch) -> None:
    target, draft = hybrid(arch)
    prompts = [*PROMPTS, "Once upon a time", "import numpy as np\n"]
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512)) as engine:
        refs = [engine.generate(p, GenerationSettings(max_tokens=24, method="autoregressive")).tokens for p in prompts]
    drafted = 0
    loaded = GenerationSettings(method="vanilla", draft_max=4)  # its chains are undone by snapshots
    with EnginePool.load(target, draft, DecoderOptions(n_ctx=1024), loaded, parallel=2) as pool:
        assert pool.slots[0].engine.target.n_rs_seq == 4
        for method, lengths in EVERY_LENGTH.items():
            for k in lengths:
                s = GenerationSettings(max_tokens=24, method=method, draft_max=k)
                for i, r in pool.stream_many(prompts, s):
                    assert not isinstance(r, Exception), r
                    if r.finish_reason is not None:
                        assert_greedy_equal(target, prompts[i], refs[i], r.result.tokens)
                        drafted += r.result.stats.drafted
    assert drafted > 50


def test_snapshots_only_where_chains_are_expected(hybrid) -> None:
    """Every batch writes a context's snapshots: plain decoding and `auto` in a pool of slots go without them (their
    chains go back from checkpoints), a single stream's `auto` and the drafting methods keep them."""
    target, draft = hybrid("qwen35")
    options = DecoderOptions(n_ctx=512)
    for method, n_rs_seq in (("autoregressive", 0), ("auto", 3), ("vanilla", 3)):
        with SpeculativeEngine.load(target, draft, options, GenerationSettings(method=method, draft_max=3)) as engine:
            assert engine.target.n_rs_seq == n_rs_seq, method
    refs = {}
    with SpeculativeEngine.load(target, None, options) as engine:
        for p in PROMPTS:
            refs[p] = engine.generate(p, GenerationSettings(max_tokens=24, method="autoregressive")).tokens
    for method, n_rs_seq in (("autoregressive", 0), ("auto", 0), ("vanilla", 3)):
        loaded = GenerationSettings(method=method, draft_max=3)
        with EnginePool.load(target, draft, DecoderOptions(n_ctx=1024), loaded, parallel=2) as pool:
            assert pool.slots[0].engine.target.n_rs_seq == n_rs_seq, method
            if method != "auto":
                continue
            restores = pool.slots[0].engine.target.rollbacks.restores
            for i, r in pool.stream_many(PROMPTS, GenerationSettings(max_tokens=24, method="vanilla", draft_max=3)):
                assert not isinstance(r, Exception), r
                if r.finish_reason is not None:
                    assert_greedy_equal(target, PROMPTS[i], refs[PROMPTS[i]], r.result.tokens)
            assert sum(s.engine.target.rollbacks.restores for s in pool.slots) > restores  # from checkpoints


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_a_chat_reuses_its_prefix_and_answers_as_a_fresh_run(hybrid, arch) -> None:
    """Each turn's prompt holds the earlier turns: the cache keeps them (back to the last prompt's checkpoint where
    the answer's tail differs), and the answer is the one a fresh context gives."""
    target, draft = hybrid(arch)
    s = GenerationSettings(max_tokens=12, method="vanilla", draft_max=3)
    messages: list[dict] = []
    with SpeculativeEngine.load(target, draft) as chat, SpeculativeEngine.load(target, draft) as fresh:
        for turn in ("Hello there.", "Tell me more.", "And then?"):
            messages.append({"role": "user", "content": turn})
            got = chat.generate(messages, s)
            fresh.reset()
            want = fresh.generate(messages, s)
            assert got.tokens == want.tokens
            if len(messages) > 1:
                assert got.stats.cached_tokens > got.stats.prompt_tokens // 2, got.stats
            messages.append({"role": "assistant", "content": got.text})


def test_the_server_reuses_a_conversations_prefix_on_a_hybrid_model(hybrid) -> None:
    target, draft = hybrid("lfm2")
    first = [{"role": "user", "content": "Hello there."}]
    server = Server("-m", str(target), "-d", str(draft), "-c", "1024")
    try:
        client = openai_client(server)
        a = client.chat.completions.create(model="m", messages=first, max_tokens=12, temperature=0)
        second = [*first, {"role": "assistant", "content": a.choices[0].message.content},
                  {"role": "user", "content": "Tell me more."}]
        b = client.chat.completions.create(model="m", messages=second, max_tokens=12, temperature=0)
    finally:
        assert "Traceback" not in server.stop()
    with SpeculativeEngine.load(target, None) as fresh:
        want = fresh.generate(second, GenerationSettings(max_tokens=12, method="autoregressive"))
    assert b.choices[0].message.content == want.text
    assert b.usage.prompt_tokens_details.cached_tokens > b.usage.prompt_tokens // 2
