"""`ggufspec generate --batch PROMPTS -o OUT.jsonl --parallel N` on SmolLM2-135M-Instruct: each prompt's text as it
gets alone, resuming an interrupted file, Ctrl-C, a failing prompt, and bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import numpy as np

from conftest import open_decoder
from ggufspec.cli import main
from ggufspec.engine import GenerationResult, GenerationSettings, SpeculativeEngine
from test_equivalence import NEAR_TIE

PROMPTS = [  # the shapes of ../shared/bench: HumanEval's `prompt`, Spec-Bench's `turns`; chat `messages`; plain text
    '{"task_id": "HumanEval/0", "prompt": "Name a colour."}',
    "What is 2+2?",
    '{"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now in French."]}',
    "",  # a blank line is no prompt
    '{"id": "chat-1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]}',
    "Tell me a joke.",
]


def assert_same_text_or_near_tie(model: Path, prompt_tokens: list[int], ref: GenerationResult, text: str) -> None:
    """`text` is `ref`'s, or leaves it where the target's top two logits nearly tie: the pool's slots share one cache,
    where a reused prefix or another slot's freed cells make attention add up in another order (docs/exactness.md;
    test_pool allows the same)."""
    if text == ref.text:
        return
    with open_decoder(model) as d:
        seen, i = b"", len(ref.tokens)
        for j, tok in enumerate(ref.tokens):  # the first of ref's tokens whose text is not the start of `text`
            seen += d.vocab.piece(tok)
            if not text.encode().startswith(seen):
                i = j
                break
        logits = d.feed(prompt_tokens + ref.tokens[:i])
    # the texts part inside token i, or at its start when `text` continues with a longer piece of the same bytes
    gaps = [float(np.diff(np.sort(logits[k])[-2:])[0]) for k in (-1, -2)[: 1 + (i > 0)]]
    assert min(gaps) < NEAR_TIE["quantized"], (
        f"{text!r} leaves {ref.text!r} at token {i}, where the target's top-2 gap is {gaps[0]:.4f}: not a near-tie")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def batch(model: Path, prompts: Path, out: Path, *args: str):
    return CliRunner().invoke(main, ["generate", "-m", str(model), "--batch", str(prompts), "-o", str(out), *args])


def test_each_prompt_gets_the_text_it_gets_alone(smollm2_path, tmp_path) -> None:
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    r = batch(smollm2_path, src, out, "--parallel", "2", "--temp", "0", "-n", "8", "--stats")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "wrote 5 lines" in r.stderr and "2 at once" in r.stderr
    got = {d["index"]: d for d in lines(out)}
    assert sorted(got) == [0, 1, 2, 3, 4] and len(lines(out)) == 5
    assert [got[i]["id"] for i in range(5)] == ["HumanEval/0", 2, 81, "chat-1", 6]  # ids, else the line number

    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731  (the model has a chat template)
    alone = [user("Name a colour."), user("What is 2+2?"), user("Write a haiku about rain."),
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}], user("Tell me a joke.")]
    with SpeculativeEngine.load(smollm2_path) as engine:
        refs = [engine.generate(p, GenerationSettings(max_tokens=8)) for p in alone]
        prompt_tokens = [engine.encode(p) for p in alone]
    for i, ref in enumerate(refs):
        d = got[i]
        assert_same_text_or_near_tie(smollm2_path, prompt_tokens[i], ref, d["text"])
        assert d["error"] is None and d["finish_reason"] in ("stop", "length")
        assert d["usage"]["prompt_tokens"] == ref.stats.prompt_tokens
        assert d["usage"]["completion_tokens"] == len(ref.tokens) == d["timings"]["predicted_n"]
        assert d["usage"]["total_tokens"] == d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"]
        assert d["timings"]["predicted_per_second"] > 0
    # and what `ggufspec generate` prints for a prompt alone
    one = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "8", "--json", "What is 2+2?"])
    assert one.exit_code == 0, one.output
    assert_same_text_or_near_tie(smollm2_path, prompt_tokens[1], refs[1], json.loads(one.stdout)["text"])
    assert json.loads(one.stdout)["text"] == refs[1].text


def test_a_rerun_keeps_the_done_lines_and_generates_only_the_rest(smollm2_path, tmp_path) -> None:
    src, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text("".join(f"Count to {n}.\n" for n in range(1, 6)), encoding="utf-8")
    done = [{"id": 1, "index": 0, "text": "SENTINEL-0", "finish_reason": "stop", "error": None},
            {"id": 2, "index": 1, "text": "SENTINEL-1", "finish_reason": "stop", "error": None},
            {"id": 4, "index": 3, "text": None, "finish_reason": None,  # a failure: tried again
             "error": {"code": "ContextLengthError", "message": "too long"}},
            {"id": 1, "index": 0, "text": "SENTINEL-0-again", "finish_reason": "stop", "error": None}]  # repeated
    cut = json.dumps({"id": 3, "index": 2, "text": "SENTINEL-2", "finish_reason": "stop", "error": None})[:30]
    out.write_text("".join(json.dumps(d) + "\n" for d in done) + cut, encoding="utf-8")  # a write cut short
    r = batch(smollm2_path, src, out, "-np", "2", "-n", "6")
    assert r.exit_code == 0, r.output
    assert "2 of 5 prompts already done" in r.stderr and "unfinished last line dropped" in r.stderr
    assert "wrote 3 lines" in r.stderr
    # the time generating, and the whole run's, which adds loading the model (minutes on a busy machine)
    spans = re.search(r"in (.+) generating, (.+) in all \(with loading the models\)", r.stderr)
    assert spans, r.stderr
    generating, in_all = (sum(float(n) * (60 if unit == "min" else 1)
                              for n, unit in re.findall(r"([\d.]+) (min|s)", span)) for span in spans.groups())
    assert 0 < generating <= in_all
    final = lines(out)
    assert sorted(d["index"] for d in final) == [0, 1, 2, 3, 4]  # each prompt once
    by_index = {d["index"]: d for d in final}
    assert by_index[0]["text"] == "SENTINEL-0" and by_index[1]["text"] == "SENTINEL-1"  # not generated again
    assert final[:2] == done[:2]  # kept as they were, in place
    for i in (2, 3, 4):
        assert by_index[i]["error"] is None and by_index[i]["text"] and by_index[i]["text"] != "SENTINEL-2"
        assert by_index[i]["id"] == i + 1
    assert not list(tmp_path.glob(".out.jsonl.*"))  # no temp file left
    before = out.read_bytes()
    again = batch(smollm2_path, src, out, "-np", "2", "-n", "6")
    assert again.exit_code == 0 and "all 5 prompts are done" in again.stderr and out.read_bytes() == before


def test_system_goes_before_each_prompt_without_one_of_its_own(smollm2_path, tmp_path) -> None:
    """--system: a text prompt (in the chat template) gets it first; chat messages that hold a system message keep
    theirs. Each line's prompt_tokens are those of the messages as the model's template renders them."""
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text(PROMPTS[1] + "\n" + PROMPTS[4] + "\n", encoding="utf-8")
    r = batch(smollm2_path, src, out, "--system", "Answer in French.", "-n", "2")
    assert r.exit_code == 0, r.output
    got = {d["index"]: d["usage"]["prompt_tokens"] for d in lines(out)}
    with SpeculativeEngine.load(smollm2_path) as engine:
        want = [len(engine.encode([{"role": "system", "content": "Answer in French."},
                                   {"role": "user", "content": "What is 2+2?"}])),
                len(engine.encode(json.loads(PROMPTS[4])["messages"]))]
    assert [got[0], got[1]] == want


def test_durations_read_as_a_person_reads_them() -> None:
    from ggufspec.batch_jobs import duration

    assert [duration(s) for s in (19.94, 137.2, 3600 + 5 * 60 + 2)] == ["19.9 s", "2 min 17 s", "1 h 05 min"]


def test_a_prompt_that_fails_gets_an_error_line_and_the_others_go_on(smollm2_path, tmp_path) -> None:
    src, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text("Say yes.\n" + "word " * 300 + "\nSay no.\n", encoding="utf-8")
    r = batch(smollm2_path, src, out, "-c", "256", "-np", "2", "-n", "4")  # 128 tokens a slot
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert "error: 1 prompt failed" in r.stderr and f"{src}:2" in r.stderr
    by_index = {d["index"]: d for d in lines(out)}
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[1]["text"] is None and "context" in by_index[1]["error"]["message"]
    assert by_index[1]["error"]["code"] == "ContextLengthError"
    assert by_index[0]["text"] and by_index[2]["text"] and by_index[0]["error"] is None


def test_ctrl_c_keeps_the_finished_lines_and_says_how_to_resume(smollm2_path, tmp_path) -> None:
    src, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text("".join(f"Write a very long story about dragon number {n}.\n" for n in range(8)), encoding="utf-8")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "--batch", str(src), "-o", str(out),
         "-np", "2", "-n", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and b"run the same command again" in err
    kept = lines(out)  # every line whole
    assert 1 <= len(kept) < 8 and all(d["text"] and d["error"] is None for d in kept)
    assert len({d["index"] for d in kept}) == len(kept)


@pytest.mark.parametrize("content, args, message", [
    (None, (), "no such prompt file"),
    ("", (), "no prompts in it"),
    ("\n  \n", (), "no prompts in it"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', (), "prompts.jsonl:2: not a JSON object"),
    ('{"question": "a"}\n', (), "prompts.jsonl:1: needs a `prompt`"),
    ('{"messages": "hi"}\n', (), "`messages` must be"),
    ("hello\n", ("NO-OUTPUT",), "--batch needs -o"),
    ("hello\n", ("A PROMPT",), "does not go with a PROMPT"),
    ("hello\n", ("-p", "hi"), "does not go with -p"),
    ("hello\n", ("--json",), "leave out --json"),
    ("hello\n", ("--raw", "--chat"), "--raw"),
    ("hello\n", ("-o", "SRC"), "that is the prompt file"),
    ("hello\n", ("-o", "NOFOLDER"), "does not exist"),
])
def test_bad_input_is_one_clear_error(smollm2_path, tmp_path, content, args, message) -> None:
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    if content is not None:
        src.write_text(content, encoding="utf-8")
    argv = ["generate", "-m", str(smollm2_path), "--batch", str(src)]
    if "-o" not in args and "NO-OUTPUT" not in args:
        argv += ["-o", str(out)]
    substitutes = {"SRC": str(src), "NOFOLDER": str(tmp_path / "missing" / "out.jsonl")}
    argv += [substitutes.get(a, a) for a in args if a != "NO-OUTPUT"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert isinstance(r.exception, SystemExit)  # handled: no exception escaped
    assert not out.exists()


def test_a_broken_json_line_stops_the_run_before_any_model_loads(tmp_path) -> None:
    # a line that starts with `{` is a JSON object or a mistake: sent as text it would be a silently wrong prompt
    src, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text('Say yes.\n{"prompt": "unterminated\n{x} is a set: say why.\n', encoding="utf-8")
    r = batch(tmp_path / "no-such-model.gguf", src, out)  # the prompts are read first: the model is never opened
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{src}:2: not a JSON object (Unterminated string" in errors[0], r.stderr
    assert 'write it as {"prompt": "..."}' in errors[0]  # how to send a text prompt that starts with `{`
    assert "no-such-model" not in r.output and not out.exists()


def test_an_output_file_that_is_not_these_results_is_left_alone(smollm2_path, tmp_path) -> None:
    src, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    src.write_text("hello\nworld\n", encoding="utf-8")
    for text, message in (("just some notes\nmore\n", "out.jsonl:1: not a JSON line"),
                          ('{"index": 7, "id": 1, "text": "x", "error": null}\n', "not a result of these 2 prompts"),
                          ('{"index": 0, "id": "other", "text": "x", "error": null}\n', "results of another input")):
        out.write_text(text, encoding="utf-8")
        r = batch(smollm2_path, src, out)
        assert r.exit_code == 2 and message in r.output, r.output
        assert out.read_text(encoding="utf-8") == text


def test_without_batch_its_options_are_refused(smollm2_path, tmp_path) -> None:
    for args, message in ((("-o", str(tmp_path / "o.jsonl")), "give --batch"), (("--parallel", "2"), "with --batch")):
        r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), *args, "hello"])
        assert r.exit_code == 2 and message in r.output, r.output
    assert "--batch FILE" in CliRunner().invoke(main, ["generate", "--help"]).output
