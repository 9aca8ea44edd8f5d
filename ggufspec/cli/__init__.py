"""The `ggufspec` command line. Exit codes: 0 done, 1 failed (an RPC server went away), 2 usage or bad input, 130
interrupted."""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import click

from ..errors import EXIT_INTERRUPTED, GGUFSpecError
from ..kv_types import KV_TYPES
from ..methods import METHODS, get_method, methods_help

F = TypeVar("F", bound=Callable[..., Any])


class Group(click.Group):
    """Turns ggufspec's errors into one clear line on stderr and exit code 2, and Ctrl-C into one line and 130."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GGUFSpecError as e:
            sys.stdout.flush()  # the text so far before the reason it stops
            click.echo(f"error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:  # click alone would print "Aborted!" and exit 1
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except ValueError as e:  # settings dataclasses validate their values
            raise click.UsageError(str(e)) from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ggufspec")
def main() -> None:
    """Speculative decoding for GGUF models on llama.cpp: the target's own text, faster."""


class MaxTokens(click.ParamType):
    """-n/--max-tokens: at least 1, or -1 (llama.cpp's "until the context ends"), which gives None."""

    name = "integer"

    def convert(self, value, param, ctx) -> int | None:
        if value is None or isinstance(value, int) and value >= 1:
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of tokens", param, ctx)
        if n == -1:
            return None
        if n < 1:
            self.fail(f"{n}: give at least 1 token, or -1 for up to the end of the context", param, ctx)
        return n


class ByteSize(click.ParamType):
    """A size in bytes: 1048576, 512k, 8M, 1G (powers of 1024)."""

    name = "size"
    _UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removesuffix("b").removesuffix("i")
        unit = text[-1:] if text[-1:] in self._UNITS else ""
        number = text[: len(text) - len(unit)]
        if not number.isdigit() or int(number) < 1:
            self.fail(f"{value!r} is not a size: give bytes, or a number with k, M or G", param, ctx)
        return int(number) * self._UNITS[unit]


Settings = Mapping[str, Any]  # click.option's keyword arguments; in a command's own settings also "decls"


@dataclass(frozen=True)
class Option:
    """One option of the table: its click declarations and settings, the commands it serves, and the settings a
    command gives it instead (its own help, default, or fewer spellings)."""

    decls: tuple[str, ...]
    serves: frozenset[str]
    settings: Settings
    per: Mapping[str, Settings]

    def click_option(self, command: str) -> Callable[[F], F]:
        own = dict(self.per.get(command, {}))
        return click.option(*own.pop("decls", self.decls), **{**self.settings, **own})


def option(*decls: str, serves: Iterable[str], per: Mapping[str, Settings] | None = None, **settings: Any) -> Option:
    """An entry of OPTIONS: click.option's declarations and settings, the commands it serves, their own settings."""
    opt = Option(decls, frozenset(serves), settings, per or {})
    if not opt.per.keys() <= opt.serves:
        raise ValueError(f"{decls}: settings for commands it does not serve: {set(opt.per) - opt.serves}")
    return opt


def _answer_length(default: int | None) -> Settings:
    """-n of a command that answers, by default with `default` tokens (None: up to the end of the context)."""
    return dict(default=default, show_default=default is not None,
                help="Most tokens per answer; -1: up to the end of the context" + ("." if default else " (the default)."))


#: llama.cpp's --spec-type names (common/speculative.cpp) and the method that drafts so here; a list naming both a
#: draft model and n-grams is `auto`, which drafts from both where that pays.
SPEC_TYPES: Mapping[str, str] = {
    "none": "autoregressive", "draft-simple": "vanilla", "draft-mtp": "mtp",
    **dict.fromkeys(("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"), "lookup"),
}
#: ... and the ones with no counterpart here: what each drafts with
SPEC_TYPES_ELSEWHERE: Mapping[str, str] = {
    "draft-eagle3": "EAGLE-3 heads",
    "draft-dflash": "DFlash drafts", "draft-dspark": "DSpark drafts",
}


class SpecType(click.ParamType):
    """--spec-type, llama.cpp's comma list of speculative types: the method here that drafts as they do."""

    name = "TYPE[,TYPE]"

    def convert(self, value, param, ctx) -> str:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        for n in names:
            if n in SPEC_TYPES_ELSEWHERE:
                self.fail(f"{n}: ggufspec does not draft with {SPEC_TYPES_ELSEWHERE[n]}; use a draft model (-md "
                          "DRAFT.gguf, draft-simple), n-grams (ngram-mod), the model's MTP head (draft-mtp) or Medusa "
                          "heads (--method medusa --medusa HEADS.gguf)", param, ctx)
            if n not in SPEC_TYPES:
                self.fail(f"{n!r} is none of llama.cpp's types that ggufspec runs: {', '.join(SPEC_TYPES)}", param, ctx)
        if not names:
            self.fail(f"give one or more of {', '.join(SPEC_TYPES)}, separated by commas", param, ctx)
        methods = {SPEC_TYPES[n] for n in names} - {"autoregressive"} or {"autoregressive"}  # `none` adds nothing
        return "auto" if len(methods) > 1 else methods.pop()


class ChatTemplateName(click.ParamType):
    """--chat-template: one of llama.cpp's built-in template names, or a Jinja template (chat.template_override)."""

    name = "NAME|JINJA"

    def convert(self, value, param, ctx):
        from ..chat import template_override

        if not isinstance(value, str):
            return value
        try:
            return template_override(value)
        except GGUFSpecError as e:
            self.fail(str(e), param, ctx)


def _refusal(why: str) -> Callable[[click.Context, click.Parameter, bool], None]:
    """The callback of a refused flag: when given, one usage error naming it and `why` (what to use instead)."""
    def refuse(ctx: click.Context, param: click.Parameter, given: bool) -> None:
        if given:
            raise click.UsageError(f"{'/'.join(param.opts)}: {why}.", ctx)
    return refuse


