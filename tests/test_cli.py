"""`ggufspec generate` on SmolLM2-135M-Instruct: streaming, chat, JSON, stats, stdin, interruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.textstream import TextStream
from conftest import TINY
from tiny_models import write_tiny_gguf


def test_generate_json_matches_the_api(smollm2_path) -> None:
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "24", "--json", "--raw", "The capital of France is"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    with SpeculativeEngine.load(smollm2_path) as engine:
        ref = engine.generate("The capital of France is", GenerationSettings(max_tokens=24))
    assert out["tokens"] == ref.tokens and out["text"] == ref.text
    assert "Paris" in out["text"]
    assert out["stats"]["generated_tokens"] == len(out["tokens"]) and out["stats"]["target_passes"] >= 1


def test_a_temperature_too_small_for_float32_gives_the_greedy_text(smollm2_path, tiny_draft) -> None:
    """1/T overflowed float32 and every probability was NaN: junk tokens, exit 0. Such a T is greedy, for the target's
    p and the draft's q alike (vanilla with a random draft: most drafts are rejected)."""
    def text(temp: str) -> str:
        r = subprocess.run([sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "-d",
                            str(tiny_draft), "--method", "vanilla", "-c", "256", "-n", "8", "--seed", "1", "--temp",
                            temp, "--json", "hi"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr
        return json.loads(r.stdout)["text"]

    greedy = text("0")
    assert {t: text(t) for t in ("1e-38", "1e-45", "5e-324")} == dict.fromkeys(("1e-38", "1e-45", "5e-324"), greedy)


@pytest.mark.parametrize("temp", ["0.7", "0"])
def test_a_model_whose_logits_are_nan_is_one_clear_error_not_junk(tokenizer_fields, tiny_weights, tmp_path,
                                                                  temp) -> None:
    # a probability row of NaN drew a junk token silently, and greedy took numpy's argmax, the first NaN
    weights = dict(tiny_weights)
    weights["output.weight"] = weights["output.weight"].copy()
    weights["output.weight"][7] = np.nan  # token 7's logit is NaN at every position
    model = write_tiny_gguf(tmp_path / "nan.gguf", tokenizer_fields, weights, TINY)
    r = subprocess.run([sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(model), "-n", "4", "--temp",
                        temp, "--raw", "Hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: the model's logits are not finite"), r.stderr


def test_generate_ignore_eos_runs_to_n_tokens(smollm2_path) -> None:
    runs = {flag: CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "24", "--json", *flag,
                                            "What is 2+2?"]) for flag in ((), ("--ignore-eos",))}
    outs = {flag: json.loads(r.stdout) for flag, r in runs.items() if r.exit_code == 0}
    assert len(outs) == 2, [r.output for r in runs.values()]
    assert len(outs[()]["tokens"]) < 24 and len(outs[("--ignore-eos",)]["tokens"]) == 24
    assert outs[("--ignore-eos",)]["text"].startswith(outs[()]["text"])


def test_generate_chat_streams_and_prints_stats(smollm2_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "-d", str(smollm2_path),
         "--method", "vanilla",  # drafts every step (`auto` may rightly draft nothing on this CPU): acceptance shows
         "--chat", "--system", "Answer in one short sentence.", "-n", "40", "--stats", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "<|im_end|>" not in r.stdout and "<|im_start|>" not in r.stdout
    assert "tok/s" in r.stderr and "acceptance" in r.stderr and "tok/pass" in r.stderr


def test_generate_applies_the_chat_template_by_default(smollm2_path) -> None:
    prompt = "Write a haiku about rain."

    def run(*args: str) -> dict:
        r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "24", "--json", *args, prompt])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    default, chat, raw = run(), run("--chat"), run("--raw")
    with SpeculativeEngine.load(smollm2_path) as engine:
        as_chat = engine.generate([{"role": "user", "content": prompt}], GenerationSettings(max_tokens=24))
        as_text = engine.generate(prompt, GenerationSettings(max_tokens=24))
    assert default["tokens"] == chat["tokens"] == as_chat.tokens and raw["tokens"] == as_text.tokens
    assert default["stats"]["prompt_tokens"] > raw["stats"]["prompt_tokens"] + 5  # the template's turn markers
    assert default["text"].strip() and "<|im_" not in default["text"]
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "--raw", "--chat", prompt])
    assert r.exit_code == 2 and "--raw" in r.output


