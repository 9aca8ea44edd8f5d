"""The option table: every option of generate, chat, serve, bench and doctor declared once (OPTIONS), tagged with
the commands it serves, and `options_for`, the decorator that gives a command its options in the table's order.
Also llama.cpp's flags that a command takes without effect (`accepted`) or refuses, naming its own (`refused`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

import click

from ..kv_types import KV_TYPES
from ..methods import METHODS, methods_help
from .param_types import ByteSize, ChatTemplateName, MaxTokens, SpecType

F = TypeVar("F", bound=Callable[..., Any])

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
                "speed, but 512 for hybrid and recurrent models, whose prefill gains; --n-batch with GPU layers)."),
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
