"""Fitting a candidate tree to Medusa heads: the choices their recorded ranks would have got accepted most often."""

from __future__ import annotations

import numpy as np

from ..errors import GGUFSpecError
from ..trees import TreeError
from .heads import Heads
from .train import Pairs


def fit_tree(ranks: np.ndarray, n_nodes: int) -> list[list[int]]:
    """The n_nodes choices that would have been accepted most often on recorded data.

    ranks[i, k]: where the true token i + k + 2 stood in head k's ranking at position i (-1 or any
    negative: not known). A choice is accepted at position i when every head on its path ranked the
    true token exactly as the choice says; the tree's expected accepted length is 1 plus the sum of
    its choices' frequencies. A choice is never accepted more often than its prefix, so taking the
    most frequent ones, frontier first, is optimal and prefix-closed (ties: shallower, lower ranks).
    """
    ranks = np.asarray(ranks)
    if ranks.ndim != 2 or len(ranks) == 0:
        raise TreeError("fitting a tree needs a non-empty [positions, heads] array of ranks")
    n_heads = ranks.shape[1]

    def positions(choice: tuple[int, ...], within: np.ndarray) -> np.ndarray:
        return within[ranks[within, len(choice) - 1] == choice[-1]]

    everywhere = np.arange(len(ranks))
    # frontier: choice -> positions where it is accepted (a subset of its parent's)
    frontier = {(int(r),): positions((int(r),), everywhere) for r in np.unique(ranks[:, 0]) if r >= 0}
    chosen: list[list[int]] = []
    while frontier and len(chosen) < n_nodes:
        best = max(frontier, key=lambda c: (len(frontier[c]), -len(c), tuple(-r for r in c)))
        where = frontier.pop(best)
        if len(where) == 0:
            break
        chosen.append(list(best))
        if len(best) < n_heads:
            for r in np.unique(ranks[where, len(best)]):
                if r >= 0:
                    child = (*best, int(r))
                    frontier[child] = positions(child, where)
    return chosen


def tree_accepted(ranks: np.ndarray, choices: list[list[int]]) -> float:
    """Mean draft tokens accepted per pass with these choices, on fit_tree's ranks (one matching node per depth)."""
    ranks = np.asarray(ranks)
    return float(sum((ranks[:, : len(c)] == c).all(axis=1).mean() for c in choices if len(c) <= ranks.shape[1]))


def fit_heads_tree(heads: Heads, data: Pairs, samples: np.ndarray, n_nodes: int = 63, max_rank: int = 64,
                   batch: int = 128) -> tuple[list[list[int]], float, np.ndarray]:
    """The candidate tree of n_nodes choices the heads would have got accepted most often at `samples`
    (greedy text), the draft tokens it accepts there per pass, and the heads' ranks it was fitted on."""
    if data.labels.shape[1] < heads.n_heads:
        raise GGUFSpecError(f"the data has labels for {data.labels.shape[1]} heads, the head set has {heads.n_heads}")
    samples = np.sort(samples)
    ranks = np.concatenate([
        heads.ranks(data.hidden[data.rows[i]], data.labels[i, : heads.n_heads], max_rank)
        for i in np.array_split(samples, max(1, len(samples) // batch))
    ])
    choices = fit_tree(ranks, n_nodes)
    return choices, tree_accepted(ranks, choices), ranks