def test_a_model_without_a_chat_template_gets_the_plain_prompt(tokenizer_fields, tiny_weights, tmp_path) -> None:
    fields = [f for f in tokenizer_fields if f.name != "tokenizer.chat_template"]
    path = write_tiny_gguf(tmp_path / "no-template.gguf", fields, tiny_weights, TINY)
    runs = [CliRunner().invoke(main, ["generate", "-m", str(path), "-n", "6", "--json", *args, "Hello there"])
            for args in ((), ("--raw",))]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    assert json.loads(runs[0].stdout)["tokens"] == json.loads(runs[1].stdout)["tokens"]
    r = CliRunner().invoke(main, ["generate", "-m", str(path), "--chat", "Hello there"])
    assert r.exit_code == 2 and "no chat template" in r.output


@pytest.mark.parametrize("writes_bos", [True, False])
def test_a_chat_prompt_holds_the_bos_the_model_asks_for_once(tokenizer_fields, tiny_weights, tmp_path,
                                                              writes_bos) -> None:
    """A model whose tokenizer asks for a BOS gets exactly one before a chat: the template's own where it writes one
    (as Gemma's and Llama 3's do), else the tokenizer's."""
    template = ("{{ bos_token }}" if writes_bos else "") + "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    path = write_tiny_gguf(tmp_path / "bos.gguf", tokenizer_fields, tiny_weights, TINY, chat_template=template,
                           add_bos=True)
    with SpeculativeEngine.load(path) as engine:
        bos = engine.target.vocab.bos
        tokens = engine.encode([{"role": "user", "content": "Hello there"}], engine.n_ctx)
        plain = engine.encode("Hello there\n", engine.n_ctx)
    assert tokens[0] == bos and tokens.count(bos) == 1 and tokens == plain, (tokens, plain, bos)


def test_generate_reads_stdin(smollm2_path) -> None:
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "8", "--json", "-"],
                           input="def add(a, b):\n")
    assert r.exit_code == 0, r.output
    direct = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "8", "--json", "def add(a, b):\n"])
    assert json.loads(r.stdout)["tokens"] == json.loads(direct.stdout)["tokens"]
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] == json.loads(direct.stdout)["stats"]["prompt_tokens"]


def test_stop_string(smollm2_path) -> None:
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "60", "--json", "--raw", "--stop", "\n",
                                  "Here is a list of fruits:\n1."])
    out = json.loads(r.stdout)
    assert out["stop_reason"] == "stop" and "\n" not in out["text"]


def test_sigint_flushes_text_and_exits_130(smollm2_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "-n", "3000", "--stats",
         "--chat", "Write a very long story about a dragon."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first = proc.stdout.read(20)  # wait until text is streaming
    assert first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first + out) > 20
    assert b"tok/s" in err and b"Traceback" not in err


def test_text_stream_is_utf8_safe_and_holds_back_stop_strings() -> None:
    ts = TextStream(stop=("END",))
    snow = "☃".encode()
    assert ts.push(snow[:1]) == "" and ts.push(snow[1:]) == "☃"
    assert ts.push(b"ab") == "ab"
    assert ts.push(b"E") == ""  # may start "END"
    assert ts.push(b"x") == "Ex"
    assert ts.push(b"EN") == ""
    assert ts.push(b"D tail") == "" and ts.stopped
    assert ts.text == "☃abEx"
    ts2 = TextStream(stop=("END",))
    ts2.push(b"hello EN")
    assert ts2.flush() == "EN" and ts2.text == "hello EN"
    plain = TextStream()  # no stop string: the same across tokens
    assert plain.push(snow[:2]) == "" and plain.push(snow[2:] + b"!") == "☃!" and plain.flush() == ""
    assert plain.text == "☃!"
