"""Seconds from SIGINT to exit while `ggufspec generate` prefills ~4,900 tokens in one batch, for checkouts side by
side, alternating; with --check-cost, what the abort check costs a prefill (docs/interrupts.md).

    python scripts/ctrl_c_latency.py MODEL.gguf TREE [TREE ...] [--runs 3]
    python scripts/ctrl_c_latency.py MODEL.gguf --check-cost [--runs 5]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = " ".join(f"word{i}" for i in range(1200))


def once(model: str, tree: str, after: float) -> tuple[float, int, bool]:
    """(seconds from the signal to the exit, exit code, whether llama.cpp says the batch was aborted)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as err:
        p = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "generate", "-m", model, "-n", "4", "-c", "8192",
                              "--n-batch", "8192", "--raw", "-v", PROMPT], cwd=tree, stdout=subprocess.DEVNULL, stderr=err)
        while "sched_reserve: reserve took" not in Path(err.name).read_text():  # the context is made
            if p.poll() is not None:
                raise SystemExit(f"{tree}: ended before the prefill:\n{Path(err.name).read_text()[-2000:]}")
            time.sleep(0.02)
        time.sleep(after)
        t = time.monotonic()
        p.send_signal(signal.SIGINT)
        p.wait()
        return time.monotonic() - t, p.returncode, "failed to decode, ret = 2" in Path(err.name).read_text()


def check_cost(model: str, runs: int) -> None:
    """One prefill of ~1,800 tokens with and without the abort check (llama_context.ABORTABLE_BATCH), alternating."""
    from ggufspec import llama_context
    from ggufspec.decoder import DecoderOptions, LlamaCppDecoder

    with LlamaCppDecoder(model, DecoderOptions(n_ctx=4096, n_batch=2048)) as d:
        tokens = d.vocab.encode(" ".join(f"word{i}" for i in range(480)))[:2000]
        seconds: dict[str, list[float]] = {"check": [], "none": []}
        for _ in range(runs):
            for mode in seconds:
                llama_context.ABORTABLE_BATCH = 64 if mode == "check" else 1 << 30
                d.rollback_to(0)
                t = time.perf_counter()
                d.feed(tokens, all_logits=False)
                seconds[mode].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{len(tokens)} tokens: with the check {med['check']:.2f} s, without {med['none']:.2f} s, "
          f"ratio {med['check'] / med['none']:.3f} (runs: {seconds})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("trees", nargs="*")
    ap.add_argument("--check-cost", action="store_true", help="time a prefill with and without the abort check")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--after", type=float, default=2.0, help="seconds into the prefill to send SIGINT")
    a = ap.parse_args()
    if a.check_cost:
        return check_cost(a.model, a.runs)
    seconds: dict[str, list[float]] = {t: [] for t in a.trees}
    for _ in range(a.runs):
        for tree in a.trees:
            lat, rc, aborted = once(a.model, tree, a.after)
            seconds[tree].append(lat)
            print(f"{tree}: {lat:.2f} s, exit {rc}, {'aborted' if aborted else 'ran to the end'}", flush=True)
    for tree, v in seconds.items():
        print(f"{tree}: median {statistics.median(v):.2f} s ({min(v):.2f}-{max(v):.2f}) over {len(v)} runs")


if __name__ == "__main__":
    main()
