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


def write_plots(rows: list[Summary], prefix: str | Path, baseline: str = "autoregressive") -> list[Path]:
    """Write PREFIX-speedup.png and PREFIX-acceptance.png (one panel per temperature); return their paths."""
    plt = pyplot()
    prefix = Path(prefix)
    if not prefix.parent.is_dir():
        raise GGUFSpecError(f"{prefix.parent}: no such folder for the plots.")
    temps = sorted({r.temperature for r in rows})
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != baseline]
    written = []

    fig, axes = plt.subplots(len(temps), 1, figsize=(10, 3.6 * len(temps)), squeeze=False)
    for ax, temp in zip(axes[:, 0], temps):
        cats = list(dict.fromkeys(r.category for r in rows if r.temperature == temp))
        width = 0.8 / max(1, len(methods))
        for i, method in enumerate(methods):
            by_cat = {r.category: r.speedup for r in rows if r.temperature == temp and r.method == method}
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(cats))]
            ax.bar(xs, [by_cat.get(c, 0.0) for c in cats], width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
        ax.set_ylabel(f"speedup vs {baseline}")
        ax.set_title(f"temperature {temp:g}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(_save(fig, prefix, "speedup"))

    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for r in rows:
            if r.temperature == temp and r.category == "all" and r.acceptance_by_position:
                pos = range(1, len(r.acceptance_by_position) + 1)
                ax.plot(pos, r.acceptance_by_position, marker="o", label=r.method)
                ax.set_xticks(pos)
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft position (depth for medusa)")
        ax.set_ylabel("kept, given judged")
        ax.set_title(f"acceptance by position, temperature {temp:g}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    written.append(_save(fig, prefix, "acceptance"))
    plt.close("all")
    return written


def _save(fig, prefix: Path, what: str) -> Path:
    path = prefix.with_name(f"{prefix.name}-{what}.png")
    fig.savefig(path, dpi=110)
    return path
