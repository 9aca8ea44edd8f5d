"""The `ggufspec` command line. Exit codes: 0 done, 1 failed (an RPC server went away), 2 usage or bad input, 130
interrupted."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import click

from ..kv_types import KV_TYPES  # noqa: F401  (the names --kv-type takes; test_decoder checks them against llama.cpp's)
from .generate import chat, generate
from .group import main
from .loading import check_method, decoder_options, has_mtp, preset_files, resolve_medusa_vocab
from .options import OPTIONS, options_for  # noqa: F401
from .prompt_input import process_escapes  # noqa: F401
from .serve import serve


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
        _, r, draft_max = preset_files(preset, draft_max, options.offloads)
        target = str(r.target)
        draft = draft or (str(r.draft) if r.draft else None)
        medusa_path = medusa_path or (str(r.medusa) if r.medusa else None)
    elif preset is not None:
        raise click.UsageError("give either --preset NAME or -m TARGET.gguf, not both.")
    if replay:
        if draft is None:
            raise click.UsageError("--replay needs a draft model: -d DRAFT.gguf")
        return _replay(target, draft, prompts, max_tokens, draft_max, options)
    methods = methods or default_methods(draft is not None, medusa_path is not None, has_mtp(target))
    for method in methods:
        check_method(method, draft, medusa_path)
    medusa_vocab = resolve_medusa_vocab(medusa_vocab, medusa_path)
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


for _command in (generate, chat, serve):  # the commands of this package's modules
    main.add_command(_command)


def _register_converters() -> None:
    from ..convert.commands import COMMANDS

    for command in COMMANDS:  # convert (hf, medusa), quantize, inspect
        main.add_command(command)


_register_converters()
from ..medusa.cli import medusa  # noqa: E402  (the `ggufspec medusa train` group)
main.add_command(medusa)
