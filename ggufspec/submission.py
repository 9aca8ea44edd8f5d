"""What a slot's decode submits to its scheduler (`Submission`, a part of the next shared batch), the batch as it ran
(`BatchShape`), the decode coroutines that wait on it (`Steps`, `run_steps`), what runs a batch (`Runner`: a shared
context) and what runs its tick (`Scheduler`: lockstep.Lockstep)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from .micro_batches import micro_shapes


class BatchShape(NamedTuple):
    """A shared context's batch as llama.cpp ran it: the tokens of each sequence id (`lanes`, pads included) and its
    number among the lockstep's ticks (`tick`: every member's the same, so the batch is learned from once). The
    empty shape (NO_BATCH) is a context's own, with no other slot in it. (A NamedTuple: one is made every tick, and
    a frozen dataclass's making cost several times as much.)"""

    lanes: tuple[int, ...] = ()
    tick: int = -1

    @property
    def tokens(self) -> int:
        """Every sequence's tokens, pads included."""
        return sum(self.lanes)

    def passes(self) -> list[tuple[int, int]]:
        """The micro-batches llama.cpp ran it in, as (sequences, tokens of each) (micro_shapes)."""
        return micro_shapes(self.lanes)


NO_BATCH = BatchShape()


@dataclass
class Submission:
    """One view's part of a batch: n tokens, each at its position in its sequences; rows for those with `outputs`."""

    tokens: Sequence[int]  # (n,)
    positions: Sequence[int]  # (n,)
    seq_ids: Sequence[Sequence[int]]  # (n, *) the sequences each token belongs to
    outputs: Sequence[bool]  # (n,) which tokens' logits (and hidden states) come back
    hidden: bool = False  # hidden states too (the context's embeddings are turned on for the batch)
    argmax: bool = False  # each row's argmax too (`picks`): worked out as the batch ends, while its rows are in cache
    # the submitting slot's own sequence (its lane): a tree's tokens sit in its leaves' sequences, after it
    lane: int = 0
    embd: np.ndarray | None = None  # (n, H) an MTP head's input: the hidden row each token is read with (mtp.py)
    # filled by the batch's run
    rc: int = -1  # llama_decode's return code for the whole batch
    logits: np.ndarray | None = None  # (outputs, V) rows: a view of the batch's, valid until its context's next batch
    states: np.ndarray | None = None  # (outputs, H) with hidden
    picks: np.ndarray | None = None  # (outputs,) with argmax
    # the hidden rows llama.cpp keeps for an MTP head: a target's of every token (record_hidden), a head's own of
    # those with `outputs`
    nextn: np.ndarray | None = None
    seconds: float = 0.0  # the whole batch's decode time
    shape: BatchShape = NO_BATCH  # the whole batch's: (max lane + 1,) tokens per member's lane, and its tick
    done: bool = False  # its batch has run
    # where it runs: set by the slot that submits it
    lockstep: Scheduler | None = None
    runner: Runner | None = None


T = TypeVar("T")
# A decode coroutine: yields each Submission it waits on (resumed once its batch has run) and returns its result. On
# contexts of their own it yields none; run_steps runs one in the calling thread, a Lockstep task on its decode thread.
Steps = Generator[Submission, None, T]


def run_steps(steps: Steps[T]) -> T:
    """Run a decode coroutine to its end in the calling thread: each submission it yields waits for its tick
    (Lockstep.submit)."""
    try:
        sub = next(steps)
        while True:
            sub.lockstep.submit(sub.runner, sub)
            sub = next(steps)
    except StopIteration as end:
        return end.value


class Runner(Protocol):
    """A shared context: runs the submissions of one tick as one batch (under Lockstep.lock). A `leads` runner's
    batches run before the others' (a draft model's: see Lockstep)."""

    leads: bool

    def run(self, subs: list[Submission]) -> Sequence[int]:
        """Run `subs`; the tokens each sequence ran, by sequence id, pads included."""


class Scheduler(Protocol):
    """What runs a submission's tick (lockstep.Lockstep), as a decode coroutine's submissions reach it."""

    def submit(self, runner: Runner, sub: Submission) -> Submission:
        """Queue `sub` for `runner`'s next batch and wait until it has run (a member thread's decode)."""
