"""`ggufspec bench` end to end on the tiny pair: warm-up, repetitions, per-category rows, JSON."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.stats import Stats


def test_bench_compares_methods_side_by_side(tiny_target, tiny_draft, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"question_id": 1, "category": "coding", "turns": ["Write a loop."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2+2?"]},
        {"task_id": "t/3", "prompt": "def f(x):\n"},
    ]))
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-d", str(tiny_draft), "-p", str(prompts),
                                  "--method", "autoregressive", "--method", "vanilla", "--repeats", "2",
                                  "--warmup", "1", "-n", "8", "--draft-max", "3", "--fresh-context",
                                  "-o", str(out), "--plot", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 3 * 2 * 2
    assert data["meta"]["kv_type"] == "f16"  # the tiny model's 16-value heads do not fit q8_0's blocks
    rows = {(s["category"], s["method"]): s for s in data["summary"]}
    assert {c for c, _ in rows} == {"coding", "math", "p", "all"}
    assert rows[("all", "autoregressive")]["speedup"] == 1.0
    assert rows[("all", "vanilla")]["same_tokens_as_baseline"] == 1.0  # greedy: identical outputs
    assert "speedup" in r.output and "vanilla" in r.output
    vanilla = [run for run in data["runs"] if run["method"] == "vanilla"]
    judged = sum(run["stats"]["judged_at"][0] for run in vanilla)
    kept = sum((run["stats"]["accepted_at"] or [0])[0] for run in vanilla)
    by_pos = rows[("all", "vanilla")]["acceptance_by_position"]
    assert 1 <= len(by_pos) <= 3 and by_pos[0] == round(kept / judged, 4)
    assert rows[("all", "autoregressive")]["acceptance_by_position"] == []
    for name in ("b-speedup.png", "b-acceptance.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_acceptance_by_position_counts_only_judged_drafts() -> None:
    s = Stats()
    s.record(4, 2)  # positions 1-2 kept, 3 rejected, 4 never judged
    s.record(4, 4)
    s.record(0, 0)
    assert s.judged_at == [2, 2, 2, 1] and s.accepted_at == [2, 2, 1, 1]
    assert s.acceptance_by_position == [1.0, 1.0, 0.5, 1.0]
    assert (s.target_passes, s.drafted, s.accepted) == (3, 8, 6)


def test_bench_bad_prompt_file(tiny_target, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(bad)])
    assert r.exit_code == 2 and "not JSON" in r.output
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "no such prompt file" in r.output


def test_per_category_keeps_the_first_prompts_of_each_category(tmp_path) -> None:
    from ggufspec.bench import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                           for i, c in enumerate(["a", "a", "a", "b", "c", "b", "b"])))
    assert [p.id for p in load_prompts(f, per_category=2)] == ["0", "1", "3", "4", "5"]
    assert [p.id for p in load_prompts(f, limit=2, per_category=1)] == ["0", "3"]
