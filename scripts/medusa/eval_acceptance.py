#!/usr/bin/env python3
"""Mean accepted length of Medusa heads per prompt category, at temperature 0, without decoding any tree.

Greedy Medusa commits exactly the target's greedy text, so its passes can be counted on that text: from
the hidden state after committed position j, the heads fill the tree, the path matching the next greedy
tokens is accepted (d tokens) plus the target's own token: d + 1 tokens per pass. The first pass decodes
the last prompt token alone (1 token), as `ggufspec.methods.medusa` does.

    python eval_acceptance.py TARGET.gguf HEADS.gguf [--prompts spec_bench_dev.jsonl] [--per-category 3]
        [--max-new 128] [--tree NAME|FILE] [--data greedy.npz] [--vocab full --vocab 8192 ...]

--tree: default, the tree stored with the heads (`medusa train` fits one), else mc_sim_7b_63.

--vocab (repeatable): restricted candidate vocabularies to compare (N lowest ids, or a file of ids, plus the
target's special tokens; `full` is the whole vocabulary); "in set" is the share of answer tokens they hold.

The greedy answers and their hidden states are collected with llama.cpp (cached in --data).
"""
import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np

from ggufspec.medusa.candidates import candidate_ids, special_ids
from ggufspec.medusa.heads import Heads
from ggufspec.medusa.train import Corpus, chat_tokens, collect_generations, open_for_collection
from ggufspec.trees import build_tree, load_tree


def passes_on(tokens: np.ndarray, hidden: np.ndarray, heads: Heads, tree, eog: set[int]) -> tuple[int, int]:
    """(tokens generated, target passes) of greedy Medusa on one greedy answer."""
    end = len(tokens) - 1 if int(tokens[-1]) in eog else len(tokens)  # the engine does not count EOS as text
    passes, j = 1, 0  # pass 1: the last prompt token alone commits tokens[1]
    while j + 1 < len(tokens) - 1:
        top = heads.top_k(hidden[j].astype(np.float32), tree.top_k)
        node, d = 0, 0
        while True:
            kids = tree.children(node)
            want = tokens[j + 2 + d] if j + 2 + d < len(tokens) else -1
            match = [k for k in kids if top[tree.head[k]][tree.rank[k]] == want]
            if not match:
                break
            node, d = match[0], d + 1
        passes += 1
        j += d + 1
    return end - 1, passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("heads")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[3] / "shared/bench/spec_bench_dev.jsonl"))
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--data", default=None, help="cache of the greedy answers (.npz)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--vocab", action="append", default=None, help="full, N, or a file of ids (repeatable)")
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.prompts, encoding="utf-8") if line.strip()]
    by_cat = collections.defaultdict(list)
    for r in rows:
        by_cat[r.get("category", "all")].append(r)
    picked = [r for cat in by_cat for r in by_cat[cat][: a.per_category]]
    cats = [r.get("category", "all") for r in picked]
    target = open_for_collection(Path(a.target), 8, a.max_new + 1100, a.threads)
    if a.data and Path(a.data).exists():
        corpus = Corpus.load(Path(a.data))
    else:
        t0 = time.perf_counter()
        ids = [chat_tokens(target, r["turns"][0] if "turns" in r else r["prompt"])[-1000:] for r in picked]
        corpus = collect_generations(target, ids, a.max_new, 8)
        print(f"collected {corpus.n_tokens} greedy tokens in {time.perf_counter() - t0:.0f} s")
        if a.data:
            corpus.save(Path(a.data))
    keep = special_ids(target.vocab)
    eog = set(target.vocab.eog_ids)
    for spec in a.vocab or ["full"]:
        cand = None if spec == "full" else int(spec) if spec.isdigit() else spec
        heads = Heads.load(a.heads, a.target, target.n_embd, target.n_vocab, cand, keep if cand is not None else ())
        tree = build_tree(heads.choices) if a.tree is None and heads.choices else load_tree(a.tree)
        tree_name = a.tree or ("the heads' own" if heads.choices else "mc_sim_7b_63")
        t = tree.truncated(heads.n_heads) if tree.n_heads > heads.n_heads else tree
        ids = candidate_ids(cand, target.n_vocab, keep)
        stats = collections.defaultdict(lambda: [0, 0, 0])
        for cat, toks, hid in zip(cats, corpus.tokens, corpus.hidden):
            n, p = passes_on(toks, hid, heads, t, eog)
            stats[cat][0] += n
            stats[cat][1] += p
            stats[cat][2] += len(toks) if ids is None else int(np.isin(toks, ids).sum())
        print(f"\ncandidate vocabulary: {spec} ({heads.n_candidates} of {heads.vocab} tokens)")
        print(f"{'category':<16}{'prompts':>8}{'tokens':>8}{'passes':>8}{'tok/pass':>10}{'in set':>8}")
        for cat in by_cat:
            n, p, k = stats[cat]
            m = sum(len(toks) for c, toks in zip(cats, corpus.tokens) if c == cat)
            print(f"{cat:<16}{cats.count(cat):>8}{n:>8}{p:>8}{n / max(p, 1):>10.2f}{k / max(m, 1):>8.1%}")
        n, p, k = (sum(v[i] for v in stats.values()) for i in (0, 1, 2))
        m = sum(len(toks) for toks in corpus.tokens)
        print(f"{'all':<16}{len(cats):>8}{n:>8}{p:>8}{n / max(p, 1):>10.2f}{k / max(m, 1):>8.1%}"
              f"   (tree: {tree_name}, {tree.size - 1} nodes; {heads.n_heads} heads)")


if __name__ == "__main__":
    main()