def accepted(*decls: str, serves: Iterable[str], why: str) -> Option:
    """A llama.cpp flag that asks for what this command always does: taken, and it changes nothing (`why`)."""
    return option(*decls, serves=serves, is_flag=True, expose_value=False, help=f"As llama.cpp's; no effect: {why}.")


def refused(*decls: str, serves: Iterable[str], why: str) -> Option:
    """A llama.cpp flag with no counterpart in this command: refused with one line, `why`, that says what to use
    instead (not in --help; without it click would misread the flag, e.g. -cnv as -c nv)."""
    return option(*decls, serves=serves, is_flag=True, expose_value=False, hidden=True, callback=_refusal(why))


GENERATION = frozenset({"generate", "chat", "serve"})  # the commands that answer
RUNS = GENERATION | {"bench"}  # ... and the one that times them
LOADS = RUNS | {"doctor"}  # every command that opens llama.cpp contexts

#: Every option of generate, chat, serve, bench and doctor, declared once, tagged with the commands it serves (as
#: llama.cpp's common/arg.cpp tags its options with the tools they serve). A command's help lists its options in this
#: order. An option means the same in every command it serves: where a command gives it other settings (help, default,
#: fewer spellings), `per` says so here; a flag that means something else in another command is another entry.
OPTIONS: tuple[Option, ...] = (
    # what generate, chat and serve take besides the models
    option("-p", "--prompt", "prompt_option", serves={"generate"}, metavar="TEXT", default=None,
           help="The prompt, as llama-cli takes it (instead of the PROMPT argument)."),
    option("-f", "--file", "prompt_file", serves={"generate"}, type=click.File("rb"), default=None,
           help="Read the prompt from a file (`-`: standard input)."),
    option("-e", "--escape/--no-escape", "escape", serves={"generate"}, default=False,
           help="Turn \\n, \\r, \\t, \\', \\\", \\\\ and \\xNN in the prompt and --stop strings into the characters "
                "they name, as llama-cli does (there by default)."),
    option("--chat", serves={"generate"}, is_flag=True,
           help="Wrap the prompt in the model's chat template (the default when it has one)."),
    option("--raw", serves={"generate"}, is_flag=True,
           help="Plain completion: the prompt as it is, without the chat template."),
    option("--system", "-sys", "--system-prompt", "system", serves={"generate", "chat"}, default=None,
           help="System message.", per={"generate": dict(help="System message (implies --chat).")}),
    option("--chat-template", "chat_template", serves=GENERATION, type=ChatTemplateName(), default=None,
           help="Render chat messages with one of llama.cpp's built-in templates (chatml, llama3, gemma, mistral-v7, "
                "phi4, ...: the list is in the error for an unknown name) or with this Jinja template, instead of the "
                "model's."),
    accepted("--jinja", serves=GENERATION, why="chat templates are always rendered as Jinja here"),
    accepted("-cnv", "--conversation", serves={"chat"}, why="chat is one"),
    refused("-cnv", "--conversation", serves={"generate"},
            why="llama-cli's conversation mode is `ggufspec chat` here (generate answers one prompt)"),
    accepted("-no-cnv", "--no-conversation", serves={"generate"}, why="generate answers one prompt"),
    refused("-no-cnv", "--no-conversation", serves={"chat"},
            why="chat is a conversation; one prompt without one is `ggufspec generate`"),
    option("--truncate-prompt", serves={"generate"}, is_flag=True,
           help="Keep the end of a prompt that does not fit the context."),
    option("--context-shift", serves={"generate"}, is_flag=True,
           help="When the context is full, drop the older half of the text after the prompt's start and go on."),
    option("--color/--no-color", "colour", serves={"chat", "generate"}, default=None,
           help="Show draft tokens the target kept in a second colour (default: on in a terminal, off with NO_COLOR).",
           per={"generate": dict(help="Show draft tokens the target kept in a second colour, as chat does "
                                      "(default: off).")}),
    option("--stats", "show_stats", serves={"generate", "chat"}, is_flag=True, help="Print a stats line to stderr.",
           per={"chat": dict(help="Print a stats line to stderr after every answer.")}),
    option("--json", "as_json", serves={"generate"}, is_flag=True,
           help="Print one JSON object (text, tokens, stats) instead of streaming."),
    option("--batch", "batch_path", serves={"generate"}, type=click.Path(dir_okay=False), default=None,
           metavar="FILE",
           help="Generate every prompt of FILE, one a line: text, or JSON objects with `prompt`, `messages` or "
                "`turns` (and an id: `custom_id`, `id`, `question_id`, `task_id`); results go to -o as JSON lines. "
                "Resumable: a rerun keeps the prompts already done there."),
    option("-o", "--output", serves={"generate"}, type=click.Path(dir_okay=False), default=None,
           help="With --batch: the JSONL file each prompt's result is appended to as it finishes (id, index, text, "
                "finish_reason, usage, timings; or error)."),
    option("--host", serves={"serve"}, default="127.0.0.1", show_default=True, help="Address to listen on."),
    option("--port", serves={"serve"}, type=click.IntRange(0, 65535), default=8080, show_default=True,
           help="Port (0: any free one)."),
    option("--api-key", serves={"serve"}, envvar="GGUFSPEC_API_KEY", default=None,
           help="Require `Authorization: Bearer KEY` on /v1 (also GGUFSPEC_API_KEY)."),
    option("--queue", serves={"serve"}, type=click.IntRange(min=0), default=16, show_default=True,
           help="Requests that may wait while every slot is busy; more get HTTP 429."),
    option("-a", "--alias", serves={"serve"}, default=None,
           help="Model name to report (default: the target's file name); any name a client sends is answered."),
    option("-np", "--parallel", serves={"serve", "generate"}, type=click.IntRange(min=1), default=1, show_default=True,
           help="Slots: requests decoded at once, batched together (others wait in --queue). -c is the whole KV "
                "cache, split evenly: each slot holds n_ctx / N tokens, as in llama-server.",
           per={"generate": dict(help="With --batch: prompts generated at once (slots; -c is then the whole cache, "
                                      "each slot holds n_ctx / N tokens).")}),
    option("--max-body", serves={"serve"}, type=ByteSize(), default=None,
           help="Largest request body (413 past it), e.g. 4M (default: 1 MiB plus 64 bytes per token of --n-ctx)."),
    option("-to", "--timeout", serves={"serve"}, type=click.FloatRange(min=0.1), default=60.0, show_default=True,
           help="Seconds a client has to send a request, and to take each chunk of its answer."),
    option("--allowed-host", "allowed_hosts", serves={"serve"}, multiple=True, metavar="NAME",
           help="Also accept requests whose Host header is NAME (repeatable; '*': any). IP addresses, localhost "
                "and this machine's name always are; other names are refused against DNS rebinding."),
    option("--cors-origin", "cors_origins", serves={"serve"}, multiple=True, metavar="ORIGIN",
           help="Let web pages at ORIGIN (e.g. http://localhost:3000) call the server (repeatable; '*': any). "
                "Default: none."),
    # the models
    option("-m", "--model", "target", serves=LOADS, type=click.Path(dir_okay=False), default=None,
           help="Target GGUF (default: the --preset's, else the offline `demo` preset).",
           per={"bench": dict(help="Target GGUF (default: the --preset's, else the offline `demo` preset, its target "
                                   "and draft)."),
                "doctor": dict(help="A model to load and describe.")}),
    option("-d", "-md", "--draft", "--model-draft", "draft", serves=LOADS, type=click.Path(dir_okay=False),
           default=None, help="Draft GGUF (same vocabulary).",
           per={"bench": dict(decls=("-d", "--draft"), help="Draft GGUF (default without -m: the preset's)."),
                "doctor": dict(decls=("-d", "--draft"), help="A draft model to describe too.")}),
    option("--preset", serves=RUNS, default=None,
           help="A named pair from `ggufspec models`, fetched from the hub when needed.",
           per={"bench": dict(help="A named pair from `ggufspec models` (target, draft or heads), fetched from the hub "
                                   "when needed.")}),
    # what bench runs
    option("-p", "--prompts", "prompts_path", serves={"bench"}, default=None, type=click.Path(dir_okay=False),
           help="Prompts, one a line, as `generate --batch` reads them: text, or JSON objects with `prompt` "
                "(HumanEval: a completion), `turns` (Spec-Bench) or `messages` (chat), an id and a `category`. "
                "Default: a built-in set of 8 short prompts (coding, math, writing, summarization, extraction, "
                "translation)."),
    option("--limit", serves={"bench"}, type=click.IntRange(min=1), default=None, help="Use the first N prompts."),
    option("--per-category", serves={"bench"}, type=click.IntRange(min=1), default=None,
           help="Use the first N prompts of each category (before --limit)."),
    # decoding
    option("--method", serves=GENERATION, type=click.Choice(list(METHODS)), default=None,
           help=f"{methods_help()}. Default: auto.",
           per={"generate": dict(help=f"{methods_help()}. Default: auto with a draft, --medusa or a model's MTP head, "
                                      "else autoregressive.")}),
    option("--spec-type", "spec_type", serves=GENERATION, type=SpecType(), default=None,
           help="llama.cpp's speculative types, as the method that drafts so here: ngram-* is lookup, draft-simple "
                "vanilla, draft-mtp mtp, several (a comma list) auto, none autoregressive."),
    option("--method", "methods", serves={"bench"}, multiple=True, type=click.Choice(list(METHODS)),
           help="Methods to compare (repeatable; default: autoregressive, vanilla with a draft, medusa with --medusa "
                "heads, mtp with a model's MTP head, and auto; with none of them: autoregressive and auto, which is "
                "prompt lookup where it pays)."),
    option("--temp", "temps", serves={"bench"}, multiple=True, type=click.FloatRange(min=0),
           help="Temperatures (repeatable; default 0)."),
    option("-n", "--max-tokens", "--n-predict", "max_tokens", serves=RUNS, type=MaxTokens(),
           per={"generate": _answer_length(256), "chat": _answer_length(1024), "serve": _answer_length(None),
                "bench": dict(decls=("-n", "--max-tokens"), type=click.IntRange(min=1), default=128, show_default=True)}),
    option("--repeats", serves={"bench"}, type=click.IntRange(min=1), default=3, show_default=True),
    option("--warmup", serves={"bench"}, type=click.IntRange(min=0), default=1, show_default=True),
    option("--temp", serves=GENERATION, type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy."),
    option("--top-k", serves=GENERATION, type=click.IntRange(min=0), default=0, show_default=True, help="0: off."),
    option("--top-p", serves=GENERATION, type=float, default=1.0, show_default=True, help="In (0, 1]; 1: off."),
    option("--min-p", serves=GENERATION, type=float, default=0.0, show_default=True, help="In [0, 1]; 0: off."),
    option("-s", "--seed", serves=RUNS, type=int, default=None,
           help="Seed for sampling (same seed, same text); -1 or none: random.",
           per={"bench": dict(decls=("--seed",), default=0, show_default=True, help=None)}),  # runs that repeat
    option("--draft-max", "--draft-n", "draft_max", serves=RUNS, type=click.IntRange(min=1), default=4,
           show_default=True, help="Most tokens drafted per step.",
           per={"bench": dict(decls=("--draft-max",), help=None)}),
    option("--draft-p-min", serves=RUNS, type=click.FloatRange(0, 1), default=0.0, show_default=True,
           help="Stop drafting when the draft's top probability falls under this.", per={"bench": dict(help=None)}),
    option("--medusa", "medusa_path", serves=RUNS, type=click.Path(dir_okay=False), default=None,
           help="Medusa heads GGUF trained for this target (`ggufspec medusa train`, `ggufspec convert medusa`).",
           per={"bench": dict(help="Medusa heads GGUF for --method medusa.")}),
    option("--tree", "medusa_tree", serves=RUNS, default=None,
           help="Medusa candidate tree: mc_sim_7b_63, mc_sim_31, mc_sim_15, chain_4, or a JSON file of choices "
                "(default: the tree stored with the heads by `medusa train`, else mc_sim_7b_63).",
           per={"bench": dict(help="Medusa candidate tree (see `generate --help`).")}),
    option("--medusa-vocab", "medusa_vocab", serves=RUNS, metavar="N|FILE", default=None,
           help="Medusa heads propose only from a restricted candidate vocabulary: the N lowest token ids (BPE ids "
                "follow merge order, roughly frequency) or the ids in FILE (JSON list, or integers separated by "
                "spaces/commas/newlines); the target's special tokens always stay in. Much cheaper heads; output "
                "unchanged (the target verifies), only acceptance may drop. Default: the whole vocabulary.",
           per={"bench": dict(help="Medusa's restricted candidate vocabulary (see `generate --help`).")}),
    option("--typical", serves=GENERATION, is_flag=True,
           help="Medusa at --temp > 0: typical acceptance (threshold 0.09, alpha 0.3), faster but NOT exact: the text "
                "no longer follows the target's sampling distribution. Without it Medusa samples exactly; at --temp 0 "
                "it is greedy."),
    option("--stop", "-r", "--reverse-prompt", "stop", serves=GENERATION, multiple=True, help="Stop string (repeatable)."),
    option("--ignore-eos", serves={"generate", "serve"}, is_flag=True,
           help="Never pick an end-of-generation token (as llama.cpp's --ignore-eos): run to -n tokens (a --stop "
                "string still ends it), from the target's distribution over the other tokens. For benchmarks of "
                "equal lengths.",
           per={"serve": dict(help="Requests that leave out ignore_eos never pick an end-of-generation token "
                                   "(llama.cpp's --ignore-eos).")}),
    # what bench does with the runs
    option("--fresh-context", "fresh", serves={"bench"}, is_flag=True,
           help="Empty the KV caches before every run: no prefix reuse, so every method sees the same KV layout."),
    option("-o", "--output", serves={"bench"}, type=click.Path(dir_okay=False), default=None,
           help="Write all runs and the summary as JSON."),
    option("--plot", "plot_prefix", serves={"bench"}, type=click.Path(dir_okay=False), default=None,
           help="Write PREFIX-speedup.png and PREFIX-acceptance.png (needs matplotlib: pip install 'ggufspec[plot]')."),
    option("--replay", serves={"bench"}, is_flag=True,
           help="Instead of timing runs: record each prompt's greedy text and the draft's guesses once, then price "
                "autoregressive, vanilla, lookup, auto and a per-step oracle with the measured cost model."),
    # llama.cpp contexts (the arguments of decoder_options)
    option("-c", "--n-ctx", "--ctx-size", "n_ctx", serves=LOADS, type=click.IntRange(min=1), default=4096,
           show_default=True, help="Context size in tokens."),
    option("-b", "--n-batch", "--batch-size", "n_batch", serves=LOADS, type=click.IntRange(min=1), default=512,
           show_default=True, help="Prefill chunk size."),
    option("-ub", "--n-ubatch", "--ubatch-size", "n_ubatch", serves=LOADS, type=click.IntRange(min=1), default=None,
           help="Most tokens llama.cpp computes at once (default: 64 on CPU, where more costs memory and gains no "
                "speed; --n-batch with GPU layers)."),
    option("-t", "--threads", serves=LOADS, type=click.IntRange(min=1), default=None,
           help="CPU threads (default: all cores)."),
    option("-tb", "--threads-batch", serves=LOADS, type=click.IntRange(min=1), default=None,
           help="CPU threads for batches."),
    option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", serves=LOADS, type=int, default=0,
           show_default=True,
           help="Layers to offload to Metal/CUDA (-1: all); ignored, with a warning, by a build without them."),
    option("--rpc", "rpc", serves=LOADS, metavar="HOST:PORT[,...]", default=None,
           help="Put the target's layers on llama.cpp RPC servers (`ggufspec rpc-server` on each machine), in this "
                "order; -ngl N sends N layers there and keeps the rest here (default: all). The draft model, Medusa "
                "heads and lookup stay on this machine. Needs llama.cpp built with RPC (README)."),
    option("-ts", "--tensor-split", "tensor_split", serves=LOADS, metavar="W0,W1,...", default=None,
           help="How to share the offloaded layers between the devices (RPC servers, GPUs), as weights: 3,1 puts "
                "three quarters on the first."),
    option("--rpc-draft", serves=LOADS, is_flag=True, help="The draft model goes to the --rpc servers too."),
    option("--rpc-timeout", serves=LOADS, type=click.FloatRange(min=0, min_open=True), default=60.0,
           show_default=True, help="Seconds one model pass may wait on the RPC servers before they are taken for gone."),
    option("--no-mmap", serves=LOADS, is_flag=True, help="Read the model into memory instead of mapping it."),
    option("--mlock", serves=LOADS, is_flag=True, help="Lock the model in RAM."),
    option("--no-repack", serves=LOADS, is_flag=True,
           help="Keep weights in llama.cpp's plain CPU layout (slower verify batches; for comparisons)."),
    option("--flash-attn/--no-flash-attn", serves=LOADS, default=None,
           help="Flash attention (default: llama.cpp decides)."),
    option("-fa", "fa", serves=LOADS, type=click.Choice(("on", "off", "auto")), default=None,
           help="Flash attention as llama.cpp spells it: on, off or auto (the default)."),
    option("--kv-type", serves=LOADS, type=click.Choice(KV_TYPES), default=None,
           help="KV cache type, K and V (default on CPU: q8_0 K, where a verify batch then gives plain decoding's "
                "logits bit for bit, and q8_0 or f16 V, whichever this CPU reads faster, measured once; f16, "
                "llama.cpp's default, with GPU layers or --no-flash-attn)."),
    option("-ctk", "--cache-type-k", "kv_type_k", serves=LOADS, type=click.Choice(KV_TYPES), default=None,
           help="K cache type alone (default: as --kv-type)."),
    option("-ctv", "--cache-type-v", "--kv-type-v", "kv_type_v", serves=LOADS, type=click.Choice(KV_TYPES),
           default=None, help="V cache type alone (default: as --kv-type)."),
    option("-v", "--verbose", serves=LOADS, is_flag=True, help="Show llama.cpp's log lines."),
    option("--log-disable", serves=LOADS, is_flag=True,
           help="No llama.cpp log lines, as llama.cpp's (they are off already unless -v, which this overrides)."),
    option("--no-memory-check", serves=LOADS, is_flag=True, help="Load even when weights + KV exceed the free RAM."),
)


