"""The `ggufspec` command line (entry point `ggufspec.cli:main`; `python -m ggufspec.cli` runs it too). Exit codes:
0 done, 1 failed (an RPC server went away), 2 usage or bad input, 130 interrupted.

group.py         `main`, the click group: ggufspec's errors as one `error:` line, Ctrl-C as 130
options.py       the one table of options (OPTIONS), tagged with the commands they serve; `options_for`
param_types.py   the table's click types: token counts, sizes, --spec-type, --chat-template
loading.py       options to loaded models: decoder_options, presets, the method checked, load_engine
prompt_input.py  generate's one prompt (PROMPT, -p, -f), -e's escapes as llama.cpp processes them
generate.py      generate (one prompt, or --batch) and chat
serve.py         serve, the OpenAI-compatible server
bench.py         bench: arguments, runs, report; --replay
models.py        pull and models: presets and their files
machine.py       doctor and rpc-server: this machine described, or lent
Also here: `convert`, `quantize`, `inspect` (ggufspec.convert) and `medusa` (ggufspec.medusa)."""

from __future__ import annotations

from ..convert.commands import COMMANDS as _CONVERTERS
from ..kv_types import KV_TYPES  # the names --kv-type takes (test_decoder checks them against llama.cpp's)
from ..medusa.cli import medusa as _medusa  # the `ggufspec medusa train` group
from .bench import bench
from .generate import chat, generate
from .group import main
from .loading import decoder_options, load_engine
from .machine import doctor, rpc_server
from .models import models_cmd, pull
from .options import OPTIONS, options_for
from .prompt_input import process_escapes
from .serve import serve

__all__ = ["KV_TYPES", "OPTIONS", "decoder_options", "load_engine", "main", "options_for", "process_escapes"]

for _command in (generate, chat, serve, bench, pull, models_cmd, doctor, rpc_server,
                 *_CONVERTERS,  # convert (hf, medusa), quantize, inspect
                 _medusa):
    main.add_command(_command)
