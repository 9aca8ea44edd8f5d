"""Token trees decoded after a KvSequence's history in one pass (`TreeDecoding.tree_logits`), and the commit of one
path through them (`commit_tree_path`). Tree nodes sit in the KV sequences after the history's, one per leaf: leaf j
is sequence j+1 (the context's n_seq_max bounds the leaves). Candidate trees themselves (Medusa's) are in trees.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import ContextLengthError, GGUFSpecError
from .sequence import KvSequence
from .submission import Steps, run_steps


@dataclass
class TreeLayout:
    """Per-node depth and sequence ids of a tree given by parent indices; leaf j is sequence j+1."""

    parents: list[int]
    depth: list[int]
    seq_ids: list[list[int]]
    n_leaves: int
    depth_max: int

    @classmethod
    def build(cls, parents: Sequence[int]) -> TreeLayout:
        parents = [int(p) for p in parents]
        n = len(parents)
        if n == 0:
            raise ValueError("a tree needs at least one node")
        depth = [0] * n
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must come before their children")
            depth[i] = 0 if p < 0 else depth[p] + 1
        has_child = [False] * n
        for p in parents:
            if p >= 0:
                has_child[p] = True
        seq_ids: list[list[int]] = [[] for _ in range(n)]
        n_leaves = 0
        for leaf in range(n):
            if has_child[leaf]:
                continue
            n_leaves += 1
            node = leaf
            while node >= 0:
                seq_ids[node].append(n_leaves)
                node = parents[node]
        return cls(parents, depth, seq_ids, n_leaves, max(depth))


class TreeDecoding(KvSequence):
    """A KvSequence that decodes token trees (Decoder.tree_logits, Decoder.commit_tree_path). Until the commit, the
    tree is pending (`_tree`): a feed, a rollback or a reset drops it (KvSequence._end_tree)."""

    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        return run_steps(self.tree_logits_steps(tokens, parents))

    def tree_logits_steps(self, tokens: Sequence[int], parents: Sequence[int]) -> Steps[np.ndarray]:
        """tree_logits as a decode coroutine (submission.Steps)."""
        self._end_tree()
        pre = self._take_deferred()  # decoded as a chain above the roots
        base = len(self.history)
        try:
            parents = [*range(-1, len(pre) - 1), *(p + len(pre) for p in parents)]
            logits = yield from self._decode_tree([*pre, *tokens], parents)
        except BaseException:
            self._restore_deferred(pre, base)
            raise
        self.history.extend(pre)  # in the cache now, but only in the tree's sequences until the commit
        self._tree_pre, self._skip = pre, len(pre)
        return logits[len(pre):]

    def _decode_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> Steps[np.ndarray]:
        tree = TreeLayout.build(parents)
        if tree.n_leaves + 1 > self.options.n_seq_max:
            raise GGUFSpecError(
                f"a tree with {tree.n_leaves} leaves needs n_seq_max >= {tree.n_leaves + 1}, "
                f"this context has {self.options.n_seq_max}"
            )
        if len(self.history) + tree.depth_max + 1 > self.n_ctx:
            if self.shift_keep is None:
                raise ContextLengthError(f"the tree does not fit the context of {self.n_ctx} tokens")
            self.shift(tree.depth_max + 1)
        base = len(self.history)
        if len(tokens) > self.options.n_batch:
            raise GGUFSpecError(f"a tree of {len(tokens)} nodes needs n_batch >= {len(tokens)}")
        context, seq = self._context(), self._seq
        with context.lock:
            for s in range(1, tree.n_leaves + 1):
                context.seq_cp(seq, seq + s)
        positions = [base + d for d in tree.depth]
        self._unrecorded = True
        rc = yield from self._access.tree(tokens, positions, [[seq + s for s in ids] for ids in tree.seq_ids])
        if rc != 0:
            context.drop(range(seq + 1, seq + tree.n_leaves + 1))
            raise GGUFSpecError(f"llama_decode failed with code {rc} on a tree of {len(tokens)} nodes")
        self._n_out = len(tokens)
        self._tree = tree
        self._tree_tokens = [int(t) for t in tokens]
        self._tree_rows = self._access.nextn(len(tokens)).copy() if self.hidden_rows is not None else None
        self._unrecorded = False
        return self._access.logits(len(tokens), False)

    def commit_tree_path(self, path: Sequence[int]) -> int:
        tree = self._tree
        if tree is None:
            raise GGUFSpecError("commit_tree_path needs a tree_logits call just before it")
        n_pre = len(self._tree_pre)  # the deferred tokens in front: the caller's node i is node i + n_pre
        for a, b in zip(path, path[1:]):
            if tree.parents[b + n_pre] != a + n_pre:
                raise ValueError(f"node {b} is not a child of node {a}")
        if path and tree.parents[path[0] + n_pre] != n_pre - 1:
            raise ValueError(f"path must start at a root node, node {path[0]} is not one")
        full = [*range(n_pre), *(int(i) + n_pre for i in path)]
        base = len(self.history) - n_pre
        contiguous = self._keep_path(tree, full, base)
        committed = [self._tree_tokens[i] for i in full]
        if self.hidden_rows is not None and full:  # the path's rows, at the positions its nodes take
            self.hidden_rows.cut(base)
            self.hidden_rows.put(base, self._tree_rows[full])
        del self.history[base:]
        self.history.extend(committed)
        self._deferred = committed[contiguous:]
        self._tree, self._tree_pre = None, []
        return len(self._deferred)

    def _keep_path(self, tree: TreeLayout, full: list[int], base: int) -> int:
        """Make the history's sequence hold the tree's nodes `full` (a path from the first node, which takes position
        `base`) up to the path's first gap, and drop the rest of the tree; return how many nodes it holds."""
        context, seq = self._context(), self._seq
        with context.lock:
            if full:
                leaf_seq = seq + tree.seq_ids[full[-1]][0]
                context.seq_rm(leaf_seq, base + len(full), -1)
                self._access.keep(leaf_seq, tree.n_leaves)
                context.seq_cp(leaf_seq, seq)
                context.seq_rm(leaf_seq, -1, -1)
            else:
                self._access.keep(seq, tree.n_leaves)
        # Node i of the batch sits in the cache cell after node i-1's. The path's nodes after its first gap
        # would sit past freed cells that later tokens fill: out of position order, and llama.cpp's attention
        # adds up cells in cache order, so its logits would drift from plain decoding's (docs/exactness.md). Those
        # nodes are dropped from the cache and decoded again in front of the next batch.
        contiguous = next((i for i, node in enumerate(full) if node != i), len(full))
        if contiguous < len(full):
            context.seq_rm(seq, base + contiguous, -1)
        return contiguous
