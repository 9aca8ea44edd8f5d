"""Policies: what to draft each step, from what, and how much; told each pass's outcome and timing.

`plan` names a proposer and a size (a draft length, or a tree's nodes) or a plain step; `observe` hears what the
target kept and what the pass cost. A policy never calls a model and never reads a decoder's clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ..submission import NO_BATCH, BatchShape

if TYPE_CHECKING:
    from ..proposers import Context, Draft, Proposer
    from ..trees import Tree
    from ..verifier import Verdict


@dataclass(frozen=True)
class Plan:
    """One step: ask `source` for up to k tokens, or for the nodes of its static tree; source None: a plain step."""

    source: str | None = None
    k: int = 0
    nodes: np.ndarray | None = None  # (m,) int: tree node indices, root first ([0]: run it, verify nothing)


PLAIN = Plan()


class Timing(NamedTuple):
    """What a step cost: the target's pass (`batch`: the shared batch it rode in, as it ran; NO_BATCH on a context of
    its own), and the proposer's work (a draft model's decodes included). (A NamedTuple: every step of every slot
    makes one, and a frozen dataclass's making cost ~1.5 us more a step in a busy pool.)"""

    verify_seconds: float
    verify_tokens: int  # the target's batch: the draft, its root, deferred tokens in front (a shared batch: all)
    propose_seconds: float = 0.0
    draft_decodes: int = 0  # a draft model's batches and tokens this step (catching up on unseen context included)
    draft_tokens: int = 0
    draft_batched: int = 0  # the tokens of the whole draft batches (other slots' too, in a pool)
    batch: BatchShape = NO_BATCH
    draft_tick: int = -1  # the last draft batch's number, as batch.tick (where the step drafted in a pool)

    @property
    def passes(self) -> list[tuple[int, int]]:
        """The micro-batches the target's pass ran in, as (sequences, tokens of each): one of verify_tokens on a
        context of its own."""
        return (self.batch.passes() if self.batch.lanes else []) or [(1, self.verify_tokens)]


class Policy(Protocol):
    def begin(self, prompt: list[int], proposers: dict[str, Proposer]) -> set[str]:
        """A generation starts after `prompt`, drafting from `proposers` (which a policy may consult: lookup's
        match, a draft model's unseen context); the names of those worth warming up during the prefill."""

    def plan(self, context: Context, room: int, deferred: int) -> Plan:
        """The next step, at most `room` tokens before the limit; `deferred` tokens ride in front of its batch."""

    def observe(self, plan: Plan, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
        """What the step's proposal became (timing None: priced from the cost model alone, as replays are)."""


class Fixed:
    """Always the same proposer and length (`vanilla`, `lookup`), or plain steps (`autoregressive`): deferred tokens
    take draft slots, so every batch stays within k + 1 tokens."""

    def __init__(self, source: str | None, k: int = 0) -> None:
        self.source, self.k = source, k

    def begin(self, prompt: list[int], proposers: dict[str, Proposer]) -> set[str]:
        return {self.source} if self.source else set()

    def plan(self, context: Context, room: int, deferred: int) -> Plan:
        k = max(0, min(self.k - deferred, room - 1))
        return Plan(self.source, k) if self.source and k else PLAIN

    def observe(self, plan: Plan, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
        pass


class WholeTree:
    """`medusa` with a named tree: every node of it each step (fewer levels near the limit), once a hidden state
    is there to propose from."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree

    def begin(self, prompt: list[int], proposers: dict[str, Proposer]) -> set[str]:
        return set()

    def plan(self, context: Context, room: int, deferred: int) -> Plan:
        if context.hidden is None:
            return PLAIN
        tree = self.tree if self.tree.n_heads < room else self.tree.truncated(room - 1)
        return Plan("medusa", nodes=np.arange(tree.size))  # a cut tree's nodes are the first of the whole one

    def observe(self, plan: Plan, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
        pass


class SizedTree:
    """`medusa` without a named tree: the tree sizer's cut of it each step (see TreeSizer)."""

    def __init__(self, sizer: TreeSizer) -> None:
        self.sizer = sizer

    def begin(self, prompt: list[int], proposers: dict[str, Proposer]) -> set[str]:
        check_tree(self.sizer, proposers)
        return set()

    def plan(self, context: Context, room: int, deferred: int) -> Plan:
        if context.hidden is None:
            return PLAIN
        nodes = self.sizer.plan(max_depth=room - 1)
        return Plan("medusa", nodes=nodes) if self.sizer.wants_heads(len(nodes)) else PLAIN

    def observe(self, plan: Plan, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
        observe_tree(self.sizer, draft, verdict, timing)


def check_tree(sizer: TreeSizer, proposers: dict[str, Proposer]) -> None:
    """The sizer's plans are node indices into the Medusa proposer's tree: both must hold the same one."""
    if sizer.tree.choices != proposers["medusa"].tree.choices:
        raise ValueError("the tree sizer was built for another tree (or for this one before its cut to the heads' depth)")


def observe_tree(sizer: TreeSizer, draft: Draft, verdict: Verdict, timing: Timing | None) -> None:
    """A tree or plain step, told to the sizer: the heads' candidates (None where they did not run), the tokens
    committed, the heads' time, the nodes verified and the pass's time."""
    heads = timing.propose_seconds if timing else 0.0
    sizer.observe(draft.candidates, verdict.tokens, heads, 1 + len(draft.tokens), timing.verify_seconds if timing else 0.0)


from .tree_sizer import TreeSizer  # noqa: E402
