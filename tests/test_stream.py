"""`SpeculativeEngine.stream`: one response per committed token, then the finish; what chat and serve build on."""

from __future__ import annotations

from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.pool import EnginePool


def test_responses_add_up_to_the_result(smollm2_path) -> None:
    with SpeculativeEngine.load(smollm2_path, smollm2_path) as engine:
        # max_tokens cuts "😊🌍" mid-character on this prompt: the tail is flushed once, in the text and the result
        settings = GenerationSettings(max_tokens=12, method="vanilla", draft_max=3)
        responses = list(engine.stream([{"role": "user", "content": "Say hello in Spanish."}], settings))
    *tokens, final = responses
    result = final.result
    assert final.token is None and final.finish_reason == result.stop_reason == "max_tokens"
    assert [r.token for r in tokens] == result.tokens and all(r.finish_reason is None for r in tokens)
    assert "".join(r.text for r in responses) == result.text and result.text.endswith("\ufffd")
    # the draft is the target itself: every drafted token is kept, and flagged as the draft's
    assert sum(r.from_draft for r in tokens) == result.stats.accepted > 0
    assert result.stats.method == "vanilla" and result.stats.generated_tokens == len(result.tokens)


def test_stopping_early_leaves_an_interrupted_result_and_a_clean_cache(smollm2_path) -> None:
    prompt = [{"role": "user", "content": "Write a story about a fox."}]
    with SpeculativeEngine.load(smollm2_path) as engine:
        stream = engine.stream(prompt, GenerationSettings(max_tokens=64))
        first = [next(stream) for _ in range(5)]
        stream.close()
        assert engine.last_result.stop_reason == "interrupted"
        assert engine.last_result.tokens == [r.token for r in first]
        again = engine.generate(prompt, GenerationSettings(max_tokens=64))
        assert again.stats.cached_tokens > 0  # the prompt's KV was reused
        fresh = SpeculativeEngine.load(smollm2_path)
        with fresh:
            assert fresh.generate(prompt, GenerationSettings(max_tokens=64)).tokens == again.tokens


def test_an_engine_is_a_pool_slot_alone_whose_decode_thread_runs_every_batch(smollm2_path) -> None:
    """generate, chat and `serve -np 1` take one path: a loaded engine's generation is a task of its scheduler, as a
    pool's slot's, and gets the text a pool of one gets."""
    prompt = [{"role": "user", "content": "Name three rivers in Europe."}]
    settings = GenerationSettings(max_tokens=24, method="lookup")
    with SpeculativeEngine.load(smollm2_path) as engine:
        assert engine.target.shared_context is not None  # a slot of a shared context, as a pool's
        ticks = engine.lockstep.n_ticks
        result = engine.generate(prompt, settings)
        # every target batch (the prompt's, counted as a pass, and each after) was one of its scheduler's ticks
        assert engine.lockstep.n_ticks - ticks == result.stats.target_passes > 1
        tokens = engine.encode(prompt)
    with EnginePool.load(smollm2_path, parallel=1) as pool:
        with pool.slot(tokens) as slot:
            last = list(pool.run(slot, tokens, settings))[-1]
    assert last.result.tokens == result.tokens


def test_closing_an_engine_mid_stream_stops_its_generation_first(smollm2_path) -> None:
    with SpeculativeEngine.load(smollm2_path) as engine:
        stream = engine.stream("Once upon a time", GenerationSettings(max_tokens=64, ignore_eos=True))
        seen = [next(stream).token for _ in range(3)]
        engine.close()  # the generation, waiting at its third token, closes before the contexts are freed
        assert engine.last_result.stop_reason == "interrupted" and engine.last_result.tokens == seen
        stream.close()
