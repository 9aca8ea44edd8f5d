"""`ggufspec bench` end to end on the tiny pair: warm-up, repetitions, per-category rows, JSON, spread, plots, and
the demo pair by default."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec import bench as bench_mod
from ggufspec.bench import Run, Summary, spread_warning, summarize
from ggufspec.cli import main
from ggufspec.stats import Stats

PROMPTS = [
    {"question_id": 1, "category": "coding", "turns": ["Write a loop."]},
    {"question_id": 2, "category": "math", "turns": ["What is 2+2?"]},
    {"task_id": "t/3", "prompt": "def f(x):\n"},
]


def test_bench_compares_methods_side_by_side(tiny_target, tiny_draft, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in PROMPTS))
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
    assert r.exit_code == 2 and "bad.jsonl:1: not a JSON object" in r.output
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "no such prompt file" in r.output


def test_bench_without_prompts_runs_its_built_in_set(tiny_target, tiny_draft, tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-d", str(tiny_draft), "--method", "autoregressive",
                                  "--method", "vanilla", "-n", "4", "--repeats", "1", "--warmup", "0", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "prompts: the built-in set, 8 of them" in r.stderr
    data = json.loads(out.read_text())
    assert Path(data["meta"]["prompts"]).name == "bench.jsonl"
    assert len(data["runs"]) == 8 * 2 and all(run["tokens"] for run in data["runs"])
    assert {s["category"] for s in data["summary"]} == {"coding", "math", "writing", "summarization", "extraction",
                                                        "translation", "all"}
    shapes = {type(p.prompt) for p in bench_mod.load_prompts()}  # a completion and chat prompts, as in Spec-Bench
    assert shapes == {str, list}
    assert "built-in set" in CliRunner().invoke(main, ["bench", "--help"]).output


def test_bench_reads_every_shape_generate_batch_reads(tiny_target, tmp_path) -> None:
    from ggufspec.engine import GenerationSettings, SpeculativeEngine
    from ggufspec.decoder import DecoderOptions

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([json.dumps({"custom_id": "chat-1", "messages": messages}),
                                  "Once upon a time",  # a text line: a completion
                                  json.dumps({"id": 7, "category": "ids", "prompt": [1, 2, 3]})]) + "\n")
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(prompts), "--method", "autoregressive",
                                  "-n", "6", "--repeats", "1", "--warmup", "0", "--fresh-context", "-c", "512",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    runs = {run["prompt"]: run for run in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == ["2", "7", "chat-1"]  # ids as --batch names them: the id fields, else the line number
    assert runs["7"]["category"] == "ids" and runs["chat-1"]["category"] == "p"
    settings = GenerationSettings(method="autoregressive", max_tokens=6)
    with SpeculativeEngine.load(tiny_target, None, DecoderOptions(n_ctx=512)) as engine:
        for pid, prompt in (("chat-1", messages), ("2", "Once upon a time"), ("7", [1, 2, 3])):
            engine.reset()
            assert runs[pid]["tokens"] == engine.generate(prompt, settings).tokens, pid


def test_per_category_keeps_the_first_prompts_of_each_category(tmp_path) -> None:
    from ggufspec.bench import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                           for i, c in enumerate(["a", "a", "a", "b", "c", "b", "b"])))
    assert [p.id for p in load_prompts(f, per_category=2)] == ["0", "1", "3", "4", "5"]
    assert [p.id for p in load_prompts(f, limit=2, per_category=1)] == ["0", "3"]


# --- defaults, spread, warning, plots (one bench run of the tiny pair, shared) ------------------------------------

@pytest.fixture(scope="module")
def default_bench(tiny_target, tiny_draft, tmp_path_factory):
    """`bench` with no --method, 2 repetitions; SPREAD_WARN below any spread, so that its warning line is printed."""
    tmp = tmp_path_factory.mktemp("bench")
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in PROMPTS))
    out = tmp / "bench.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_mod, "SPREAD_WARN", -1.0)
        r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-d", str(tiny_draft), "-p", str(prompts),
                                      "--repeats", "2", "--warmup", "1", "-n", "8", "--draft-max", "3",
                                      "--fresh-context", "-o", str(out)])
    assert r.exit_code == 0, r.output
    return r, json.loads(out.read_text())


def test_bench_defaults_to_autoregressive_vanilla_and_auto_with_a_draft(default_bench) -> None:
    r, data = default_bench
    assert data["config"]["methods"] == ["autoregressive", "vanilla", "auto"]
    assert {run["method"] for run in data["runs"]} == {"autoregressive", "vanilla", "auto"}
    assert len(data["runs"]) == 3 * 3 * 2
    rows = {(s["category"], s["method"]): s for s in data["summary"]}
    assert rows[("all", "auto")]["same_tokens_as_baseline"] == 1.0  # greedy: auto's text is the target's


def test_bench_default_methods_follow_what_is_loaded() -> None:
    assert bench_mod.default_methods(False, False) == ("autoregressive", "auto")
    assert bench_mod.default_methods(True, False) == ("autoregressive", "vanilla", "auto")
    assert bench_mod.default_methods(False, True) == ("autoregressive", "medusa", "auto")
    r = CliRunner().invoke(main, ["bench", "--help"])
    assert "vanilla with a draft" in r.output and "--preset" in r.output


def test_bench_table_and_json_carry_the_spread_over_repeats(default_bench) -> None:
    r, data = default_bench
    for s in data["summary"]:
        assert s["repeats"] == 2
        assert s["tokens_per_s_min"] <= s["tokens_per_s"] <= s["tokens_per_s_max"]
        assert s["speedup_min"] <= s["speedup"] <= s["speedup_max"]
        assert 0 < s["run_tokens_per_s_min"] <= s["tokens_per_s_min"]
        assert s["run_tokens_per_s_max"] >= s["tokens_per_s_max"]
        assert len(s["acceptance_by_position_min"]) == len(s["acceptance_by_position"])
        assert all(lo <= a <= hi for lo, a, hi in zip(s["acceptance_by_position_min"], s["acceptance_by_position"],
                                                       s["acceptance_by_position_max"]))
        if s["method"] == "autoregressive":  # paired with itself in every repetition
            assert s["speedup_min"] == s["speedup"] == s["speedup_max"] == 1.0
    lines = r.stdout.splitlines()
    assert "(min-max)" in lines[0]
    for s in data["summary"]:
        line = next(x for x in lines if x.split()[1:3] == [s["category"][:14], s["method"]])
        assert f"{s['tokens_per_s_min']:.2f}-{s['tokens_per_s_max']:.2f}" in line
        assert f"{s['speedup_min']:.2f}-{s['speedup_max']:.2f}x" in line
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "--repeats" in warnings[0]  # one line, even though every cell is "wide" here
    assert "warning" not in r.stdout


def test_spread_warning_names_the_cell_a_stall_hit(default_bench) -> None:
    _, data = default_bench
    runs = [Run(**x) for x in data["runs"]]
    # a loaded machine: one autoregressive run of the second repetition took 50 times as long
    stalled = next(x for x in runs if x.method == "autoregressive" and x.repeat == 1 and x.category == "math")
    stalled.stats = dict(stalled.stats, generation_seconds=stalled.stats["generation_seconds"] * 50)
    rows = summarize(runs)
    cell = next(x for x in rows if (x.category, x.method) == ("math", "autoregressive"))
    assert cell.tokens_per_s_max / cell.tokens_per_s_min > 5 and cell.tokens_per_s_spread > 1
    assert max(x.speedup_spread for x in rows if x.category == "math" and x.method == "vanilla") > 1
    line = spread_warning(rows)
    assert line is not None and "\n" not in line and line.startswith("warning: wide spread")
    assert "temp 0 math " in line and "over 2 repeats" in line and "--repeats" in line and "quiet machine" in line
    assert "single runs went from" in line  # the baseline's runs: 50x apart
    one_rep = summarize([x for x in runs if x.repeat == 1])  # --repeats 1: no range, the single runs still show it
    assert all(x.repeats == 1 and x.tokens_per_s_min == x.tokens_per_s_max for x in one_rep)
    assert "single runs went from" in spread_warning(one_rep)
    row = bench_mod.format_table(one_rep).splitlines()[2].split()
    assert row[5] == "-" and row[7] == "-"  # no range to print


def test_plots_show_values_error_bars_and_the_models(default_bench, tiny_target, tiny_draft, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.container import BarContainer, ErrorbarContainer

    from ggufspec.plots import _title, acceptance_figure, speedup_figure, write_plots

    _, data = default_bench
    rows = [Summary(**s) for s in data["summary"]]
    title = _title(tiny_target, tiny_draft)
    assert title == "target tiny-target.gguf, draft tiny-draft.gguf"

    fig = speedup_figure(rows, title=title)
    assert fig.get_suptitle() == title
    (ax,) = fig.axes
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_label() for b in bars] == ["vanilla", "auto"]  # the baseline is the 1.0 line, not a bar
    assert all(b.errorbar is not None for b in bars)  # whiskers from the range over repetitions
    texts = {t.get_text() for t in ax.texts}
    for s in data["summary"]:
        if s["method"] != "autoregressive":
            assert f"{s['speedup']:.2f}x" in texts
    low, high = bars[0].errorbar.lines[2][0].get_segments()[-1][:, 1]  # the last category: "all"
    van = next(s for s in data["summary"] if (s["category"], s["method"]) == ("all", "vanilla"))
    assert low == pytest.approx(van["speedup_min"]) and high == pytest.approx(van["speedup_max"])

    fig = acceptance_figure(rows, title=title)
    assert fig.get_suptitle() == title
    (ax,) = fig.axes
    lines = {c.get_label() for c in ax.containers if isinstance(c, ErrorbarContainer)}
    assert "vanilla" in lines and lines <= {"vanilla", "auto"}  # auto may not draft at all on this machine
    van_pos = van["acceptance_by_position"]
    assert {f"{a:.0%}" for a in van_pos} <= {t.get_text() for t in ax.texts}

    paths = write_plots(rows, tmp_path / "b", target=tiny_target, draft=tiny_draft)
    assert [p.name for p in paths] == ["b-speedup.png", "b-acceptance.png"]


# --- the demo pair when no -m is given ----------------------------------------------------------------------------

def test_bench_with_no_model_nor_prompts_runs_the_demo_pair_on_its_built_in_set(tmp_path, smollm2_path) -> None:
    env = dict(os.environ)
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), HF_HUB_OFFLINE="1",
               GGUFSPEC_CACHE=str(tmp_path / "gg"), GGUFSPEC_THREADS="1")
    env.pop("HF_TOKEN", None)
    (tmp_path / "gg" / "models").mkdir(parents=True)
    (tmp_path / "gg" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_path)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "ggufspec.cli", "bench", "--limit", "1", "--repeats", "1",
                        "--warmup", "0", "-n", "4", "-c", "256", "-o", str(out)],  # nor -p: the built-in prompts
                       env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["preset"] == "demo" and Path(data["meta"]["prompts"]).name == "bench.jsonl"
    assert Path(data["meta"]["target"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Path(data["meta"]["draft"]).name == "smollm2-135m-draft.Q8_0.gguf"  # the draft shipped in models/demo
    assert data["config"]["methods"] == ["autoregressive", "vanilla", "auto"]
    assert {s["method"] for s in data["summary"]} == {"autoregressive", "vanilla", "auto"}


def test_bench_takes_either_a_preset_or_a_model(tiny_target, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    r = CliRunner().invoke(main, ["bench", "--preset", "demo", "-m", str(tiny_target), "-p", str(prompts)])
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(main, ["bench", "--preset", "no-such-preset", "-p", str(prompts)])
    assert r.exit_code == 2 and "unknown preset" in r.output


def test_an_output_into_a_missing_folder_fails_before_the_benchmark(tmp_path) -> None:
    (tmp_path / "p.txt").write_text("Hello\n")
    plot = ("--plot",) if importlib.util.find_spec("matplotlib") else ()  # without it, --plot fails on that first
    for option in ("-o", *plot):
        r = CliRunner().invoke(main, ["bench", "-p", str(tmp_path / "p.txt"), option, str(tmp_path / "nowhere" / "out")])
        assert r.exit_code == 2 and "does not exist" in r.output and "benchmarking" not in r.output, r.output


def test_a_run_does_not_copy_the_answer_of_an_earlier_run_of_its_prompt(tiny_target) -> None:
    """Every method runs each prompt in turn: `auto`'s lookup, which continues earlier answers, would copy the same
    prompt's answer from the run before (it did: 97% of its drafts kept, 3.6x autoregressive on a hybrid pair whose
    draft model kept 40%). Each run starts with no earlier answers: it drafts what a generation with none does."""
    from ggufspec.bench import BenchConfig, BenchPrompt, run_bench
    from ggufspec.engine import GenerationSettings, SpeculativeEngine
    from ggufspec.proposers import AnswerPool
    from conftest import FixedCosts
    from test_equivalence import drafting_pays

    # no draft model, whose chains beat lookup's guesses at these prices (a copied answer would go unverified), and
    # prices that do not learn this machine's timings (under load they moved between runs, and so did the drafts)
    prompt = "def fibonacci(n):\n"
    with SpeculativeEngine.load(tiny_target, None, costs=FixedCosts(drafting_pays().verify, 0.002)) as engine:
        cfg = BenchConfig(methods=("autoregressive", "auto"), max_tokens=24, repeats=2, warmup=0, draft_max=4)
        runs = run_bench(engine, [BenchPrompt("p", "c", prompt)], cfg)
        engine.answers = AnswerPool()
        alone = engine.generate(prompt, GenerationSettings(max_tokens=24, method="auto", draft_max=4))
        copied = engine.generate(prompt, GenerationSettings(max_tokens=24, method="auto", draft_max=4))
    assert copied.stats.drafted > alone.stats.drafted  # (what the test tells apart: an answer there to copy)
    auto = [r for r in runs if r.method == "auto"]
    assert [r.stats["drafted"] for r in auto] == [alone.stats.drafted] * 2, [r.stats for r in auto]
