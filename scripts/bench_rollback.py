#!/usr/bin/env python3
"""What rolling back costs on a hybrid or recurrent model: batches with and without snapshots, and checkpoints.

For each batch size 1..K+1 (after --context tokens), the time of a decode on a context without snapshots (n_rs_seq 0)
and on one keeping K (what ggufspec gives a target drafting K tokens), in alternating rounds; the median of each, and
their ratio (a single token's is what keeping snapshots costs plain decoding). Then a checkpoint of the sequence's
recurrent state, saved and restored (recurrent.Rewind), against a single-token decode.

    python scripts/bench_rollback.py MODEL.gguf [-k 4] [--rounds 9] [--context 100] [-t 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggufspec import cpu_backend  # noqa: E402
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder  # noqa: E402


def time_batch(d: LlamaCppDecoder, base: int, n: int) -> float:
    """Seconds for a decode of n tokens after `base` held ones; rolled back to them afterwards."""
    t0 = time.perf_counter()
    d.feed(list(range(300, 300 + n)))
    seconds = time.perf_counter() - t0
    d.rollback_to(base)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-k", type=int, default=4, help="snapshots (the longest chain), batches of 1..k+1")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    cpu_backend.prepare()
    ctx = list(range(1000, 1000 + a.context))
    decoders = {n_rs: LlamaCppDecoder(a.model, DecoderOptions(n_ctx=1024, n_threads=a.threads, n_rs_seq=n_rs))
                for n_rs in (0, a.k)}
    for d in decoders.values():
        d.sync(ctx)
        d.hold(anchor=True)  # each round's rollback returns to this checkpoint
    sizes = range(1, a.k + 2)
    times: dict[tuple[int, int], list[float]] = {(n_rs, n): [] for n_rs in decoders for n in sizes}
    holds: list[float] = []
    for r in range(a.rounds):
        order = list(decoders.items()) if r % 2 == 0 else list(decoders.items())[::-1]
        for n in sizes:
            for n_rs, d in order:
                times[n_rs, n].append(time_batch(d, len(ctx), n))
        d = decoders[a.k]
        d.feed([7])
        before = d.hold_seconds
        d.hold()  # saved after len(ctx) + 1 tokens
        d.feed([8])
        d.rollback_to(len(ctx) + 1)  # a single-token decode: restored from it
        holds.append(d.hold_seconds - before)
        d.rollback_to(len(ctx))
    med = {key: statistics.median(v) for key, v in times.items()}
    one = med[0, 1]
    d = decoders[a.k]
    print(json.dumps({
        "model": Path(a.model).name, "memory": d.memory.value, "n_rs_seq": d.n_rs_seq, "context": a.context,
        "threads": a.threads, "rounds": a.rounds,
        "batch_ms": {n: {"no_snapshots": round(med[0, n] * 1e3, 2), "snapshots": round(med[a.k, n] * 1e3, 2),
                         "decodes": round(med[0, n] / one, 2), "snapshots_over_none": round(med[a.k, n] / med[0, n], 3)}
                     for n in sizes},
        "checkpoint_ms": round(statistics.median(holds) * 1e3, 3),
        "checkpoint_over_decode": round(statistics.median(holds) / one, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
