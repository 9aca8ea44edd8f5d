"""Replay (`bench --replay`): recorded traces must reproduce what the real methods do, pass for pass."""

from __future__ import annotations

from click.testing import CliRunner

from ggufspec.costs import CostModel
from ggufspec.bench import BenchPrompt
from ggufspec.cli import main
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.replay import record, replay

PROMPTS = [BenchPrompt("a", "chat", [{"role": "user", "content": "Write a loop that counts to ten."}]),
           BenchPrompt("b", "code", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")]
N = 24


def test_replayed_methods_match_real_runs(tiny_target, tiny_draft) -> None:
    with SpeculativeEngine.load(tiny_target, tiny_draft, DecoderOptions(n_ctx=512)) as engine:
        traces = record(engine, PROMPTS, N)
        real = {}
        for method in ("autoregressive", "vanilla", "lookup"):
            passes = tokens = 0
            for p in PROMPTS:
                engine.reset()
                r = engine.generate(p.prompt, GenerationSettings(method=method, max_tokens=N, draft_max=3))
                passes, tokens = passes + r.stats.target_passes, tokens + len(r.tokens)
            real[method] = (passes, tokens)
    assert [len(t.tokens) - t.prompt_len for t in traces] == [N, N]
    costs = CostModel([1.0, 1.5, 2.0, 2.5], 0.25)
    for method, (passes, tokens) in real.items():
        r = replay(traces, costs, method, 3, N)
        assert (r.passes, r.tokens) == (passes, tokens), method
    vanilla = replay(traces, costs, "vanilla", 3, N)
    full = 2.5 + 3 * 0.25  # 3 drafts and a batch of 4; only a trace's last passes may draft fewer
    priced = vanilla.passes - len(traces)  # each trace's first token comes from its prompt's pass (not priced)
    assert priced * full - 2 * full < vanilla.seconds <= priced * full
    # the oracle picks each step's best source and length after the fact: no fixed policy may beat it
    oracle = replay(traces, costs, "oracle", 3, N).tokens_per_s
    for method in ("autoregressive", "vanilla", "lookup", "auto"):
        assert oracle >= replay(traces, costs, method, 3, N).tokens_per_s - 1e-9, method


def test_bench_replay_cli(tiny_target, tiny_draft, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there.\nCount to five.\n")
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-d", str(tiny_draft), "-p", str(prompts),
                                  "-n", "8", "--draft-max", "2", "--replay", "-c", "512"])
    assert r.exit_code == 0, r.output
    assert "cost model: target ms for 1..3 tokens" in r.output
    assert sum(line.split()[1] == "oracle" for line in r.output.splitlines()[2:]) == 1
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(prompts), "--replay"])
    assert r.exit_code == 2 and "--replay needs a draft model" in r.output
