"""What a llama.cpp user types on the first day: its flag spellings, -n -1, --seed -1, -ngl on a CPU build, a heads
file given as a model, bytes that are not UTF-8, a context that fills up; its habits (--spec-type, -e, --jinja,
-cnv, --chat-template, --color, --log-disable). Each runs the real CLI on SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec.cli import main
from ggufspec.decoder import gpu_offload

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Name a colour."


def run_json(*args: object) -> dict:
    r = CliRunner().invoke(main, ["generate", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def cli(*args: object, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *(a if isinstance(a, bytes) else str(a) for a in args)],
                          cwd=ROOT, input=stdin, capture_output=True, timeout=300)


def test_llama_cpp_spellings_give_the_same_text_as_ggufspecs(smollm2_path) -> None:
    ours = run_json("-m", smollm2_path, "-d", smollm2_path, "--method", "vanilla", "-c", "512", "-n", "12",
                    "--seed", "3", "--temp", "0.8", "--flash-attn", "--kv-type", "q8_0", "--stop", "zzz", PROMPT)
    theirs = run_json("-m", smollm2_path, "-md", smollm2_path, "--method", "vanilla", "--ctx-size", "512",
                      "--n-predict", "12", "-s", "3", "--temp", "0.8", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0",
                      "-r", "zzz", "-p", PROMPT)
    assert theirs["tokens"] == ours["tokens"] and len(ours["tokens"]) == 12
    assert theirs["stats"]["drafted"] == ours["stats"]["drafted"] > 0  # the draft ran in both


def test_the_options_reach_the_model(smollm2_path) -> None:
    """Both spellings giving one text would hold were an option ignored by both: -ctk and -t reach the load (as
    `doctor` reports it), and --seed, --min-p, --top-k and --top-p the sampler (each filter alone leaves the greedy
    text at --temp 1.5, which a draw without them is not)."""
    r = cli("doctor", "-m", smollm2_path, "-ctk", "q4_0", "-t", "1")
    out = r.stdout.decode()
    assert r.returncode == 0 and "KV cache: q4_0/" in out and "threads 1;" in out, out
    greedy = run_json("-m", smollm2_path, "-n", "10", "--temp", "0", PROMPT)["tokens"]
    hot = ("-m", smollm2_path, "-n", "10", "--temp", "1.5")
    drawn = [run_json(*hot, "-s", seed, PROMPT)["tokens"] for seed in (1, 1, 2)]
    assert drawn[0] == drawn[1] != drawn[2] and drawn[0] != greedy
    for flag in (("--min-p", "1"), ("--top-k", "1"), ("--top-p", "1e-6")):
        assert run_json(*hot, "-s", "1", *flag, PROMPT)["tokens"] == greedy, flag


def test_help_lists_the_llama_cpp_spellings() -> None:
    help_text = CliRunner().invoke(main, ["generate", "--help"]).output
    for spelling in ("-md, --draft, --model-draft", "--ctx-size", "--n-predict", "-fa", "-ctk, --cache-type-k",
                     "-ctv, --cache-type-v", "-p, --prompt", "-s, --seed", "--gpu-layers", "-ub, --n-ubatch"):
        assert spelling in help_text, spelling
    assert "-np, --parallel" in CliRunner().invoke(main, ["serve", "--help"]).output
    for spelling in ("-e, --escape / --no-escape", "--chat-template NAME|JINJA", "--jinja",
                     "-no-cnv, --no-conversation", "--color / --no-color", "--spec-type", "--log-disable"):
        assert spelling in help_text, spelling


def test_serve_np_is_parallel_and_says_what_it_allows() -> None:
    r = CliRunner().invoke(main, ["serve", "-np", "0"])
    assert r.exit_code == 2 and "--parallel" in r.output and "'-n'" not in r.output


def test_n_minus_one_runs_until_the_context_is_full_and_says_so(smollm2_path) -> None:
    r = cli("generate", "-m", smollm2_path, "-c", "48", "-n", "-1", "--raw", "Once upon a time")
    assert r.returncode == 0, r.stderr
    assert b"(stopped: the context of 48 tokens is full" in r.stderr
    out = run_json("-m", smollm2_path, "-c", "48", "-n", "-1", "--raw", "Once upon a time")
    assert out["stop_reason"] == "length" and out["stats"]["prompt_tokens"] + len(out["tokens"]) == 48
    zero = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-n", "0", PROMPT])
    assert zero.exit_code == 2 and "-1 for up to the end of the context" in zero.output


def test_seed_minus_one_is_a_random_seed(smollm2_path) -> None:
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "--seed", "-1", "--temp", "0.8", "-n", "4",
                                  PROMPT])
    assert r.exit_code == 0, r.output


@pytest.mark.skipif(gpu_offload(), reason="this llama.cpp build has a GPU backend")
def test_ngl_without_a_gpu_backend_warns_and_keeps_the_cpu_defaults(smollm2_path) -> None:
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-ngl", "-1", "-n", "12", "--json", PROMPT])
    assert r.exit_code == 0, r.output
    assert r.stderr.count("warning: -ngl -1 is ignored") == 1
    assert json.loads(r.stdout)["tokens"] == run_json("-m", smollm2_path, "-n", "12", PROMPT)["tokens"]
    doctor = {args: CliRunner().invoke(main, ["doctor", "-m", str(smollm2_path), *args]).stdout
              for args in ((), ("-ngl", "99"))}
    kv = {args: [line for line in out.splitlines() if "KV cache" in line] for args, out in doctor.items()}
    assert kv[()] and kv[()] == kv[("-ngl", "99")]


def test_medusa_heads_given_as_a_model_are_named_so(smollm2_path) -> None:
    heads = sorted((ROOT / "models" / "demo").glob("*medusa*.gguf"))[0]
    for args in (["-m", smollm2_path, "-d", heads], ["-m", heads]):
        r = CliRunner().invoke(main, ["generate", *map(str, args), "-n", "4", PROMPT])
        assert r.exit_code == 2, r.output
        assert "holds Medusa heads" in r.output and "--medusa" in r.output and "Traceback" not in r.output


def test_bytes_that_are_not_utf8_are_named_by_their_offset_in_the_input(smollm2_path) -> None:
    r = cli("generate", "-m", smollm2_path, "-n", "4", "-", stdin="café au lait".encode("latin-1"))
    assert r.returncode == 2 and b"standard input is not UTF-8 text: byte 0xe9 at offset 3" in r.stderr, r.stderr
    r = cli("generate", "-m", smollm2_path, "-n", "4", "café".encode("latin-1"))
    assert r.returncode == 2 and b"the prompt is not UTF-8 text: byte 0xe9 at offset 3" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr and b"surrogates" not in r.stderr


# Where bench's option of a name differs from generate's, on purpose (each is a `per` entry of cli.OPTIONS): its -n
# counts tokens per run (1 at least, 128 by default) and its --seed is 0 so that runs repeat, neither with llama.cpp's
# spellings -s, --n-predict; nor has it taken -md, --model-draft, --draft-n (a change bench --help would show).
BENCH_OWN = {"max_tokens", "seed", "draft", "draft_max"}


def test_bench_declares_the_options_it_shares_with_generate_alike() -> None:
    params = {command: {p.name: p for p in main.commands[command].params} for command in ("generate", "bench")}
    shared = params["generate"].keys() & params["bench"].keys()
    assert {"target", "preset", "medusa_vocab", "n_ctx", "kv_type", "no_memory_check"} <= shared
    for name in shared:
        g, b = params["generate"][name], params["bench"][name]
        assert set(b.opts + b.secondary_opts) <= set(g.opts + g.secondary_opts), name  # a flag means one thing
        if name not in BENCH_OWN:
            assert (b.opts, b.secondary_opts, b.default) == (g.opts, g.secondary_opts, g.default), name
    assert BENCH_OWN <= shared
    for command in ("generate", "chat", "serve", "bench", "doctor"):  # and no command declares a flag twice
        flags = [f for p in main.commands[command].params for f in p.opts + p.secondary_opts]
        assert len(flags) == len(set(flags)), command


# --- llama.cpp's habits: what has a meaning here is taken, the rest refused with what to use instead --------------

def answer(*args: object) -> tuple:
    """What generate --json answers, less its timings: the text, the tokens and the prompt's length."""
    out = run_json(*args)
    return out["text"], out["tokens"], out["stats"]["prompt_tokens"]


