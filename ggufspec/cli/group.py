"""The `ggufspec` group, `main`: how a command's failures end the process. Exit codes: 0 done, 1 failed (an RPC
server went away), 2 usage or bad input, 130 interrupted."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..errors import EXIT_INTERRUPTED, GGUFSpecError


class Group(click.Group):
    """Turns ggufspec's errors into one clear line on stderr and exit code 2, and Ctrl-C into one line and 130."""

    def invoke(self, ctx: click.Context) -> Any:
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
