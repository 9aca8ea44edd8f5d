"""Medusa's tree sizer: how much of the static tree pays to verify each step, on the measured cost model."""

from __future__ import annotations

import numpy as np

from ..costs import CostModel
from ..trees import Tree
from .adaptive import MIN_GAIN


class TreeSizer:
    """Cuts Medusa's tree, each step, to the nodes that maximise expected tokens per second; none when no tree pays.

    A node's chance of being kept is a running average of whether the target's committed tokens matched it, known
    after every step for every node of the whole tree, verified or not (the heads proposed them all). Sorted by
    that chance the nodes stay prefix-closed (a node matches only where its parent does). The batch costs are the
    measured ones times what tree batches really cost against them; the heads' own time counts too. While no tree
    pays the heads run only now and then (`wants_heads`), to keep learning; never where no tree could pay even if
    every head were always right.
    """

    PROBE_EVERY = 8
    PROBE_SHARE = 0.01
    TIMING_MEMORY = 0.8  # running averages of the heads' and a probe's time, past their first five samples
    TREE_STEP_MOST = 2.0  # one tree batch moves tree_factor as if it cost at most this many times the expected
    TREE_FORGET = 0.995  # each plain step keeps this share of tree_factor's excess over 1 (half in ~140 steps)

    def __init__(self, tree: Tree, costs: CostModel, memory: float = 0.9) -> None:
        self.tree, self.costs, self.memory = tree, costs, memory
        # before any evidence: a head's best guess kept half the time, its rank-r guess a tenth of that over r
        # (optimistic priors put whole trees on a CPU where a few nodes pay)
        self.kept = np.array([1.0] + [float(np.prod([0.5 if r == 0 else 0.05 / r for r in c])) for c in tree.choices])
        self.heads_seconds = 0.0
        self.probe_seconds = 0.0  # a probe's cost: the heads, and what they slow the next decode by
        self._heads_runs = self._probes = 0
        self._heads_fastest = float("inf")
        # tree batches (one sequence per leaf, hidden states out) against the chain batches the cost model timed:
        # learned from each tree step alone, since scaling every size (as auto does) would price plain steps too
        self.tree_factor = 1.0
        self._idle = 0
        self._plan: tuple[int, np.ndarray, float] | None = None  # (max_depth, nodes, rate): until observe learns

    def plan(self, max_depth: int) -> np.ndarray:
        """Node indices to verify, root first, each after its parent ([0]: a plain step)."""
        max_depth = min(max_depth, self.tree.n_heads)  # deeper limits cut nothing: the plan stands
        if self._plan is None or self._plan[0] != max_depth:
            self._plan = max_depth, *self._best(max_depth)
        return self._plan[1]

    @property
    def gain(self) -> float:
        """Expected tokens per second of the last plan over a plain step's (1.0 when none)."""
        return self._plan[2] * self.costs.batch_seconds(1) if self._plan is not None else 1.0

    def _best(self, max_depth: int) -> tuple[np.ndarray, float]:
        plain = np.zeros(1, dtype=np.int64), 1.0 / self.costs.batch_seconds(1)
        order = np.lexsort((self.tree.depth, -self.kept))
        order = order[(order != 0) & (self.tree.depth[order] <= max_depth)]
        if not len(order):
            return plain
        gain = 1.0 + np.cumsum(self.kept[order])
        seconds = self.tree_factor * np.array([self.costs.batch_seconds(n + 2) for n in range(len(order))])
        seconds += self.heads_seconds
        best = int(np.argmax(gain / seconds))
        if gain[best] / seconds[best] < MIN_GAIN * plain[1]:
            return plain
        return np.concatenate([[0], order[: best + 1]]), float(gain[best] / seconds[best])

    def wants_heads(self, n_nodes: int) -> bool:
        """Whether to run the heads this step: always with a tree; else every PROBE_EVERY plain steps, or seldom
        enough that probing costs at most PROBE_SHARE of a plain decode's time (heads over a large vocabulary),
        while a tree could pay."""
        if n_nodes > 1:
            self._idle = 0
            return True
        self._idle += 1
        every = max(self.PROBE_EVERY, round(self.probe_seconds / (self.PROBE_SHARE * self.costs.batch_seconds(1))))
        if self._idle < every:
            return False
        self._idle = 0
        return self._could_pay()

    def _could_pay(self) -> bool:
        """Whether a tree would pay if every head were always right: a chain of d nodes then commits d + 1 tokens,
        for its batch and the heads' fastest run (after two: the first may start numpy's threads; before, free)."""
        depth = np.arange(1, self.tree.n_heads + 1)
        heads = self._heads_fastest if self._heads_runs >= 2 else 0.0
        seconds = self.tree_factor * np.array([self.costs.batch_seconds(d + 1) for d in depth]) + heads
        return bool(((depth + 1) / seconds >= MIN_GAIN / self.costs.batch_seconds(1)).any())

    def observe(self, tokens: np.ndarray, new: list[int], heads_seconds: float, n_verified: int,
                verify_seconds: float) -> None:
        """After a step: the whole tree's candidate tokens (None: heads not run), the tokens committed, timings."""
        if tokens is not None or n_verified > 1:
            self._plan = None
        if tokens is not None:
            t = self.tree
            known = np.array(new + [-1] * (t.n_heads + 1 - len(new)))
            matched = (t.depth == 0) | (tokens == known[np.maximum(t.depth - 1, 0)])
            hit = ~(t.ancestors & ~matched).any(axis=1)  # every node on its path matched
            self.kept = self.memory * self.kept + (1 - self.memory) * hit
            self._heads_runs += 1
            self._heads_fastest = min(self._heads_fastest, heads_seconds)
            self.heads_seconds = self._average(self.heads_seconds, heads_seconds, self._heads_runs)
            if n_verified == 1:  # numpy's BLAS threads can slow the decode after the heads (docs/methods.md);
                # in a tree step that shows in the tree's batch time, and so in tree_factor
                slower = max(0.0, verify_seconds - self.costs.batch_seconds(1))
                self._probes += 1
                self.probe_seconds = self._average(self.probe_seconds, heads_seconds + slower, self._probes)
        if verify_seconds > 0 and n_verified > 1:
            # bounded: a tree priced out is not verified again, so one slow batch (a warm-up, a busy spell)
            # must not price trees out for good
            ratio = verify_seconds / (self.tree_factor * self.costs.batch_seconds(n_verified))
            self.tree_factor *= min(max(ratio, 1 / self.TREE_STEP_MOST), self.TREE_STEP_MOST) ** 0.3
        elif self.tree_factor > 1:
            # and a price raised by past tree batches ages while no tree runs, so trees priced out by a busy spell
            # are probed and tried again; trees that still cost more are dropped again by the steps above
            self.tree_factor = 1 + self.TREE_FORGET * (self.tree_factor - 1)

    def _average(self, mean: float, sample: float, n: int) -> float:
        """The mean of the first samples, then a running average: one that starts from zero would underrate the
        heads' time for a dozen steps, in which trees that do not pay run and probes come too often."""
        return mean + max(1 - self.TIMING_MEMORY, 1 / n) * (sample - mean)
