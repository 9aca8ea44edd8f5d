"""Medusa (Cai et al. 2024): heads on the target's last hidden state propose a token tree, verified in one pass.

Each step decodes the tree [last, candidates...] in one batch: the root is `last`, the token the
previous step committed, so every position still goes through the target exactly once. The walk
down the tree is the target's own sampling: pick a token from the root's logits, move to the child
holding it, pick again, until no child holds the pick; that pick is the next `last`. At temperature 0
this is the longest path matching the target's argmax, at temperature > 0 it is exact sampling.
Typical acceptance (opt-in) keeps the deepest path whose tokens are all "typical enough": not exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..decoder import Decoder
from ..medusa.heads import Heads
from ..trees import Tree, walk
from ..sampling import SamplingParams, pick, probabilities
from . import Step

TYPICAL_THRESHOLD = 0.09  # Medusa's posterior_threshold (epsilon)
TYPICAL_ALPHA = 0.3  # Medusa's posterior_alpha: sqrt of the default 0.09 threshold, as in the paper's code


def candidates(heads: Heads, tree: Tree, h: np.ndarray, root: int) -> np.ndarray:
    """Tree node tokens: the root, then per node the token of its rank in its head's top-k."""
    top = heads.top_k(h, tree.top_k)
    tokens = np.empty(tree.size, dtype=np.int64)
    tokens[0] = root
    for k, best in enumerate(top):
        nodes = tree.head == k
        tokens[nodes] = best[tree.rank[nodes]]
    return tokens


def walk_typical(
    tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
    threshold: float = TYPICAL_THRESHOLD, alpha: float = TYPICAL_ALPHA,
) -> tuple[list[int], int]:
    """Typical acceptance: the deepest path whose every token has p > min(threshold, alpha * exp(-entropy))."""
    p = probabilities(logits, params)
    entropy = -(p * np.log(p + 1e-12)).sum(-1)
    parent = np.maximum(tree.parents, 0)
    ok = p[parent, tokens] > np.minimum(threshold, alpha * np.exp(-entropy[parent]))
    ok[0] = True
    accepted = ~(tree.ancestors & ~ok).any(axis=1)
    node = int(np.argmax(np.where(accepted, tree.depth, -1)))
    return tree.path(node), pick(logits[node], params, rng)


def medusa(
    target: Decoder, heads: Heads, tree: Tree, last: int, limit: int, params: SamplingParams,
    rng: np.random.Generator, typical: bool = False,
) -> Iterator[Step]:
    """Yield the tokens each target pass commits, at most `limit` in all; `last` is not yet decoded.

    `target` must return hidden states (embeddings on) and hold n_seq_max > leaves of `tree`.
    """
    if tree.n_heads > heads.n_heads:
        tree = tree.truncated(heads.n_heads)  # a tree deeper than the head set: its extra levels can't be filled
    heads.check_top_k(tree.top_k)  # before any token: a restricted candidate vocabulary may be too small
    # First pass: `last` alone, for the hidden state the heads start from.
    logits = target.feed([last])
    h = target.hidden_states()[-1]
    last = pick(logits[-1], params, rng)
    yield Step([last], 0)
    limit -= 1
    choose = walk_typical if typical and not params.greedy else walk
    while limit > 0:
        t = tree if tree.n_heads < limit else tree.truncated(limit - 1)
        tokens = candidates(heads, t, h, last) if t.size > 1 else np.array([last])
        logits = target.tree_logits(tokens.tolist(), t.parents.tolist())
        hidden = target.hidden_states()
        path, last = choose(t, tokens, logits, params, rng)
        target.commit_tree_path(path)
        h = hidden[path[-1]]
        new = [int(tokens[i]) for i in path[1:]] + [last]
        yield Step(new, t.n_heads)
        limit -= len(new)
