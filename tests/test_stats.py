"""The stats a run reports (`--stats`, `--json`): tokens per pass never below 1, and what `auto` decided, with why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggufspec.engine import GenerationSettings, SpeculativeEngine
from conftest import FixedCosts, open_decoder

CLI = [sys.executable, "-m", "ggufspec.cli"]


def cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GGUFSPEC_CACHE=str(cache))
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_run_that_ends_at_its_stop_token_counts_it_in_tok_per_pass(smollm2_path, tmp_path) -> None:
    """Plain decoding commits one token a pass: the last pass's is the end-of-text token, which the text leaves out
    (24 tokens in 25 passes printed 0.96 tok/pass)."""
    r = cli("generate", "-m", str(smollm2_path), "-n", "64", "--json", "--stats", "Say hi", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert json.loads(r.stdout)["stop_reason"] == "stop"  # the model ended its answer
    assert stats["mean_accepted_length"] == 1.0
    assert f"{stats['target_passes']} target passes, 1.00 tok/pass" in r.stderr
    assert stats["committed_tokens"] == stats["generated_tokens"] + 1 == stats["target_passes"]


def nothing_pays(entry: dict) -> dict:
    """A cost entry under which no draft can pay: a batch of n tokens costs 1 + 1.2 (n - 1) decodes, a draft token
    0.3 of one (longer batches alike)."""
    one = entry["verify"][0]
    price = lambda n: one * (1 + 1.2 * (n - 1))  # noqa: E731
    return {**entry, "verify": [price(n) for n in range(1, len(entry["verify"]) + 1)], "draft": 0.3 * one,
            "long_verify": [price(n) for n in entry["long_sizes"]]}


def test_auto_says_why_it_drafted_nothing_in_the_stats_line_and_json(tiny_target, tiny_draft, tmp_path) -> None:
    """On a pair where nothing pays, the stats say so and why, from the costs measured here."""
    args = ["generate", "-m", str(tiny_target), "-d", str(tiny_draft), "-c", "256", "-n", "8", "--json", "--stats",
            "Hello"]
    assert cli(*args, cache=tmp_path).returncode == 0  # measures the costs, and caches them
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({key: nothing_pays(e) for key, e in json.loads(path.read_text()).items()}))

    r = cli(*args, cache=tmp_path)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    why = ("speculation off: a 2-token batch costs 2.2 decodes here and a draft token 0.30: even drafts kept 90% of "
           "the time would not pay")
    assert stats["method"] == "auto" and stats["drafted"] == 0 and stats["decision"] == why
    assert f"tok/pass | {why} | time:" in r.stderr.splitlines()[-1]


def test_auto_says_what_it_drafted_from(tiny_target, tiny_draft) -> None:
    """Where drafting pays (batches almost as cheap as a token, a free draft), the stats name the source and its
    steps."""
    costs = FixedCosts([0.02, 0.0201, 0.0202], 0.0, [16, 32, 64], [0.021, 0.022, 0.023])
    with open_decoder(tiny_target) as t, open_decoder(tiny_draft) as d:
        engine = SpeculativeEngine(t, d, costs=costs)
        result = engine.generate("Hello", GenerationSettings(max_tokens=16, method="auto", draft_max=2))
    stats = result.stats
    assert stats.drafted > 0
    assert stats.decision.startswith("drafted on ") and f"of {stats.target_passes} passes (" in stats.decision
    assert "draft model" in stats.decision or "lookup" in stats.decision
    assert f"| {stats.decision} |" in stats.line()


def test_the_rates_count_what_the_run_committed(tiny_target, tiny_draft) -> None:
    """The tokens a stream marks from_draft are the kept drafts: acceptance is they over the drafted ones, and tokens
    a pass the committed ones over the passes, in the JSON fields and the stats line alike."""
    with open_decoder(tiny_target) as t, open_decoder(tiny_draft) as d:
        costs = FixedCosts([0.02, 0.0201, 0.0202], 0.0, [16, 32, 64], [0.021, 0.022, 0.023])
        engine = SpeculativeEngine(t, d, costs=costs)
        responses = list(engine.stream("Hello", GenerationSettings(max_tokens=24, method="vanilla", draft_max=2)))
    stats = responses[-1].result.stats
    kept = sum(r.from_draft for r in responses)
    assert stats.drafted > 0 and stats.accepted == kept
    d = stats.to_dict()
    assert d["acceptance_rate"] == pytest.approx(kept / stats.drafted)
    assert d["mean_accepted_length"] == pytest.approx(stats.committed_tokens / stats.target_passes)
    assert f"acceptance {kept / stats.drafted:.1%} ({kept}/{stats.drafted})" in stats.line()
    assert f"{stats.committed_tokens / stats.target_passes:.2f} tok/pass" in stats.line()
