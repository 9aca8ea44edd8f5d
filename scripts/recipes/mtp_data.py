#!/usr/bin/env python3
"""An MTP benchmark target, step 1 of 2 (step 2: mtp_train.py): a small random Qwen3.5-architecture model B and its
own greedy text, with its hidden row (`h_nextn`: the last layer's output after the final norm) at every position.

Why this target (docs/mtp.md, "What it costs"): no small Qwen3.5 with a trained MTP block can be downloaded here, and a
random deep model's next-but-one token is chaos, which no head can learn: its MTP acceptance would mean nothing. B is
make_hybrid_bench_pair.py's base (12 layers, every 4th attention, 384 wide, SmolLM2's vocabulary) with what each
layer adds to the residual stream scaled by `--trunk`: at 1.0 (that script's) the text is chaos; near 0 it is a fixed
function of the last token (a walk through a random map, which a head copies without learning anything). In between
the next token is mostly, not wholly, set by the last one and the context's trace in the hidden row, as a real
model's is by the text so far: a head trained on the model's own text (step 2) guesses part of it. The script prints
how much of B's text the last token alone decides (`bigram`) and how much prompt lookup could find (`repeats`).

Prompts are draft_data.py's (made here, never from the benchmark sets); generation is its continuous-batched greedy
decoding with the final-norm hidden states of the same decode.

    nice -n 19 python scripts/recipes/mtp_data.py OUT_DIR --trunk 0.2 --minutes 4 [--threads 2]
Writes OUT_DIR/mtp-base.f32.gguf (B, without an MTP block) and OUT_DIR/mtp-data.npz.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts"), str(REPO / "scripts" / "recipes")]  # research scripts

from draft_data import Generator, code_prompts, local_docs, make_prompts  # noqa: E402
from make_hybrid_bench_pair import BASE  # noqa: E402
from tiny_models import hybrid_weights, read_tokenizer, write_hybrid_gguf  # noqa: E402

from ggufspec.chat import render_chat  # noqa: E402


def base_config(trunk: float):
    return dataclasses.replace(BASE, trunk=trunk)


def text_stats(weights: dict[str, np.ndarray], seqs: list[tuple[int, np.ndarray]]) -> str:
    """How much of the generated text its last token decides (B's pick from that token's embedding alone, the model
    with its layers removed) and how much of it repeats a 3-gram seen before in its sequence with the same next token
    (what prompt lookup finds)."""
    emb, out = weights["token_embd.weight"], weights["output.weight"]
    bigram = same = rep = n = 0
    for plen, toks in seqs:
        gen = toks[max(plen - 1, 0):]
        if len(gen) < 2:
            continue
        e = emb[gen[:-1]]
        e = e / np.sqrt((e * e).mean(1, keepdims=True) + 1e-5)
        pick = (e @ out.T).argmax(1)
        bigram += int((pick == gen[1:]).sum())
        seen: dict[tuple, int] = {}
        for i in range(3, len(toks)):
            key = tuple(toks[i - 3 : i])
            if i > plen and key in seen:
                rep += 1
                same += int(seen[key] == toks[i])
            seen[key] = toks[i]
        n += len(gen) - 1
    return (f"bigram {bigram / max(n, 1):.0%} of {n} generated tokens; "
            f"repeats: a seen 3-gram before {rep / max(n, 1):.0%}"
            f", with the same next token {same / max(n, 1):.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--trunk", type=float, default=0.2)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--n-seq", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = read_tokenizer(a.tokenizer)
    n_vocab = len(next(f for f in tokenizer if f.name == "tokenizer.ggml.tokens").data)
    cfg = base_config(a.trunk)
    weights = hybrid_weights(cfg, n_vocab, a.seed)
    base = write_hybrid_gguf(a.out_dir / "mtp-base.f32.gguf", tokenizer, weights, cfg, "mtp-base")
    print(f"wrote {base} in {time.time() - t0:.0f} s", flush=True)

    rng = random.Random(a.seed)
    gen = Generator(str(base), a.n_seq, 1024, threads=a.threads, hidden=True)
    template = gen.dec.metadata("tokenizer.chat_template")
    vocab = gen.vocab
    im_end = vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)
    stops = {vocab.eos, *im_end}
    prompts = [p for _, p in make_prompts(rng, template, local_docs(rng, 300), per_topic=4, n_math=100)]
    prompts += code_prompts(rng, 200)
    prompts += [render_chat(template, [{"role": "user", "content": c}]) for c in code_prompts(rng, 100)]
    rng.shuffle(prompts)
    fits = lambda ids: len(ids) <= gen.n_batch - gen.n_seq  # noqa: E731
    queue = [ids for p in prompts if fits(ids := vocab.tokenize(p, add_special=False, parse_special=True))]
    print(f"{len(queue)} prompts", flush=True)
    seqs, n_tok = [], 0
    deadline = time.time() + 60 * a.minutes
    for plen, toks, _idx, _val, hid in gen.run(queue, a.max_new, deadline, 0.0, stops):
        seqs.append((plen, toks, hid))
        n_tok += len(toks)
        if len(seqs) % 50 == 0:
            print(f"{len(seqs)} sequences, {n_tok} tokens, {time.time() - t0:.0f} s", flush=True)
    print(text_stats(weights, [(p, t) for p, t, _ in seqs]), flush=True)
    lens = np.array([len(t) for _, t, _ in seqs], np.int32)
    out = a.out_dir / "mtp-data.npz"
    np.savez(out, plens=np.array([p for p, _, _ in seqs], np.int32), lens=lens,
             tokens=np.concatenate([t for _, t, _ in seqs]), hidden=np.concatenate([h for _, _, h in seqs]),
             trunk=np.float32(a.trunk), seed=np.int32(a.seed))
    print(f"wrote {out}: {len(seqs)} sequences, {int(lens.sum())} tokens in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
