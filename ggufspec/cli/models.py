"""The model files: `ggufspec pull` (a preset's files, or one GGUF of a hub repo, into the Hugging Face cache) and
`ggufspec models` (the presets, the files a run picks, whether they are here)."""

from __future__ import annotations

import click


@click.command()
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
    """A size on disk as `models` shows it: GB, MB, or - for nothing."""
    return "-" if not n else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@click.command("models")
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
