"""`ggufspec serve`: the OpenAI-compatible server (ggufspec.server) over a pool of slots, with the limits that guard
it (body size, deadlines, connections, hosts, origins)."""

from __future__ import annotations

from typing import Any

import click

from ..errors import GGUFSpecError
from .loading import load_engine
from .options import options_for


@click.command()
@options_for("serve")
def serve(host: str, port: int, api_key: str | None, queue: int, alias: str | None, parallel: int, max_body: int | None,
          timeout: float, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...], **params: Any) -> None:
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
