"""Where draft tokens come from: a draft model, or n-gram lookup in the text so far (`auto` uses both).

A drafter returns up to k tokens after `context`: a chain or a token tree and, when sampling, the
distribution q each was drawn from (one-hot rows for deterministic proposals, which keeps rejection
sampling exact).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import numpy as np

from .decoder import Decoder
from .trees import Tree, build_tree
from .sampling import SamplingParams, probabilities, sample, softmax

# A greedy draft tree follows the draft's best guesses while the draft itself gives the whole chain at
# least this chance, and spends the nodes left on runner-up guesses (a batch of 4 costs less than 3 on
# repacked Q4_0 here, so stopping short without them saves draft steps but not target time). On the
# bench pair, Spec-Bench 2 prompts x 13 categories: `auto` 2.9% faster than with chains only.
REACH_MIN = 0.3


class Draft(NamedTuple):
    """Proposed tokens: a chain, or with `tree` its nodes after the root (the context's last token)."""

    tokens: list[int]
    q: np.ndarray | None = None  # sampling: the rows the tokens (the tree's nodes) were drawn from
    tree: Tree | None = None


class Drafter(Protocol):
    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens after `context`."""


class ModelDrafter:
    """A small model sharing the target's vocabulary; stops early when its top probability < p_min.

    tree_leaves > 1: drafts are trees of up to that many leaves (the target must hold one sequence more);
    else chains.
    """

    def __init__(self, draft: Decoder, n_vocab: int, p_min: float = 0.0, tree_leaves: int = 0) -> None:
        self.draft, self.n_vocab, self.p_min, self.tree_leaves = draft, n_vocab, p_min, tree_leaves

    def propose(self, context, k, params, rng):
        if self.tree_leaves > 1 and k > 1:
            return self._tree(context, k, params, rng)
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

    def _tree(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """k nodes: the draft's chain (its best guesses when greedy, draws from its q when sampling) while the draft
        gives the whole chain at least REACH_MIN, then runner-ups where the draft expects them to pay most (chance
        of the chain before them x their probability): the next-best guesses, or when sampling, further draws
        from the same q without replacement, each with the q it was drawn from (see medusa_trees.walk)."""
        chain: list[int] = []
        dists: list[np.ndarray] = []  # per depth: the draft's distribution (its plain softmax when greedy)
        reach = [1.0]  # chance of the chain before each depth, then of the whole chain
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        while True:
            z = softmax(logits) if params.greedy else probabilities(logits, params)
            chain.append(int(z.argmax()) if params.greedy else sample(z, rng))
            dists.append(z)
            reach.append(reach[-1] * float(z[chain[-1]]))
            if len(chain) == k or reach[-1] < REACH_MIN or z.max() < self.p_min:
                break
            logits = self.draft.feed([chain[-1]], view=True)[-1, : self.n_vocab]
        room = min(k - len(chain), self.tree_leaves - 1)  # every runner-up is a leaf, as is the chain's end
        if room <= 0:
            return Draft(chain, None if params.greedy else np.stack(dists))
        rest = [z.copy() for z in dists]  # what is left at each depth to propose
        for d, x in enumerate(chain):
            rest[d][x] = 0.0
        best = [float(r.max()) for r in rest]
        nodes: list[tuple[int, int, np.ndarray | None]] = []  # runner-ups: (depth, token, q drawn from)
        for _ in range(room):
            d = max(range(len(chain)), key=lambda d: reach[d] * best[d])
            if best[d] <= 0:  # sampling with top-k/top-p: nothing left that the draft would propose
                break
            if params.greedy:
                nodes.append((d, int(rest[d].argmax()), None))
            else:
                q = rest[d] / rest[d].sum()
                nodes.append((d, sample(q, rng), q))
            rest[d][nodes[-1][1]] = 0.0
            best[d] = float(rest[d].max())
        if not nodes:
            return Draft(chain, None if params.greedy else np.stack(dists))
        # the chain first: when it is kept, the target's cache needs no repair (see commit_tree_path)
        ranks = [0] * len(chain)
        choices = [(0,) * (d + 1) for d in range(len(chain))]
        for d, _, _ in nodes:
            ranks[d] += 1
            choices.append((0,) * d + (ranks[d],))
        tree = _tree(tuple(choices))
        tokens = chain + [t for _, t, _ in nodes]
        q = None if params.greedy else np.stack(dists + [r for _, _, r in nodes])
        return Draft(tokens, q, tree)


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

