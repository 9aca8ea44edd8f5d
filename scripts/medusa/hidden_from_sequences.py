"""Medusa training data from token sequences already generated (the draft recipe's `draft_data.py` files).

Generating answers is the slow part of collecting Medusa data; the demo draft's recipe already has the
target's greedy answers. Files written with `draft_data.py --hidden` hold the hidden states too and are only
reshaped; others are re-read in one teacher-forced pass per sequence with hidden states on (prefill speed,
no sampling). Either way this writes the `--data` cache that `ggufspec medusa train` loads: per answer,
the last prompt token and the answer, each with the final-norm hidden state after it (`--whole`: every
position; the prompt's text is then a label too, as in Medusa's training on ShareGPT), and the target's
top-16 logits after each token, which `medusa train` uses as soft labels.

    nice -n 19 python scripts/medusa/hidden_from_sequences.py TARGET.gguf OUT.npz DATA.npz [DATA.npz ...]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.medusa.train import Corpus

def sequences(path: str, whole: bool) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
    """(where the kept part starts, tokens, the target's top-16 ids and logits, hidden states or None) per
    sequence: the answer (from the last prompt token), or all of it. draft_data.py already kept the top-16."""
    z = np.load(path)
    cuts = np.cumsum(z["lens"])[:-1]
    hidden = np.split(z["hidden"], cuts) if "hidden" in z.files else [None] * len(z["lens"])
    rows = zip(z["plens"], *(np.split(z[k], cuts) for k in ("tokens", "idx", "val")), hidden)
    if whole:
        return [(1, t, i, v, h) for _, t, i, v, h in rows if len(t) > 3]
    return [(int(p), t, i, v, h) for p, t, i, v, h in rows if p > 0 and len(t) > p]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("data", nargs="+")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--whole", action="store_true",
                    help="Keep prompt positions too (their text as labels), and draft_data.py --corpus files.")
    args = ap.parse_args()
    seqs = [s for path in args.data for s in sequences(path, args.whole)]
    longest = max(len(s[1]) for s in seqs)
    dec = None
    if any(s[4] is None for s in seqs):
        dec = LlamaCppDecoder(args.target, DecoderOptions(n_ctx=longest + 8, n_batch=longest + 8, embeddings=True,
                                                          n_threads=args.threads))
    corpus, t0 = Corpus([], [], [], []), time.time()
    try:
        for i, (plen, toks, top_ids, top_logits, hidden) in enumerate(seqs):
            if hidden is None:
                dec.reset()
                dec.feed(toks.tolist(), view=True)  # all rows, for their hidden states
                hidden = dec.hidden_states()
            corpus.tokens.append(toks[plen - 1:].astype(np.int32))
            corpus.hidden.append(hidden[plen - 1:].astype(np.float16))
            corpus.top_ids.append(top_ids[plen - 1:].astype(np.int32))
            corpus.top_logits.append(top_logits[plen - 1:].astype(np.float16))
            if i % 100 == 0:
                print(f"{i}/{len(seqs)} sequences, {corpus.n_tokens} tokens, {time.time() - t0:.0f} s", file=sys.stderr)
    finally:
        if dec is not None:
            dec.close()
    corpus.save(args.out)
    print(f"wrote {args.out}: {len(seqs)} answers, {corpus.n_tokens} tokens in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
