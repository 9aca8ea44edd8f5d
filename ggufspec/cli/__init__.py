"""The `ggufspec` command line. Exit codes: 0 done, 1 failed (an RPC server went away), 2 usage or bad input, 130
interrupted."""

from __future__ import annotations

import threading
from pathlib import Path

import click

from ..kv_types import KV_TYPES  # noqa: F401  (the names --kv-type takes; test_decoder checks them against llama.cpp's)
from .bench import bench
from .generate import chat, generate
from .group import main
from .loading import decoder_options
from .options import OPTIONS, options_for  # noqa: F401
from .prompt_input import process_escapes  # noqa: F401
from .serve import serve


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


for _command in (generate, chat, serve, bench):  # the commands of this package's modules
    main.add_command(_command)


def _register_converters() -> None:
    from ..convert.commands import COMMANDS

    for command in COMMANDS:  # convert (hf, medusa), quantize, inspect
        main.add_command(command)


_register_converters()
from ..medusa.cli import medusa  # noqa: E402  (the `ggufspec medusa train` group)
main.add_command(medusa)