def usage_error(*args: object) -> str:
    r = CliRunner().invoke(main, [*map(str, args)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    return r.output


def test_flags_for_what_ggufspec_always_does_change_nothing(smollm2_path) -> None:
    plain = answer("-m", smollm2_path, "-n", "6", PROMPT)
    assert answer("-m", smollm2_path, "-n", "6", "-no-cnv", "--jinja", "--log-disable", PROMPT) == plain
    for flags in (["-cnv", "--jinja"], ["--conversation"]):  # chat is a conversation already
        r = CliRunner().invoke(main, ["chat", "-m", str(smollm2_path), *flags], input="/exit\n")
        assert r.exit_code == 0, r.output


def test_conversation_flags_name_the_command_that_has_one(smollm2_path) -> None:
    for flag in ("-cnv", "--conversation"):
        out = usage_error("generate", "-m", smollm2_path, flag, PROMPT)
        assert "`ggufspec chat`" in out and "'nv'" not in out and "integer range" not in out
    out = usage_error("chat", "-m", smollm2_path, "-no-cnv")
    assert "`ggufspec generate`" in out


def test_spec_type_is_the_method_that_drafts_so(smollm2_path) -> None:
    method = {}
    for spec in ("none", "ngram-mod", "ngram-simple,ngram-cache", "draft-simple", "ngram-mod,draft-simple"):
        out = run_json("-m", smollm2_path, "-md", smollm2_path, "-n", "6", "--spec-type", spec, PROMPT)
        method[spec] = out["stats"]["method"]
        assert out["tokens"] == run_json("-m", smollm2_path, "-n", "6", PROMPT)["tokens"]  # greedy: the same text
    assert method == {"none": "autoregressive", "ngram-mod": "lookup", "ngram-simple,ngram-cache": "lookup",
                      "draft-simple": "vanilla", "ngram-mod,draft-simple": "auto"}
    out = usage_error("generate", "-m", smollm2_path, "--spec-type", "draft-eagle3", PROMPT)
    assert "EAGLE-3" in out and "-md DRAFT.gguf" in out and "--medusa HEADS.gguf" in out
    out = usage_error("generate", "-m", smollm2_path, "--spec-type", "ngram-mode", PROMPT)
    assert "ngram-mod" in out and "draft-simple" in out and "cache-type" not in out
    out = usage_error("generate", "-m", smollm2_path, "--spec-type", "ngram-mod", "--method", "vanilla", PROMPT)
    assert "--method lookup" in out and "contradicts --method vanilla" in out


def test_escape_processes_the_prompts_escapes_as_llama_cpp(smollm2_path) -> None:
    from ggufspec.cli import process_escapes

    assert process_escapes(rb"a\nb\tc\r\'\"\\ \x41\xc3\xa9") == "a\nb\tc\r'\"\\ Aé".encode()
    odd = b"\\q \\xg1 \\x4 \\"  # an unknown escape, \x without two hex digits, a backslash at the end: kept
    assert process_escapes(odd) == odd
    escaped = answer("-m", smollm2_path, "--raw", "-n", "6", "-e", "Colours:\\n1. red\\n2.")
    assert escaped == answer("-m", smollm2_path, "--raw", "-n", "6", "Colours:\n1. red\n2.")
    assert escaped != answer("-m", smollm2_path, "--raw", "-n", "6", "Colours:\\n1. red\\n2.")
    stop = ("-m", smollm2_path, "--raw", "-n", "24", "Colours:\n1. red\n2.")  # -e escapes --stop too, as llama.cpp
    assert answer(*stop, "-e", "--stop", "\\n") == answer(*stop, "--stop", "\n") != answer(*stop, "--stop", "\\n")
    out = usage_error("generate", "-m", smollm2_path, "-e", "caf\\xe9")
    assert "not UTF-8" in out and "0xe9" in out


def test_chat_template_takes_llama_cpps_built_in_names(smollm2_path, tmp_path) -> None:
    chatml = answer("-m", smollm2_path, "-n", "8", "--chat-template", "chatml", PROMPT)
    by_hand = answer("-m", smollm2_path, "-n", "8", "--raw", "-e",
                     f"<|im_start|>user\\n{PROMPT}<|im_end|>\\n<|im_start|>assistant\\n")
    assert chatml == by_hand
    own = answer("-m", smollm2_path, "-n", "8", PROMPT)  # SmolLM2's own template adds a system message
    assert own[2] > chatml[2]
    jinja = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
             "{{ '<|im_start|>assistant\\n' }}")  # llama.cpp's --chat-template takes a template's text too
    assert answer("-m", smollm2_path, "-n", "8", "--chat-template", jinja, PROMPT) == chatml
    src, out = tmp_path / "p.txt", tmp_path / "out.jsonl"  # --batch's slots (an EnginePool) render it too
    src.write_text(PROMPT + "\n", encoding="utf-8")
    r = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "--batch", str(src), "-o", str(out), "-n", "8",
                                  "--chat-template", "chatml"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text(encoding="utf-8"))["text"] == chatml[0]
    err = usage_error("generate", "-m", smollm2_path, "--chat-template", "chatmll", PROMPT)
    assert "'chatmll' is not one of llama.cpp's built-in chat templates" in err and "llama3" in err


