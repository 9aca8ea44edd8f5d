"""PNG charts of a benchmark summary: speedup per category, and acceptance by draft position."""

from __future__ import annotations

from pathlib import Path

from .bench import Summary
from .errors import GGUFSpecError


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise GGUFSpecError("plots need matplotlib: pip install 'ggufspec[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _title(target: str | Path | None, draft: str | Path | None, medusa: str | Path | None = None) -> str:
    """The models' file names, for a figure's title."""
    if target is None:
        return ""
    title = f"target {Path(target).name}"
    if draft is not None:
        title += f", draft {Path(draft).name}"
    if medusa is not None:
        title += f", heads {Path(medusa).name}"
    return title


def _spread(mid: float, lo: float, hi: float) -> tuple[float, float]:
    """Error bar lengths below and above `mid` (0 where there is no range)."""
    if mid != mid or lo != lo or hi != hi:
        return 0.0, 0.0
    return max(0.0, mid - lo), max(0.0, hi - mid)


def speedup_figure(rows: list[Summary], baseline: str = "autoregressive", title: str = ""):
    """Bars of the speedup per category and method (one panel per temperature), labelled with their values, with
    error bars from the range over repetitions; `title` (the models) above them."""
    plt = pyplot()
    temps = sorted({r.temperature for r in rows})
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != baseline]
    fig, axes = plt.subplots(len(temps), 1, figsize=(10, 3.6 * len(temps) + 0.4), squeeze=False)
    for ax, temp in zip(axes[:, 0], temps):
        cats = list(dict.fromkeys(r.category for r in rows if r.temperature == temp))
        width = 0.8 / max(1, len(methods))
        for i, method in enumerate(methods):
            by_cat = {r.category: r for r in rows if r.temperature == temp and r.method == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
            cells = [by_cat.get(c) for c in cats]
            heights = [r.speedup if r is not None and r.speedup == r.speedup else 0.0 for r in cells]
            errs = [_spread(r.speedup, r.speedup_min, r.speedup_max) if r is not None else (0.0, 0.0) for r in cells]
            bars = ax.bar(xs, heights, width, label=method, yerr=[[e[0] for e in errs], [e[1] for e in errs]],
                          capsize=3, error_kw={"elinewidth": 0.8})
            # inside the bars: above them the whiskers would cross the numbers
            ax.bar_label(bars, labels=["" if r is None else f"{h:.2f}x" for r, h in zip(cells, heights)],
                         label_type="center", fontsize="x-small")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel(f"speedup vs {baseline}")
        ax.set_title(f"temperature {temp:g} (bars: median over repetitions, whiskers: min-max)", fontsize="small")
        ax.margins(y=0.15)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return fig


def acceptance_figure(rows: list[Summary], title: str = ""):
    """Acceptance by draft position of each method (category "all"), one panel per temperature, each point
    labelled with its value, with error bars from the range over repetitions; `title` (the models) above."""
    plt = pyplot()
    temps = sorted({r.temperature for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(max(7.0, 5 * len(temps)), 4.0), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for r in rows:
            if r.temperature == temp and r.category == "all" and r.acceptance_by_position:
                pos = list(range(1, len(r.acceptance_by_position) + 1))
                lo = r.acceptance_by_position_min or r.acceptance_by_position
                hi = r.acceptance_by_position_max or r.acceptance_by_position
                errs = [_spread(a, a_lo, a_hi) for a, a_lo, a_hi in zip(r.acceptance_by_position, lo, hi)]
                ax.errorbar(pos, r.acceptance_by_position, yerr=[[e[0] for e in errs], [e[1] for e in errs]],
                            marker="o", capsize=3, label=r.method)
                for x, a in zip(pos, r.acceptance_by_position):
                    ax.annotate(f"{a:.0%}", (x, a), textcoords="offset points", xytext=(0, 6), ha="center",
                                fontsize="x-small")
                ax.set_xticks(pos)
        ax.set_ylim(-0.03, 1.1)
        ax.set_xlabel("draft position (depth for medusa)")
        ax.set_ylabel("kept, given judged")
        ax.set_title(f"acceptance by position, temperature {temp:g} (whiskers: min-max over repetitions)",
                     fontsize="small")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    return fig


def write_plots(rows: list[Summary], prefix: str | Path, baseline: str = "autoregressive",
                target: str | Path | None = None, draft: str | Path | None = None,
                medusa: str | Path | None = None) -> list[Path]:
    """Write PREFIX-speedup.png and PREFIX-acceptance.png (one panel per temperature), titled with the models'
    file names; return their paths."""
    plt = pyplot()
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        raise GGUFSpecError(f"{prefix.parent}: no such folder for the plots.")
    title = _title(target, draft, medusa)
    try:
        return [_save(speedup_figure(rows, baseline, title), prefix, "speedup"),
                _save(acceptance_figure(rows, title), prefix, "acceptance")]
    finally:
        plt.close("all")


def _save(fig, prefix: Path, what: str) -> Path:
    path = prefix.with_name(f"{prefix.name}-{what}.png")
    fig.savefig(path, dpi=110)
    return path
