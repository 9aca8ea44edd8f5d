"""A long sampled run with frequent rollbacks: the KV cache tracks the history exactly, RSS stays flat."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest

from conftest import open_decoder
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.sampling import SamplingParams

# 4,200 tokens (past 4,096 cells): about 3,700 rollbacks checked and RSS sampled 10 times after warm-up. A token's
# decode grows with the context (this tiny model's attention is most of it past 2,000 cells), so the time grows as
# the square of the length: 8,000 tokens took three times as long (GGUFSPEC_LONG_RUN_TOKENS=20000 runs longer ones)
TOKENS = int(os.environ.get("GGUFSPEC_LONG_RUN_TOKENS", 4_200))
RSS_EVERY = 250  # rollbacks between two RSS samples


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _kv_matches_history(d) -> bool:
    """Sequence 0 spans exactly positions 0..len-1, and no tree sequence is left behind."""
    n = len(d.history)
    return d.kv_positions(0) == ((0, n - 1) if n else (-1, -1))


@pytest.mark.slow
def test_thousands_of_sampled_tokens_with_rollbacks(tiny_target, tiny_draft) -> None:
    checks = {"rollbacks": 0, "bad": 0}
    rss: list[float] = []
    engine = SpeculativeEngine.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=TOKENS + 64))
    for dec in (engine.target, engine.draft):
        original = dec.rollback_steps  # what the loop's rollbacks run (decode coroutines)

        def checked(n: int, _orig=original, _dec=dec):
            yield from _orig(n)
            checks["rollbacks"] += 1
            checks["bad"] += not _kv_matches_history(_dec)
            if checks["rollbacks"] % RSS_EVERY == 0:
                rss.append(_rss_mb())

        dec.rollback_steps = checked
    # random weights sample the end-of-text token now and then (where, depends on the CPU's float
    # rounding); this run is about the KV cache, so it never stops early
    engine.target.vocab.is_eog = lambda token: False
    settings = GenerationSettings(max_tokens=TOKENS, sampling=SamplingParams(temperature=1.0), seed=5,
                                  method="vanilla", draft_max=2)
    result = engine.generate("Once upon a time", settings)
    assert len(result.tokens) == TOKENS and result.stop_reason == "max_tokens"
    assert checks["bad"] == 0 and checks["rollbacks"] > TOKENS // 2, checks
    assert result.stats.drafted > result.stats.accepted > 0
    warm = 1000 // RSS_EVERY  # after warm-up (the first 1,000 rollbacks)
    assert len(rss) > warm + 5, rss
    growth = max(rss[warm:]) - rss[warm]
    assert growth < 20, f"RSS grew {growth:.1f} MB after warm-up: {rss}"
    history = list(engine.target.history)
    nxt = engine.target.feed([result.tokens[-1]])[-1]
    engine.close()
    # reference: a fresh context fed the same history one token at a time (one-token kernels, as
    # decoding; a single big prefill batch differs by ~0.03 after thousands of positions)
    with open_decoder(tiny_target, n_ctx=TOKENS + 64) as fresh:
        for tok in history:
            fresh.feed([tok], all_logits=False)
        want = fresh.feed([result.tokens[-1]])[-1]
    np.testing.assert_allclose(nxt, want, atol=0.05)
    print(f"long run: {TOKENS} tokens, {result.stats.target_passes} target passes, {checks['rollbacks']} rollbacks "
          f"checked, acceptance {result.stats.acceptance_rate:.1%}, RSS {rss[0]:.0f} -> {rss[-1]:.0f} MB")


@pytest.mark.slow
def test_open_close_cycles_leak_no_llama_cpp_handles(tiny_target, tiny_draft) -> None:
    def cycle() -> None:
        with SpeculativeEngine.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=256)) as engine:
            # vanilla, as the default was: `auto` would also time its cost model whenever a busy machine keeps
            # the measurement out of the cache, and its 64-token batches leave allocator pools to grow
            engine.generate("Hello", GenerationSettings(max_tokens=4, method="vanilla"))

    for _ in range(5):  # warm-up: allocator pools, lazily loaded code
        cycle()
    before = _rss_mb()
    for _ in range(50):
        cycle()
    growth = _rss_mb() - before
    assert growth < 20, f"RSS grew {growth:.1f} MB over 50 open/generate/close cycles"
