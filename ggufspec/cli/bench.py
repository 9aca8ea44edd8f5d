"""`ggufspec bench`: methods compared side by side on a prompt set (ggufspec.bench does the runs), in three steps:
the arguments checked and the models resolved (a bad prompt file, method or output folder fails before any model is
fetched or loaded), the runs, the report (table, spread warning, JSON, plots). With --replay: policies priced on
recorded greedy text instead (ggufspec.replay)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .loading import check_method, decoder_options, has_mtp, preset_files, resolve_medusa_vocab
from .options import options_for

if TYPE_CHECKING:
    from ..bench import BenchConfig, BenchPrompt, Run
    from ..decoder import DecoderOptions


@dataclass(frozen=True)
class _Models:
    """What bench loads: the user's files, else the preset's (`preset`: its name, None with -m)."""

    target: str
    draft: str | None
    medusa: str | None
    preset: str | None
    draft_max: int


@click.command()
@options_for("bench")
def bench(target: str | None, draft: str | None, preset: str | None, prompts_path: str | None, limit: int | None,
          per_category: int | None, methods: tuple[str, ...], temps: tuple[float, ...], max_tokens: int, repeats: int,
          warmup: int, draft_max: int, draft_p_min: float, seed: int, medusa_path: str | None, medusa_tree: str | None,
          medusa_vocab: str | None, fresh: bool, output: str | None, plot_prefix: str | None, replay: bool,
          **model_opts: Any) -> None:
    """Compare methods side by side on a prompt set: tok/s and speedup (median over repetitions, with their
    min-max), acceptance, time split. A warning on stderr names a cell whose spread is too wide to trust."""
    from ..bench import BenchConfig, default_methods, default_prompts, load_prompts

    prompts = load_prompts(prompts_path, limit, per_category)  # a bad file fails before any model is fetched
    if prompts_path is None:
        prompts_path = default_prompts()
        click.echo(f"prompts: the built-in set, {len(prompts)} of them (-p FILE for your own)", err=True)
    options = decoder_options(**model_opts)
    models = _models(target, draft, medusa_path, preset, draft_max, options)
    if replay:
        if models.draft is None:
            raise click.UsageError("--replay needs a draft model: -d DRAFT.gguf")
        return _replay(models.target, models.draft, prompts, max_tokens, models.draft_max, options)
    methods = methods or default_methods(models.draft is not None, models.medusa is not None, has_mtp(models.target))
    for method in methods:
        check_method(method, models.draft, models.medusa)
    medusa_vocab = resolve_medusa_vocab(medusa_vocab, models.medusa)
    _check_outputs(output, plot_prefix)
    cfg = BenchConfig(methods=tuple(methods), temperatures=tuple(temps) or (0.0,), max_tokens=max_tokens,
                      repeats=repeats, warmup=warmup, draft_max=models.draft_max, draft_p_min=draft_p_min, seed=seed,
                      fresh=fresh, medusa_tree=medusa_tree)
    runs, kv_type = _run(models, medusa_vocab, options, prompts, cfg)
    meta = {"target": str(models.target), "draft": str(models.draft) if models.draft else None,
            "medusa": models.medusa, "preset": models.preset, "medusa_vocab": medusa_vocab,
            "prompts": str(prompts_path),
            "threads": options.n_threads, "kv_type": kv_type}
    _report(cfg, runs, meta, output, plot_prefix, models)


def _models(target: str | None, draft: str | None, medusa: str | None, preset: str | None, draft_max: int,
            options: DecoderOptions) -> _Models:
    """The files bench loads: as generate/chat/serve, the preset's without -m (what the user gave wins), the offline
    demo pair by default; a usage error for both --preset and -m."""
    if target is None:  # as generate/chat/serve: the preset's files, the offline demo pair by default
        preset = preset or "demo"
        _, r, draft_max = preset_files(preset, draft_max, options.offloads)
        target = str(r.target)
        draft = draft or (str(r.draft) if r.draft else None)
        medusa = medusa or (str(r.medusa) if r.medusa else None)
    elif preset is not None:
        raise click.UsageError("give either --preset NAME or -m TARGET.gguf, not both.")
    return _Models(target, draft, medusa, preset, draft_max)


def _check_outputs(output: str | None, plot_prefix: str | None) -> None:
    """Fail before the benchmark, not after it: matplotlib missing for --plot, or a folder of -o or --plot that
    does not exist."""
    if plot_prefix:
        from ..plots import pyplot

        pyplot()  # fail before the benchmark, not after it
    for what, path in (("-o", output), ("--plot", plot_prefix)):  # the same: a missing folder would lose the runs
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise click.UsageError(f"{what} {path}: the folder {Path(path).expanduser().resolve().parent} does not exist.")


def _run(models: _Models, medusa_vocab: int | str | None, options: DecoderOptions, prompts: list[BenchPrompt],
         cfg: BenchConfig) -> tuple[list[Run], str]:
    """Every run of `cfg` on `prompts`, a progress bar on stderr; and the target's KV cache type."""
    from ..bench import run_bench
    from ..engine import SpeculativeEngine

    with SpeculativeEngine.load(models.target, models.draft, options, medusa_path=models.medusa,
                                medusa_vocab=medusa_vocab) as engine:
        total = len(prompts) * len(cfg.methods) * cfg.repeats * len(cfg.temperatures)
        with click.progressbar(length=total, label="benchmarking", file=sys.stderr) as bar:
            runs = run_bench(engine, prompts, cfg, bar.update)
        kv_type = engine.target.kv_cache  # the default depends on the device, on flash attention and on the CPU
    return runs, kv_type


def _report(cfg: BenchConfig, runs: list[Run], meta: dict[str, Any], output: str | None, plot_prefix: str | None,
            models: _Models) -> None:
    """The summary table on stdout, a too-wide spread's warning on stderr; with -o every run and the summary as JSON
    (and `meta`), with --plot the figures."""
    from ..bench import format_table, spread_warning, summarize, to_json

    rows = summarize(runs)
    click.echo(format_table(rows))
    warning = spread_warning(rows)
    if warning:
        click.echo(warning, err=True)
    if output:
        Path(output).write_text(to_json(cfg, runs, rows, meta))
        click.echo(f"wrote {output}", err=True)
    if plot_prefix:
        from ..plots import write_plots

        for path in write_plots(rows, plot_prefix, target=models.target, draft=models.draft, medusa=models.medusa):
            click.echo(f"wrote {path}", err=True)


def _replay(target: str, draft: str, prompts: list[BenchPrompt], max_tokens: int, draft_max: int,
            options: DecoderOptions) -> None:
    """bench --replay: each prompt's greedy text and the draft's guesses recorded once, then the policies priced
    with this machine's measured cost model, a table on stdout."""
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
