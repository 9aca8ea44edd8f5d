"""Where draft tokens come from: a draft model, or n-gram lookup in the text so far (`auto` uses both).

A drafter returns up to k tokens after `context`: a chain and, when sampling, the distribution q
each was drawn from (one-hot rows for deterministic proposals, which keeps rejection sampling
exact); or, greedy only, a token tree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import numpy as np

from .decoder import Decoder
from .medusa_trees import Tree, build_tree
from .sampling import SamplingParams, probabilities, sample, softmax

# A greedy draft tree follows the draft's best guesses while the draft itself gives the whole chain at
# least this chance, and spends the nodes left on runner-up guesses (a batch of 4 costs less than 3 on
# repacked Q4_0 here, so stopping short without them saves draft steps but not target time). On the
# bench pair, Spec-Bench 2 prompts x 13 categories: `auto` 2.9% faster than with chains only.
REACH_MIN = 0.3


class Draft(NamedTuple):
    """Proposed tokens: a chain, or with `tree` its nodes after the root (the context's last token)."""

    tokens: list[int]
    q: np.ndarray | None = None  # sampling: the rows the tokens were drawn from
    tree: Tree | None = None


class Drafter(Protocol):
    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens after `context`."""


class ModelDrafter:
    """A small model sharing the target's vocabulary; stops early when its top probability < p_min.

    tree_leaves > 1: greedy drafts are trees of up to that many leaves (the target must hold one
    sequence more); else chains.
    """

    def __init__(self, draft: Decoder, n_vocab: int, p_min: float = 0.0, tree_leaves: int = 0) -> None:
        self.draft, self.n_vocab, self.p_min, self.tree_leaves = draft, n_vocab, p_min, tree_leaves

    def propose(self, context, k, params, rng):
        if params.greedy and self.tree_leaves > 1 and k > 1:
            return self._tree(context, k)
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        while True:
            if params.greedy:
                tokens.append(int(logits.argmax()))
            else:
                qs.append(probabilities(logits, params))
                tokens.append(sample(qs[-1], rng))
            if len(tokens) == k or (self.p_min > 0 and softmax(logits).max() < self.p_min):
                break
            logits = self.draft.feed([tokens[-1]], view=True)[-1, : self.n_vocab]
        return Draft(tokens, np.stack(qs) if qs else None)

    def _tree(self, context: list[int], k: int) -> Draft:
        """k nodes: the draft's best chain while its own chance stays >= REACH_MIN, then the runner-ups
        along it that the draft rates likeliest (chance of the chain before them x their probability)."""
        ranked: list[np.ndarray] = []  # per depth: the draft's top tokens, best first
        spare: list[tuple[float, int, int]] = []  # (chance, depth, rank) of runner-ups
        reach = 1.0
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        while True:
            top = np.argpartition(logits, -k)[-k:]
            top = top[np.argsort(-logits[top])]
            z = np.exp(logits - logits[top[0]])
            p = z[top] / z.sum()
            spare += [(reach * float(x), len(ranked), r) for r, x in enumerate(p[1:], 1)]
            ranked.append(top)
            reach *= float(p[0])
            if len(ranked) == k or reach < REACH_MIN or p[0] < self.p_min:
                break
            logits = self.draft.feed([int(top[0])], view=True)[-1, : self.n_vocab]
        room = min(k - len(ranked), self.tree_leaves - 1)  # every runner-up is a leaf, as is the chain's end
        if room <= 0:
            return Draft([int(t[0]) for t in ranked])
        spare.sort(key=lambda s: -s[0])
        # the chain first: when it is kept, the target's cache needs no repair (see commit_tree_path)
        choices = [(0,) * (d + 1) for d in range(len(ranked))] + [(0,) * d + (r,) for _, d, r in spare[:room]]
        tree = _tree(tuple(choices))
        return Draft([int(ranked[len(c) - 1][c[-1]]) for c in tree.choices], None, tree)


class LookupDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, n_vocab: int, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min

    def find(self, context: list[int], k: int) -> list[int]:
        ctx = np.asarray(context)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            tail = ctx[-n:]
            # windows starting at 0 .. len-n-1: every occurrence that ends before the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ctx[start : start + k].tolist()
        return []

    def propose(self, context, k, params, rng):
        tokens = self.find(context, k)
        if params.greedy or not tokens:
            return Draft(tokens)
        q = np.zeros((len(tokens), self.n_vocab))
        q[np.arange(len(tokens)), tokens] = 1.0
        return Draft(tokens, q)


@functools.lru_cache(maxsize=256)
def _tree(choices: tuple[tuple[int, ...], ...]) -> Tree:
    return build_tree(list(choices), keep_order=True)

