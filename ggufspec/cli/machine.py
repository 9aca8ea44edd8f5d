"""This machine: `ggufspec doctor` (what it runs with, for bug reports) and `ggufspec rpc-server` (its GPU or CPU
lent to ggufspec on another machine)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import click

from .loading import decoder_options
from .options import options_for


@click.command()
@options_for("doctor")
def doctor(target: str | None, draft: str | None, **model_opts: Any) -> None:
    """Print versions, CPU features, the CPU kernels in use (and any avoided), where models' weights go: paste it
    into bug reports."""
    from ..doctor import report

    click.echo(report(target, draft, decoder_options(**model_opts)))


@click.command("rpc-server")
@click.option("-H", "--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but 127.0.0.1 exposes a protocol without authentication: use an "
                   "SSH tunnel instead (README).")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: all cores).")
@click.option("-c", "--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep the tensors clients send in DIR, so that the next load of the same model sends hashes "
                   "instead of weights (llama.cpp's rpc-server -c).")
def rpc_server(host: str, port: int, threads: int | None, cache_dir: str | None) -> None:
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
