"""Candidate trees, shared by Medusa and the draft model's trees: Medusa's choices format, the shipped trees,
the arrays built once per tree, and the target's walk down a verified tree (fitting a tree to Medusa heads
is in `ggufspec.medusa.fit`).

A choice is a path of ranks: [2, 0] is "head 0's 3rd-best token, then head 1's best token after it".
The verified tree has one more node, the root (index 0): the token the target committed last, not yet
decoded. Node i > 0 is choice i - 1 and is decoded as a child of the node of its prefix.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import GGUFSpecError
from .sampling import SamplingParams, pick, probabilities, sample


class TreeError(GGUFSpecError):
    """A candidate tree file or name is unusable."""


# The standard 63-choice tree of the Medusa paper (Cai et al. 2024), tuned on Vicuna-7B: top-10 of heads 0-2.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]

TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    # The first 31 / 15 choices of the 63-node tree: Medusa orders choices by how often they pay.
    "mc_sim_31": MC_SIM_7B_63[:31],
    "mc_sim_15": MC_SIM_7B_63[:15],
    "chain_4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
}
DEFAULT_TREE = "mc_sim_7b_63"


@dataclass(frozen=True)
class Tree:
    """Per node (root first): parent, depth, which head and rank proposes it, and ancestor sets."""

    choices: tuple[tuple[int, ...], ...]
    parents: np.ndarray  # [n] int, -1 for the root
    depth: np.ndarray  # [n] int, 0 for the root
    head: np.ndarray  # [n] head index proposing the node (-1 for the root)
    rank: np.ndarray  # [n] rank in that head's top-k (0 for the root)
    ancestors: np.ndarray  # [n, n] bool, ancestors[i, j]: j is on the root-to-i path (i itself included)
    top_k: tuple[int, ...]  # how many candidates each head must propose

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def n_heads(self) -> int:
        return len(self.top_k)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`."""
        return [int(j) for j in np.flatnonzero(self.ancestors[node])]

    def children(self, node: int) -> np.ndarray:
        return np.flatnonzero(self.parents == node)

    def truncated(self, max_depth: int) -> Tree:
        """The same tree without nodes deeper than max_depth (for the last steps before a token limit)."""
        return build_tree([c for c in self.choices if len(c) <= max_depth])

    def subtree(self, nodes: Sequence[int]) -> Tree:
        """The tree of `nodes` (indices into this tree, root first, each after its parent), node k being nodes[k]."""
        return ordered_tree(tuple(self.choices[i - 1] for i in nodes[1:]))


def walk(tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
         q: Sequence[np.ndarray | None] | None = None) -> tuple[list[int], int]:
    """The target's own picks down the tree: the path of kept nodes (root first) and the next token.

    Without q (candidates chosen deterministically, as Medusa's and greedy drafts are): the target picks a token
    at each node and moves to the child holding it. With q, q[i] the distribution node i's token was drawn from
    (given its parent and its earlier siblings): recursive rejection sampling over each node's children in order
    (SpecInfer's multi-step speculative sampling; Jeon et al. 2024): child i is kept with probability
    min(1, p(x)/q[i](x)), and after a rejection p becomes norm(max(0, p - q[i])); when no child is kept, the next
    token is drawn from what p has become. Either way every token follows the target's distribution exactly.
    """
    path = [0]
    while True:
        node = path[-1]
        kids = tree.children(node)
        if q is None or params.greedy:
            token = pick(logits[node], params, rng)
            match = kids[tokens[kids] == token]
            if len(match) == 0:
                return path, token
            path.append(int(match[0]))
            continue
        p = probabilities(logits[node], params)
        for kid in kids:
            p, kept = rejection_step(p, q[kid], int(tokens[kid]), rng)
            if kept:
                path.append(int(kid))
                break
        else:
            return path, sample(p, rng)


def rejection_step(p: np.ndarray, q: np.ndarray | None, x: int, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
    """Keep candidate x, drawn from q (None: chosen deterministically), with probability min(1, p(x)/q(x)); on a
    rejection, also the distribution the next candidate or the final draw must use: norm(max(0, p - q))."""
    qx = 1.0 if q is None else float(q[x])
    if qx > 0 and rng.random() * qx <= p[x]:
        return p, True
    return residual(p, q, x), False


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """What is drawn from after candidate x (drawn from q; None: chosen deterministically) was rejected:
    norm(max(0, p - q)), which for a deterministic x is p without x."""
    if q is None:
        rest = p.copy()
        rest[x] = 0.0
    else:
        rest = np.maximum(p - q, 0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def build_tree(choices: list[list[int]] | list[tuple[int, ...]], keep_order: bool = False) -> Tree:
    """Arrays of a choices list; every prefix must be present. Nodes sorted by depth then ranks, or
    keep_order: in the order given (each after its prefix)."""
    paths = [tuple(int(r) for r in c) for c in choices]
    paths = list(dict.fromkeys(paths)) if keep_order else sorted(set(paths), key=lambda c: (len(c), c))
    index = {(): 0}
    for c in paths:
        if not c:
            raise TreeError("a choice is an empty path")
        if any(r < 0 for r in c):
            raise TreeError(f"choice {list(c)} has a negative rank")
        if c[:-1] not in index:
            raise TreeError(f"choice {list(c)} needs its prefix {list(c[:-1])} in the tree too")
        index[c] = len(index)
    n = len(index)
    parents = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    head = np.full(n, -1, dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)
    ancestors = np.eye(n, dtype=bool)
    for c, i in index.items():
        if c:
            parents[i], depth[i], head[i], rank[i] = index[c[:-1]], len(c), len(c) - 1, c[-1]
            ancestors[i] |= ancestors[parents[i]]
    n_heads = int(depth.max())
    top_k = tuple(int(rank[head == k].max()) + 1 for k in range(n_heads))
    return Tree(tuple(paths), parents, depth, head, rank, ancestors, top_k)


@functools.lru_cache(maxsize=512)
def ordered_tree(choices: tuple[tuple[int, ...], ...]) -> Tree:
    """build_tree(choices, keep_order=True), cached: the trees cut or drafted each step take a few recurring shapes."""
    return build_tree(list(choices), keep_order=True)


def load_tree(spec: str | None) -> Tree:
    """A shipped tree by name, or a JSON file holding a list of choices (or {"choices": [...]})."""
    spec = spec or DEFAULT_TREE
    if spec in TREES:
        return build_tree(TREES[spec])
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"{spec!r} is neither a tree name ({', '.join(TREES)}) nor a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TreeError(f"{path}: not a JSON tree file ({e})") from None
    if isinstance(data, dict):
        data = data.get("choices")
    if not isinstance(data, list) or not data or not all(
        isinstance(c, list) and c and all(isinstance(r, int) and not isinstance(r, bool) for r in c) for c in data
    ):
        raise TreeError(f"{path}: expected a non-empty JSON list of choices, each a non-empty list of ranks, like [[0], [0, 0], [1]]")
    try:
        return build_tree(data)
    except TreeError as e:
        raise TreeError(f"{path}: {e}") from None
