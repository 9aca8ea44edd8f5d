"""Medusa (Cai et al. 2024): heads on the target's last hidden state propose a token tree, as vLLM's MedusaProposer:
a hidden state in, a Draft tree out."""

from __future__ import annotations

import time

import numpy as np

from ..medusa.heads import Heads
from ..trees import Tree
from . import NO_DRAFT, Context, Counters, Draft, PlainSteps


def candidates(heads: Heads, tree: Tree, h: np.ndarray, root: int) -> np.ndarray:
    """Tree node tokens: the root, then per node the token of its rank in its head's top-k."""
    top = heads.top_k(h, tree.top_k)
    tokens = np.empty(tree.size, dtype=np.int64)
    tokens[0] = root
    for k, best in enumerate(top):
        nodes = tree.head == k
        tokens[nodes] = best[tree.rank[nodes]]
    return tokens


class MedusaProposer(PlainSteps):
    """Proposes the nodes of its static tree that the plan names; none before the target's first pass (no hidden
    state yet). The heads run for the whole tree: `Draft.candidates` holds every node's token for the policy."""

    name = "medusa"

    def __init__(self, heads: Heads, tree: Tree) -> None:
        if tree.n_heads > heads.n_heads:
            tree = tree.truncated(heads.n_heads)  # a tree deeper than the head set: its extra levels can't be filled
        heads.check_top_k(tree.top_k)  # before any token: a restricted candidate vocabulary may be too small
        self.heads, self.tree = heads, tree
        self.counters = Counters()

    def begin(self, prompt: list[int], warm: bool) -> None:
        pass

    def accept(self, n_kept: int) -> None:
        self.counters.accepted += n_kept

    def propose(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Draft:
        """plan_nodes: indices into the static tree, root first, each after its parent ([0]: the heads run, for the
        policy to learn from, but nothing is proposed)."""
        if context.hidden is None or plan_nodes is None:
            return NO_DRAFT
        t0 = time.perf_counter()
        every = candidates(self.heads, self.tree, context.hidden, context.tokens[-1])
        c = self.counters
        c.seconds += time.perf_counter() - t0
        if len(plan_nodes) == 1:
            return Draft([], source=self.name, candidates=every)
        c.drafts += 1
        c.drafted += len(plan_nodes) - 1
        tree = self.tree.subtree(plan_nodes.tolist())
        return Draft(every[plan_nodes[1:]].tolist(), tree, source=self.name, candidates=every)
