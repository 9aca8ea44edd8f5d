#!/usr/bin/env python3
"""Time per step of Medusa heads (top-k for a tree) against one single-token decode of a target.

    python head_time.py TARGET.gguf --heads HEADS.gguf         # a real head set for this target
    python head_time.py TARGET.gguf --random 5,4096,32000,1    # random heads: count,hidden,vocab,version
    python head_time.py TARGET.gguf --heads HEADS.gguf --vocab full --vocab 8192 --vocab 16384
                                                               # restricted candidate vocabularies, interleaved

Heads and decodes alternate in one process (this machine is shared: only ratios within a run mean much);
medians over --repeats.
"""
import argparse
import time

import ggufspec  # noqa: F401  (first: it sets OpenBLAS's thread timeout before numpy loads OpenBLAS)
import numpy as np

from ggufspec.decoder import DecoderOptions, LlamaCppDecoder, default_threads
from ggufspec.medusa.candidates import candidate_ids, special_ids
from ggufspec.medusa.heads import Heads, MedusaHeads
from ggufspec.trees import load_tree


def random_heads(n: int, hidden: int, vocab: int, version: int) -> Heads:
    rng = np.random.default_rng(0)
    res = [[(rng.standard_normal((hidden, hidden), dtype=np.float32) * 0.01, np.zeros(hidden, np.float32))]
           for _ in range(n)]
    lm = [rng.standard_normal((vocab, hidden), dtype=np.float32) for _ in range(n)] if version == 1 else None
    raw = MedusaHeads(version, hidden, vocab, "", res, lm)
    return Heads(raw, None if lm else rng.standard_normal((vocab, hidden), dtype=np.float32))


def restricted(heads: Heads, raw: MedusaHeads, lm: np.ndarray | None, spec: str, keep: set[int]) -> Heads:
    """The same heads proposing from `spec` ('full', N, or a file of ids)."""
    if spec == "full":
        return heads
    return Heads(raw, lm, candidate_ids(int(spec) if spec.isdigit() else spec, heads.vocab, keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--heads")
    ap.add_argument("--random", help="count,hidden,vocab,version")
    ap.add_argument("--tree", default="mc_sim_7b_63")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--vocab", action="append", default=None,
                    help="candidate vocabulary to time: full, N, or a file of ids (repeatable; timed in turn)")
    a = ap.parse_args()
    d = LlamaCppDecoder(a.target, DecoderOptions(n_ctx=512, n_threads=a.threads))
    if a.heads:
        heads = Heads.load(a.heads, a.target, d.n_embd, d.n_vocab)
        from ggufspec.medusa.heads import load_medusa_gguf, target_lm_head
        raw = load_medusa_gguf(a.heads)
        lm = target_lm_head(a.target) if raw.lm_heads is None else None
    else:
        heads = random_heads(*(int(v) for v in a.random.split(",")))
        raw, lm = None, None
    specs = a.vocab or ["full"]
    if specs != ["full"] and raw is None:
        ap.error("--vocab needs --heads")
    keep = special_ids(d.vocab)
    sets = [restricted(heads, raw, lm, v, keep) for v in specs]
    tree = load_tree(a.tree)
    ks = tree.top_k[: heads.n_heads]
    h = np.random.default_rng(1).standard_normal(heads.hidden).astype(np.float32)
    d.feed([1, 2, 3, 4])
    t_heads, t_dec = [[] for _ in sets], []
    for _ in range(a.repeats):
        for s, times in zip(sets, t_heads):
            t = time.perf_counter()
            s.top_k(h, ks)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        d.feed([5])
        t_dec.append(time.perf_counter() - t)
        d.rollback_to(4)
    md = np.median(t_dec) * 1e3
    print(f"one target decode ({a.target}, {d.options.n_threads or default_threads()} threads): {md:.2f} ms (median of {a.repeats})")
    for spec, s, times in zip(specs, sets, t_heads):
        mh = np.median(times) * 1e3
        print(f"heads ({s.n_heads} x hidden {s.hidden}, {s.n_candidates} of {s.vocab} tokens ({spec}), v{s.version}, "
              f"top-k {ks}): {mh:.2f} ms | fraction of a decode {mh / md:.3f}")


if __name__ == "__main__":
    main()
