"""Click commands `convert hf|medusa`, `quantize` and `inspect`; the scripts in converters/ run the same ones."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import click

from ggufspec.gguf_write import OUT_TYPES


@contextmanager
def _bar(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr; yields the update callback."""
    with click.progressbar(length=max(total, 1), label=label, file=sys.stderr, show_pos=False, show_percent=True) as bar:
        yield bar.update


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@click.group("convert")
def convert() -> None:
    """Convert Hugging Face checkpoints or Medusa heads to GGUF."""


@convert.command("hf")
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--outtype", type=click.Choice(list(OUT_TYPES)), default="f16", show_default=True,
              help="Storage type of the weight matrices (norms and biases stay f32).")
@click.option("--vocab-from", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Copy the tokenizer metadata from this GGUF instead of the folder's tokenizer files.")
@click.option("--tokenizer-pre", default=None,
              help="Force tokenizer.ggml.pre (llama.cpp's pre-tokenizer name) when it cannot be detected.")
@click.option("--name", default=None, help="general.name to record (default: the folder name).")
def convert_hf_cmd(model_dir: Path, out: Path, outtype: str, vocab_from: Path | None, tokenizer_pre: str | None,
                   name: str | None) -> None:
    """Convert the HF model folder MODEL_DIR (Llama, Mistral, Qwen2, Qwen3) to the GGUF file OUT."""
    from ggufspec.convert.checkpoint import checkpoint_files, file_size
    from ggufspec.convert.hf import convert_hf

    total = file_size(checkpoint_files(model_dir))
    with _bar(total, f"converting {model_dir.name}") as update:
        rep = convert_hf(model_dir, out, outtype, vocab_from=vocab_from, tokenizer_pre=tokenizer_pre, name=name,
                         progress=update)
    for note in rep.fallbacks:
        click.echo(f"note: {note}", err=True)
    rate = rep.source_bytes / 1e6 / rep.seconds if rep.seconds > 0 else 0.0
    click.echo(f"wrote {rep.out} ({_mb(rep.out_bytes)}, {rep.n_tensors} tensors) in {rep.seconds:.1f} s, {rate:.0f} MB/s")


@convert.command("medusa")
@click.argument("src", type=click.Path(path_type=Path, exists=True))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--outtype", type=click.Choice(["f16", "f32", "q8_0"]), default="f16", show_default=True)
@click.option("--base-model", default=None, help="Base model name to record (default: from config.json).")
@click.option("--vocab-size", type=int, default=None, help="Vocabulary size to record for v2 heads (no LM heads).")
def convert_medusa_cmd(src: Path, out: Path, outtype: str, base_model: str | None, vocab_size: int | None) -> None:
    """Convert FasterDecoding Medusa heads (a folder with medusa_lm_head.safetensors|.pt, or that file) to OUT."""
    from ggufspec.convert.medusa import convert_medusa, find_source

    weights, _ = find_source(src)
    with _bar(weights.stat().st_size, "converting medusa heads") as update:
        rep = convert_medusa(src, out, outtype, base_model=base_model, vocab_size=vocab_size, progress=update)
    for w in rep.warnings:
        click.echo(f"note: {w}", err=True)
    click.echo(f"wrote {rep.out}: Medusa v{rep.version}, {rep.heads} heads x {rep.layers} ResBlocks, "
               f"hidden {rep.hidden}, vocab {rep.vocab or 'from base model'}")


@click.command("quantize")
@click.argument("inp", metavar="IN", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--type", "qtype", required=True, help="Target type: q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k_m, q4_k_s, "
              "q4_k_m, q5_k_s, q5_k_m, q6_k, iq4_nl, iq4_xs, f16, bf16, ...")
@click.option("--threads", "-t", type=int, default=0, help="Threads (0: all cores).")
@click.option("--output-type", default=None, help="Storage type for output.weight (e.g. q8_0, f16).")
@click.option("--embedding-type", default=None, help="Storage type for token_embd.weight (e.g. q8_0, f16).")
@click.option("--allow-requantize", is_flag=True,
              help="Quantize an input that is already quantized (as llama-quantize --allow-requantize); quality "
              "suffers more than quantizing its f16/bf16/f32 original.")
@click.option("-v", "--verbose", is_flag=True,
              help="List each tensor stored in another type than --type asks, and show llama.cpp's log lines.")
def quantize_cmd(inp: Path, out: Path, qtype: str, threads: int, output_type: str | None,
                 embedding_type: str | None, allow_requantize: bool, verbose: bool) -> None:
    """Quantize the GGUF IN to OUT with llama.cpp's quantizer."""
    from ggufspec import llama_log
    from ggufspec.convert.quantize import FTYPES, quantize, tensor_type

    if qtype.lower() not in FTYPES:
        raise click.BadParameter(f"{qtype!r}; choose one of {', '.join(FTYPES)}", param_hint="--type")
    for opt, val in (("--output-type", output_type), ("--embedding-type", embedding_type)):
        if val is not None:
            try:
                tensor_type(val)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint=opt) from e

    if verbose:
        llama_log.install(verbose=True)
    with click.progressbar(length=1, label=f"quantizing to {qtype}", file=sys.stderr) as bar:
        def update(done: int, total: int) -> None:
            bar.length = total
            bar.update(done - bar.pos)

        rep = quantize(inp, out, qtype, threads=threads, output_type=output_type, embedding_type=embedding_type,
                       allow_requantize=allow_requantize, progress=update)
    if verbose:
        for fb in rep.fallbacks:
            click.echo(f"fallback: {fb}", err=True)
    elif rep.fallbacks:  # one line per tensor is llama.cpp's log again: 180 lines for SmolLM2 to a K-quant
        click.echo(f"note: {rep.fallback_summary}; --verbose lists them", err=True)
    click.echo(f"wrote {rep.out} ({_mb(rep.out_bytes)} from {_mb(rep.in_bytes)}) in {rep.seconds:.1f} s; "
               f"types: {rep.type_summary}")


@click.command("inspect")
@click.argument("file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--n-ctx", type=int, default=None, help="Context length for the RAM estimate (default: model's, max 4096).")
def inspect_cmd(file: Path, n_ctx: int | None) -> None:
    """Show what a GGUF file holds: architecture, sizes, storage types, tokenizer, RAM for weights + KV."""
    from ggufspec.convert.inspect import format_summary, inspect_gguf

    if n_ctx is not None and n_ctx <= 0:
        raise click.BadParameter("must be positive", param_hint="--n-ctx")
    click.echo(format_summary(inspect_gguf(file), n_ctx))


COMMANDS = [convert, quantize_cmd, inspect_cmd]


def run_script(cmd: click.Command) -> None:
    """Run one command as a standalone script, with the CLI's error handling: GGUFSpecError -> message, exit 2;
    Ctrl-C -> "interrupted", exit 130. SIGTERM/SIGHUP while writing end the process from inside the writers
    ("terminated", exit 128 + signal, as SystemExit, which passes through here untouched)."""
    from ggufspec.errors import GGUFSpecError

    try:
        cmd.main(standalone_mode=False)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):  # click turns Ctrl-C into Abort
            click.echo("interrupted", err=True)
            sys.exit(130)
        click.echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except GGUFSpecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(0)