def test_color_on_generate_shows_the_kept_draft_tokens(smollm2_path) -> None:
    from ggufspec.terminal_chat import DRAFT_COLOUR, RESET

    args = ["generate", "-m", str(smollm2_path), "-md", str(smollm2_path), "--method", "vanilla", "-n", "12", PROMPT]
    plain = CliRunner().invoke(main, args)
    coloured = CliRunner().invoke(main, [*args, "--color"])
    assert plain.exit_code == coloured.exit_code == 0, coloured.output
    assert DRAFT_COLOUR not in plain.stdout and DRAFT_COLOUR in coloured.stdout  # the draft is the target: kept
    assert coloured.stdout.replace(DRAFT_COLOUR, "").replace(RESET, "") == plain.stdout
    assert "--json streams none" in usage_error(*args, "--color", "--json")


def test_log_disable_silences_llama_cpp_even_with_verbose(smollm2_path) -> None:
    verbose = cli("generate", "-m", smollm2_path, "-n", "2", "-v", PROMPT)
    quiet = cli("generate", "-m", smollm2_path, "-n", "2", "-v", "--log-disable", PROMPT)
    assert verbose.returncode == quiet.returncode == 0, quiet.stderr
    assert b"llama_model_loader" in verbose.stderr and b"llama_model_loader" not in quiet.stderr
    assert quiet.stdout == verbose.stdout