def options_for(command: str) -> Callable[[F], F]:
    """Decorator: the options of OPTIONS that serve `command`, in the table's order, with the command's settings."""
    def decorate(f: F) -> F:
        for opt in reversed(OPTIONS):
            if command in opt.serves:
                f = opt.click_option(command)(f)
        return f
    return decorate


def decoder_options(n_ctx, n_batch, n_ubatch, threads, threads_batch, n_gpu_layers, rpc, tensor_split, rpc_draft,
                    rpc_timeout, no_mmap, mlock, no_repack, flash_attn, fa, kv_type, kv_type_k, kv_type_v, verbose,
                    log_disable, no_memory_check):
    from ..decoder import DecoderOptions, gpu_offload
    from ..rpc import parse_endpoints, require

    endpoints = ()
    if rpc is not None:
        require()  # one error line naming the build flags, before anything loads
        endpoints = tuple(map(str, parse_endpoints(rpc)))
    elif rpc_draft:
        raise click.UsageError("--rpc-draft needs --rpc.")
    split = ()
    if tensor_split is not None:
        try:
            split = tuple(float(w) for w in tensor_split.replace("/", ",").split(","))
        except ValueError:
            raise click.UsageError(f"--tensor-split takes weights like 3,1; got {tensor_split!r}.") from None

    if fa is not None:
        if flash_attn is not None and flash_attn != (fa == "on"):
            raise click.UsageError(f"-fa {fa} contradicts --{'' if flash_attn else 'no-'}flash-attn.")
        flash_attn = {"on": True, "off": False, "auto": None}[fa]
    if n_gpu_layers != 0 and not gpu_offload() and not endpoints:  # as llama.cpp: a warning, the CPU's defaults stay
        click.echo(f"warning: -ngl {n_gpu_layers} is ignored: this llama.cpp build has no GPU backend (reinstall "
                   "llama-cpp-python with CMAKE_ARGS for CUDA or Metal, see README); running on the CPU", err=True)
        n_gpu_layers = 0
    try:
        return DecoderOptions(
            n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads, n_threads_batch=threads_batch,
            n_gpu_layers=n_gpu_layers, rpc=endpoints, tensor_split=split, rpc_draft=rpc_draft, rpc_timeout=rpc_timeout,
            use_mmap=not no_mmap, use_mlock=mlock, repack=not no_repack, flash_attn=flash_attn,
            kv_type=kv_type, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
            verbose=verbose and not log_disable,  # as llama.cpp, where --log-disable pauses the log whatever -v says
            memory_check=not no_memory_check,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


_GENERATION_KEYS = ("target", "draft", "preset", "method", "max_tokens", "temp", "top_k", "top_p", "min_p", "seed",
                    "draft_max", "draft_p_min", "medusa_path", "medusa_tree", "medusa_vocab", "typical", "stop")
_MODEL_KEYS = tuple(inspect.signature(decoder_options).parameters)


def load_engine(params: dict, default_method: str | None = None, parallel: int | None = None, **settings_extra):
    """The engine and settings of generate's, chat's and serve's shared options (taken out of `params`): a preset
    resolved and fetched, the combination checked, the models loaded; default_method when none is given (None: the
    engine's). With `parallel`, an EnginePool of that many slots instead of one engine (-c is then the whole cache,
    as llama-server's: each slot holds n_ctx // parallel tokens)."""
    from ..engine import GenerationSettings, SpeculativeEngine
    from ..sampling import SamplingParams

    g = {k: params.pop(k) for k in _GENERATION_KEYS}
    ignore_eos = params.pop("ignore_eos", False)  # generate's and serve's (a chat turn would never end)
    template = params.pop("chat_template")
    options = decoder_options(**{k: params.pop(k) for k in _MODEL_KEYS})
    method = _spec_method(g["method"], params.pop("spec_type"))
    target, draft, medusa_path, draft_max = g["target"], g["draft"], g["medusa_path"], g["draft_max"]
    if target is None:
        target, draft, medusa_path, method, draft_max = _from_preset(g["preset"] or "demo", draft, medusa_path, method,
                                                                     draft_max, gpu=options.offloads)
    elif g["preset"] is not None:
        raise click.UsageError("give either --preset NAME or -m TARGET.gguf, not both.")
    method = method or default_method
    if method is not None:
        _check_method(method, draft, medusa_path)
    medusa_vocab = _medusa_vocab(g["medusa_vocab"], medusa_path)
    settings = GenerationSettings(
        max_tokens=g["max_tokens"] or options.n_ctx, sampling=SamplingParams(g["temp"], g["top_k"], g["top_p"], g["min_p"]),
        method=method, draft_max=draft_max, draft_p_min=g["draft_p_min"], seed=g["seed"], stop=tuple(g["stop"]),
        medusa_tree=g["medusa_tree"], typical=g["typical"], ignore_eos=ignore_eos, **settings_extra,
    )
    if parallel is not None:
        from ..pool import EnginePool

        pool = EnginePool.load(target, draft, options, settings, medusa_path, medusa_vocab, parallel=parallel)
        for slot in pool.slots:
            slot.engine.chat_template = template or slot.engine.chat_template
        return pool, settings
    engine = SpeculativeEngine.load(target, draft, options, settings, medusa_path=medusa_path, medusa_vocab=medusa_vocab)
    engine.chat_template = template or engine.chat_template  # --chat-template over the GGUF's
    return engine, settings


def _spec_method(method: str | None, spec_method: str | None) -> str | None:
    """--method, or the method --spec-type (llama.cpp's spelling, SpecType) asks for; both must agree."""
    if spec_method is not None and method is not None and spec_method != method:
        raise click.UsageError(f"--spec-type asks for --method {spec_method} here, which contradicts --method "
                               f"{method}: give one of them.")
    return spec_method or method


def _medusa_vocab(value: str | None, medusa_path: str | None) -> int | str | None:
    """--medusa-vocab as SpeculativeEngine.load takes it: a number of ids, or a file of ids."""
    if value is not None and medusa_path is None:
        raise click.UsageError("--medusa-vocab restricts Medusa heads: give them with --medusa HEADS.gguf (or a Medusa --preset)")
    return int(value) if value is not None and value.strip().lstrip("+-").isdigit() else value


@main.command()
@click.argument("prompt", required=False)
@options_for("generate")
def generate(prompt, prompt_option, prompt_file, escape, chat, raw, system, truncate_prompt, context_shift, colour,
             show_stats, as_json, batch_path, output, parallel, **params) -> None:
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
        if as_json:
            raise click.UsageError("--batch writes JSON lines to -o already: leave out --json.")
        if output is None:
            raise click.UsageError("--batch needs -o OUT.jsonl, the file each prompt's result goes to (and a rerun "
                                   "resumes from).")
        from ..batch_jobs import run_batch

        code = run_batch(batch_path=batch_path, output=output, parallel=parallel, chat=chat, raw=raw, system=system,
                         show_stats=show_stats, truncate_prompt=truncate_prompt, context_shift=context_shift,
                         params=params, load_engine=load_engine)
        if code:
            sys.exit(code)
        return
    if output is not None:
        raise click.UsageError("-o/--output is where --batch writes its results: give --batch PROMPTS.jsonl too "
                               "(one prompt prints to stdout; --json gives it as JSON).")
    if parallel != 1:
        raise click.UsageError(f"--parallel {parallel} generates several prompts at once with --batch; one prompt "
                               "runs in one slot.")
    if as_json and colour:
        raise click.UsageError("--color colours the streamed text, and --json streams none: leave out one of them.")
    prompt = _prompt_text(prompt, prompt_option, prompt_file, escape)
    if escape:  # as llama.cpp, which processes the reverse prompts' escapes too
        params["stop"] = tuple(_escaped(s, f"--stop {s!r}") for s in params["stop"])
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


def _stream(engine, prompt, show_stats: bool, as_json: bool, colour: bool) -> None:
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


# -e/--escape: llama.cpp's string_process_escapes (common/common.cpp). A backslash before one of these gives its byte;
# before x and two hex digits, the byte they spell; before anything else (and at the end) it stays, as does that.
ESCAPES: Mapping[int, int] = {ord(k): ord(v) for k, v in (("n", "\n"), ("r", "\r"), ("t", "\t"), ("'", "'"),
                                                            ('"', '"'), ("\\", "\\"))}
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(data: bytes) -> bytes:
    """`data` with its escapes processed as llama.cpp's -e does (ESCAPES); bytes in, bytes out, since \\xNN may
    spell part of a UTF-8 character."""
    out, i = bytearray(), 0
    while i < len(data):
        c, nxt = data[i], data[i + 1] if i + 1 < len(data) else None
        if c != ord("\\") or nxt is None:
            out.append(c)
            i += 1
        elif nxt in ESCAPES:
            out.append(ESCAPES[nxt])
            i += 2
        elif nxt == ord("x") and len(data) > i + 3 and {data[i + 2], data[i + 3]} <= HEX_DIGITS:
            out.append(int(data[i + 2:i + 4], 16))
            i += 4
        else:
            out += data[i:i + 2]
            i += 2
    return bytes(out)


def _escaped(text: str, where: str) -> str:
    """`text` with its escapes processed; a usage error when they spell bytes that are not UTF-8."""
    data = process_escapes(text.encode("utf-8", "surrogateescape"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{where}: with -e its escapes give byte 0x{data[e.start]:02x} at offset {e.start}, "
                               "which is not UTF-8 text.") from None


def _prompt_text(argument: str | None, option: str | None, file, escape: bool = False) -> str:
    """The one prompt given as PROMPT, -p or -f (`-` as PROMPT or FILE: standard input), its escapes processed with
    `escape` (-e), checked to be UTF-8 text (Python hands undecodable bytes of argv and stdin on as surrogates, which
    fail later, far from the input)."""
    given = [x for x in (argument, option, file) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give the prompt once: as PROMPT, -p TEXT or -f FILE." if given else
                               "no prompt: give it as PROMPT, -p TEXT or -f FILE (`-` reads standard input).")
    if argument == "-":
        data, where = sys.stdin.buffer.read(), "standard input"
    elif file is not None:
        data, where = file.read(), "standard input" if file.name in ("<stdin>", "-") else file.name
    else:
        text = argument if argument is not None else option
        data, where = text.encode("utf-8", "surrogateescape"), "the prompt"
    if escape:
        data, where = process_escapes(data), f"{where} (its escapes processed)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFSpecError(f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                            f"(convert it first, e.g. iconv -f LATIN1 -t UTF-8)") from None
    if not text.strip():
        raise click.UsageError("the prompt is empty.")
    return text


@main.command()
@options_for("chat")
def chat(system, colour, show_stats, **params) -> None:
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


@main.command()
@options_for("serve")
def serve(host, port, api_key, queue, alias, parallel, max_body, timeout, allowed_hosts, cors_origins, **params) -> None:
    """An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /health, /slots.

    Up to --parallel requests generate at once (continuous batching: their decodes share llama.cpp batches), each
    in a slot of n_ctx / N tokens. Each request may override sampling and speculation
    (`"speculative": {"method": "vanilla", "draft_max": 3}`). Needs the server extra: pip install 'ggufspec[server]'."""
    try:
        from ..server import Limits, serve as run_server
        from ..server.boundary import default_max_body, default_max_connections
    except ImportError as e:
        if (e.name or "").partition(".")[0] == "ggufspec":  # a fault of ours, not a missing extra
            raise
        raise GGUFSpecError(f"`ggufspec serve` needs the server extra ({e.name} is missing): "
                            "pip install 'ggufspec[server]'") from None

    pool, settings = load_engine(params, default_method="auto", parallel=parallel)  # --parallel 1: one slot
    with pool:
        engine = pool.engine  # slot 0's: n_ctx is a slot's, the longest prompt plus answer
        limits = Limits(max_body=max_body or default_max_body(engine.n_ctx * pool.parallel), timeout=timeout,
                        max_connections=default_max_connections(), allowed_hosts=frozenset(allowed_hosts),
                        cors_origins=tuple(cors_origins))
        run_server(pool, settings, alias or engine.target.path.name, host, port, queue, api_key, limits,
                   lambda line: click.echo(line, err=True))


def _has_mtp(target: str) -> bool:
    """Whether the target's MTP head can draft here (mtp.py)."""
    from ..gguf_check import read_header
    from ..mtp import unavailable

    path = Path(target).expanduser()
    return unavailable(read_header(path), path.name) is None


def _check_method(method: str, draft: str | None, medusa_path: str | None) -> None:
    try:
        get_method(method, draft is not None, medusa_path is not None)
    except GGUFSpecError as e:
        raise click.UsageError(str(e)) from None


def _preset(name: str, draft_max: int, gpu: bool):
    """A preset, its files resolved (fetched as needed) for a GPU/Metal or CPU run, and its draft length unless the
    user gave --draft-max."""
    from ..hub import get_preset, resolve

    p = get_preset(name)
    if p.method not in METHODS:
        raise GGUFSpecError(f"preset {name!r} uses method {p.method!r}, which this build's generate does not offer.")
    r = resolve(p, gpu=gpu)
    if click.get_current_context().get_parameter_source("draft_max") == click.core.ParameterSource.DEFAULT:
        draft_max = p.draft_max
    return p, r, draft_max


def _from_preset(name: str, draft: str | None, medusa: str | None, method: str | None, draft_max: int, gpu: bool
                 ) -> tuple[str, str | None, str | None, str, int]:
    """Target (the preset's GPU/Metal or CPU file), draft, heads, method and draft length of a preset (fetched as
    needed); what the user gave wins."""
    p, r, draft_max = _preset(name, draft_max, gpu)
    method = method or p.method
    m = METHODS[method]
    if draft is None and "draft" in m.proposers and r.draft is not None:
        draft = str(r.draft)
    if medusa is None and m.needs == "heads" and r.medusa is not None:
        medusa = str(r.medusa)
    return str(r.target), draft, medusa, method, draft_max


def _finish(result, show_stats: bool, as_json: bool) -> None:
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


@main.command()
@options_for("bench")
def bench(target, draft, preset, prompts_path, limit, per_category, methods, temps, max_tokens, repeats, warmup, draft_max,
          draft_p_min, seed, medusa_path, medusa_tree, medusa_vocab, fresh, output, plot_prefix, replay,
          **model_opts) -> None:
    """Compare methods side by side on a prompt set: tok/s and speedup (median over repetitions, with their
    min-max), acceptance, time split. A warning on stderr names a cell whose spread is too wide to trust."""
    from ..bench import (BenchConfig, default_methods, default_prompts, format_table, load_prompts, run_bench,
                        spread_warning, summarize, to_json)
    from ..engine import SpeculativeEngine

    prompts = load_prompts(prompts_path, limit, per_category)  # a bad file fails before any model is fetched
    if prompts_path is None:
        prompts_path = default_prompts()
        click.echo(f"prompts: the built-in set, {len(prompts)} of them (-p FILE for your own)", err=True)
    options = decoder_options(**model_opts)
    if target is None:  # as generate/chat/serve: the preset's files, the offline demo pair by default
        preset = preset or "demo"
        _, r, draft_max = _preset(preset, draft_max, options.offloads)
        target = str(r.target)
        draft = draft or (str(r.draft) if r.draft else None)
        medusa_path = medusa_path or (str(r.medusa) if r.medusa else None)
    elif preset is not None:
        raise click.UsageError("give either --preset NAME or -m TARGET.gguf, not both.")
    if replay:
        if draft is None:
            raise click.UsageError("--replay needs a draft model: -d DRAFT.gguf")
        return _replay(target, draft, prompts, max_tokens, draft_max, options)
    methods = methods or default_methods(draft is not None, medusa_path is not None, _has_mtp(target))
    for method in methods:
        _check_method(method, draft, medusa_path)
    medusa_vocab = _medusa_vocab(medusa_vocab, medusa_path)
    if plot_prefix:
        from ..plots import pyplot

        pyplot()  # fail before the benchmark, not after it
    for what, path in (("-o", output), ("--plot", plot_prefix)):  # the same: a missing folder would lose the runs
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise click.UsageError(f"{what} {path}: the folder {Path(path).expanduser().resolve().parent} does not exist.")
    cfg = BenchConfig(methods=tuple(methods), temperatures=tuple(temps) or (0.0,), max_tokens=max_tokens,
                      repeats=repeats, warmup=warmup, draft_max=draft_max, draft_p_min=draft_p_min, seed=seed,
                      fresh=fresh, medusa_tree=medusa_tree)
    with SpeculativeEngine.load(target, draft, options, medusa_path=medusa_path,
                                medusa_vocab=medusa_vocab) as engine:
        total = len(prompts) * len(cfg.methods) * cfg.repeats * len(cfg.temperatures)
        with click.progressbar(length=total, label="benchmarking", file=sys.stderr) as bar:
            runs = run_bench(engine, prompts, cfg, bar.update)
        kv_type = engine.target.kv_cache  # the default depends on the device, on flash attention and on the CPU
    rows = summarize(runs)
    click.echo(format_table(rows))
    warning = spread_warning(rows)
    if warning:
        click.echo(warning, err=True)
    if output:
        meta = {"target": str(target), "draft": str(draft) if draft else None, "medusa": medusa_path, "preset": preset,
                "medusa_vocab": medusa_vocab,
                "prompts": str(prompts_path),
                "threads": options.n_threads, "kv_type": kv_type}
        Path(output).write_text(to_json(cfg, runs, rows, meta))
        click.echo(f"wrote {output}", err=True)
    if plot_prefix:
        from ..plots import write_plots

        for path in write_plots(rows, plot_prefix, target=target, draft=draft, medusa=medusa_path):
            click.echo(f"wrote {path}", err=True)


def _replay(target, draft, prompts, max_tokens: int, draft_max: int, options) -> None:
    from ..costs import measure
    from ..engine import SpeculativeEngine
    from ..replay import record, replay_table

    with SpeculativeEngine.load(target, draft, options) as engine:
        costs, spread = measure(engine.target, engine.draft, draft_max)
        with click.progressbar(length=len(prompts), label="recording", file=sys.stderr) as bar:
            traces = record(engine, prompts, max_tokens, bar.update)
    verify = " ".join(f"{v * 1e3:.1f}" for v in costs.verify)
    click.echo(f"cost model: target ms for 1..{draft_max + 1} tokens {verify}; draft {costs.draft * 1e3:.1f} ms/token"
               f" (spread {spread:.2f})")
    click.echo(f"{'category':16} {'policy':15} {'tok/s':>7} {'speedup':>8} {'tok/pass':>9}")
    for cat, policy, r, speedup in replay_table(traces, costs, draft_max, max_tokens):
        click.echo(f"{cat:16} {policy:15} {r.tokens_per_s:7.2f} {speedup:7.2f}x {r.tokens_per_pass:9.2f}")


@main.command()
@click.argument("spec", metavar="PRESET|REPO[:PATTERN]")
@click.option("--gpu", is_flag=True, help="A preset's target file for GPU/Metal runs (-ngl), not its CPU one.")
def pull(spec: str, gpu: bool) -> None:
    """Download a preset's files, or one GGUF of a hub repo (PATTERN picks one file, e.g. '*Q4_K_M.gguf').

    Files go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE); HF_TOKEN and HF_HUB_OFFLINE are honoured.
    """
    from ..hub import pull as pull_files

    for path in pull_files(spec, gpu):
        click.echo(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


def _size(n: int) -> str:
    return "-" if not n else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@main.command("models")
@click.option("--gpu", is_flag=True, help="Show the files of GPU/Metal runs (-ngl), not of CPU runs.")
def models_cmd(gpu: bool) -> None:
    """List the presets, the files a run picks, whether they are already here, and their size on disk."""
    from ..hub import load_registry, status

    rows = []
    for p in load_registry().values():
        ok, size = status(p, gpu)
        target = p.target_for(gpu)
        files = target.describe() + "".join(f" + {s.describe()}" for s in (p.draft, p.medusa) if s)
        if p.cpu_target is not None:
            other = p.target if not gpu else p.cpu_target
            files += f"  (with{'out' if gpu else ''} -ngl: {other.pattern})"
        rows.append((p.name, p.method, "yes" if ok else "no", _size(size), files))
    head = ("preset", "method", "cached", "on disk", f"files ({'GPU/Metal' if gpu else 'CPU'} runs)")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    for r in [head, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    click.echo(
        "\nOn the CPU (no -ngl) a preset runs its CPU file where it names one, because llama.cpp's CPU kernels verify "
        "Q4_0 batches cheaply: on a Xeon here a 4-token batch cost 0.8-1.4 single decodes on Q4_0 and 1.6 on Q4_K_M "
        "(docs/cpu-kernels.md). With -ngl (GPU/Metal) it runs the Q4_K_M file. `auto` measures this machine's costs "
        "and drafts only where drafting pays."
        "\nggufspec pull NAME fetches a preset (--gpu: its GPU/Metal file); ggufspec generate --preset NAME \"...\" runs it.")


@main.command()
@options_for("doctor")
def doctor(target, draft, **model_opts) -> None:
    """Print versions, CPU features, the CPU kernels in use (and any avoided), where models' weights go: paste it
    into bug reports."""
    from ..doctor import report

    click.echo(report(target, draft, decoder_options(**model_opts)))


@main.command("rpc-server")
@click.option("-H", "--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but 127.0.0.1 exposes a protocol without authentication: use an "
                   "SSH tunnel instead (README).")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: all cores).")
@click.option("-c", "--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep the tensors clients send in DIR, so that the next load of the same model sends hashes "
                   "instead of weights (llama.cpp's rpc-server -c).")
def rpc_server(host, port, threads, cache_dir) -> None:
    """Lend this machine's GPU, or its CPU where it has none, to ggufspec on another machine (its --rpc
    HOST:PORT): llama.cpp's RPC server, one client at a time, until Ctrl-C."""
    from ..decoder import default_threads
    from ..rpc import NO_AUTH_WARNING, parse_endpoints, require, serve

    require()
    endpoint = parse_endpoints(f"{host}:{port}")[0]
    if host != "127.0.0.1":
        click.echo(NO_AUTH_WARNING, err=True)
    if cache_dir is not None:
        Path(cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve(endpoint, threads or default_threads(), str(Path(cache_dir).expanduser()) if cache_dir else None)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread
            failed.append(e)

    server = threading.Thread(target=run, name="ggufspec-rpc-server", daemon=True)  # llama.cpp blocks; Ctrl-C won't
    server.start()
    while server.is_alive():
        server.join(0.5)
    raise failed[0]


def _register_converters() -> None:
    from ..convert.commands import COMMANDS

    for command in COMMANDS:  # convert (hf, medusa), quantize, inspect
        main.add_command(command)


_register_converters()
from ..medusa.cli import medusa  # noqa: E402  (the `ggufspec medusa train` group)
main.add_command(medusa)
