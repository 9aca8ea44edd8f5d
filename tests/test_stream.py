"""`SpeculativeEngine.stream`: one response per committed token, then the finish; what chat and serve build on."""

from __future__ import annotations

from ggufspec.engine import GenerationSettings, SpeculativeEngine


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
