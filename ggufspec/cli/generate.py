"""The commands that answer in the terminal: `generate` (one prompt streamed to stdout or as JSON, or a --batch file
of prompts to a JSONL file) and `chat` (a conversation, terminal_chat.py)."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any, BinaryIO

import click

from ..errors import EXIT_INTERRUPTED, GGUFSpecError
from .loading import load_engine
from .options import options_for
from .prompt_input import escaped, prompt_text

if TYPE_CHECKING:
    from ..engine import GenerationResult, SpeculativeEngine


@click.command()
@click.argument("prompt", required=False)
@options_for("generate")
def generate(prompt: str | None, prompt_option: str | None, prompt_file: BinaryIO | None, escape: bool, chat: bool,
             raw: bool, system: str | None, truncate_prompt: bool, context_shift: bool, colour: bool | None,
             show_stats: bool, as_json: bool, batch_path: str | None, output: str | None, parallel: int,
             **params: Any) -> None:
    """Generate text from PROMPT (`-` reads standard input; or -p TEXT, -f FILE).

    A model with a chat template gets PROMPT as a user message in it (as llama-cli and mlx_lm.generate do);
    --raw gives it the text as it is.

    Batch jobs: --batch PROMPTS.jsonl -o OUT.jsonl [--parallel N] generates every prompt of a file, N at once,
    each result a line of OUT.jsonl; run again after an interruption, it generates only what is missing."""
    if raw and (chat or system is not None):
        raise click.UsageError("--raw gives the prompt as it is: it does not go with --chat or --system.")
    if batch_path is not None:
        given = [name for name, v in (("a PROMPT", prompt), ("-p", prompt_option), ("-f", prompt_file),
                                      ("-e/--escape", escape or None), ("--color", colour or None)) if v is not None]
        if given:
            raise click.UsageError(f"--batch reads the prompts from {batch_path}: it does not go with {given[0]}.")
        return _batch(batch_path, output, parallel, as_json, chat=chat, raw=raw, system=system, show_stats=show_stats,
                      truncate_prompt=truncate_prompt, context_shift=context_shift, params=params)
    if output is not None:
        raise click.UsageError("-o/--output is where --batch writes its results: give --batch PROMPTS.jsonl too "
                               "(one prompt prints to stdout; --json gives it as JSON).")
    if parallel != 1:
        raise click.UsageError(f"--parallel {parallel} generates several prompts at once with --batch; one prompt "
                               "runs in one slot.")
    if as_json and colour:
        raise click.UsageError("--color colours the streamed text, and --json streams none: leave out one of them.")
    prompt = prompt_text(prompt, prompt_option, prompt_file, escape)
    if escape:  # as llama.cpp, which processes the reverse prompts' escapes too
        params["stop"] = tuple(escaped(s, f"--stop {s!r}") for s in params["stop"])
    from ..waiting import hidden

    with hidden() if as_json else contextlib.nullcontext():  # JSON is for a program to read: no spinner on stderr
        engine, _ = load_engine(params, truncate_prompt=truncate_prompt, context_shift=context_shift)
        try:
            templated = not raw and (chat or system is not None or engine.has_chat_template)
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            _stream(engine, messages if templated else prompt, show_stats, as_json, bool(colour))
        finally:
            engine.close()


def _batch(batch_path: str, output: str | None, parallel: int, as_json: bool, **run_args: Any) -> None:
    """generate --batch: every prompt of `batch_path` to `output` (batch_jobs.run_batch, with `run_args`); exits
    with run_batch's code when it is not 0."""
    if as_json:
        raise click.UsageError("--batch writes JSON lines to -o already: leave out --json.")
    if output is None:
        raise click.UsageError("--batch needs -o OUT.jsonl, the file each prompt's result goes to (and a rerun "
                               "resumes from).")
    from ..batch_jobs import run_batch

    code = run_batch(batch_path=batch_path, output=output, parallel=parallel, load_engine=load_engine, **run_args)
    if code:
        sys.exit(code)


def _stream(engine: SpeculativeEngine, prompt: str | list[dict[str, str]], show_stats: bool, as_json: bool,
            colour: bool) -> None:
    """generate's one answer: streamed to stdout (the draft tokens the target kept in a second colour with
    `colour`), or one JSON object; the stats line, a full context's note; Ctrl-C exits 130 after both."""
    from ..terminal_chat import DRAFT_COLOUR, RESET

    try:
        for r in engine.stream(prompt):
            if not as_json and r.text:
                sys.stdout.write(f"{DRAFT_COLOUR}{r.text}{RESET}" if colour and r.from_draft else r.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        _finish(engine.last_result, show_stats, as_json)
        sys.exit(EXIT_INTERRUPTED)
    _finish(engine.last_result, show_stats, as_json)
    if engine.last_result is not None and engine.last_result.stop_reason == "length" and not as_json:
        click.echo(f"(stopped: the context of {engine.n_ctx} tokens is full; raise -c/--ctx-size, or go on past it "
                   "with --context-shift)", err=True)


def _finish(result: GenerationResult | None, show_stats: bool, as_json: bool) -> None:
    """The end of generate's answer, if any: the JSON object with `as_json`, else the newline after the streamed
    text; then the stats line on stderr with `show_stats`."""
    if result is None:
        return
    if as_json:
        click.echo(json.dumps({
            "text": result.text, "tokens": result.tokens, "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict(),
        }))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if show_stats:
        click.echo(result.stats.line(), err=True)


@click.command()
@options_for("chat")
def chat(system: str | None, colour: bool | None, show_stats: bool, **params: Any) -> None:
    """Chat with a model in the terminal: history kept, the KV cache of earlier turns reused, answers streamed.

    Commands: /help, /reset, /stats, /exit. Ctrl-C stops an answer, Ctrl-D exits."""
    from ..terminal_chat import run_chat, use_colour

    engine, settings = load_engine(params, default_method="auto")
    with engine:
        if not engine.has_chat_template:
            raise GGUFSpecError(f"{engine.target.path} has no chat template (tokenizer.chat_template): "
                                "use `ggufspec generate` for plain completion.")
        click.echo(f"ggufspec chat: {engine.describe(settings)}", err=True)
        run_chat(engine, settings, system, use_colour(colour, sys.stdout), show_stats)
