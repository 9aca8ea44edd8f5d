"""Proposers: where draft tokens come from. Each only proposes; the verifier judges, the policy decides.

A proposer follows llama.cpp's `common_speculative` sources: `begin` when a generation starts, `propose` up to
k tokens after a context, `accept` how many of them the target kept, with its own counters. Adding one is a file
here and a row in `PROPOSERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..sampling import SamplingParams
from ..trees import Tree

if TYPE_CHECKING:
    from ..decoder import Decoder
    from ..submission import Steps
    from ..medusa.heads import Heads


class Context:
    """What a proposer may read: the tokens so far, the last not yet decoded by the target, and the target's
    hidden state at the position that picked that last token (None before the first verification)."""

    __slots__ = ("_history", "_last", "_tokens", "hidden")

    def __init__(self, tokens: list[int], hidden: np.ndarray | None = None) -> None:
        self._tokens: list[int] | None = tokens  # (n,) prompt and committed tokens
        self.hidden = hidden  # (H,) float32

    @classmethod
    def after(cls, history: list[int], last: int, hidden: np.ndarray | None = None) -> Context:
        """`history` then `last`, joined when first read: a plain step reads nothing, and the copy is O(context).
        `history` must not change while the context is in use (the step's plan and proposal)."""
        context = cls([], hidden)
        context._tokens, context._history, context._last = None, history, last
        return context

    def __len__(self) -> int:
        """How many tokens: read without joining them."""
        return len(self._tokens) if self._tokens is not None else len(self._history) + 1

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self._history + [self._last]
        return self._tokens


@dataclass(frozen=True)
class Draft:
    """Proposed tokens after the context's last token (the root): a chain, or the nodes of a tree.

    q: when sampling, the distribution each token was drawn from (None: point-mass guesses, which the verifier
    judges as one-hot rows; exact either way). candidates: every node token of a proposer's whole static tree,
    root first, when it computed them (Medusa), so a policy learns about nodes that were not verified.
    """

    tokens: list[int]  # (n,)
    tree: Tree | None = None  # None: a chain, parents [-1, 0, 1, ...] over [root, *tokens]
    q: np.ndarray | None = None  # (n, V_draft) float
    source: str = ""
    candidates: np.ndarray | None = None  # (tree size,) int64

    @property
    def depth(self) -> int:
        """Draft positions the target judges along one path: a chain's length, a tree's depth."""
        return len(self.tokens) if self.tree is None else int(self.tree.depth.max())


NO_DRAFT = Draft([])


@dataclass
class Counters:
    """A proposer's own record, as llama.cpp's sources keep theirs."""

    drafts: int = 0  # proposals with at least one token
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, kept by the target
    seconds: float = 0.0  # spent proposing (a draft model's decodes included)
    decodes: int = 0  # a draft model's batches...
    decoded: int = 0  # ...and the tokens in them (a catch-up on unseen context is one batch of many)
    batched: int = 0  # the tokens of the whole batches they ran in (other slots' too, in a pool's shared context)
    tick: int = -1  # in a pool's shared context, the number of the last batch it decoded in (submission.BatchShape.tick)


class Proposer(Protocol):
    name: str
    counters: Counters

    def begin(self, prompt: list[int], warm: bool) -> None:
        """A generation starts after `prompt` (in the target's cache: its last row picked the first token); warm:
        decode it now where proposing will need it (a draft model's cache), else on first use."""

    def propose(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Draft:
        """Up to k tokens after the context (none when k is 0); a tree proposer proposes the nodes of its static
        tree given by plan_nodes (root first)."""

    def accept(self, n_kept: int) -> None:
        """The target kept the first n_kept tokens of the last proposal."""

    # begin and propose as decode coroutines (submission.Steps), which a pool's generations run: a proposer that decodes
    # nothing takes PlainSteps' (the plain calls)
    def begin_steps(self, prompt: list[int], warm: bool) -> Steps[None]: ...

    def propose_steps(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Steps[Draft]: ...


class PlainSteps:
    """begin_steps and propose_steps of a proposer that decodes nothing: its plain calls, waiting on no tick."""

    def begin_steps(self, prompt: list[int], warm: bool) -> Steps[None]:
        self.begin(prompt, warm)
        return
        yield  # never reached: a generator that waits on nothing

    def propose_steps(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Steps[Draft]:
        return self.propose(context, k, plan_nodes)
        yield


@dataclass
class Setup:
    """What a proposer is built from."""

    target: Decoder
    params: SamplingParams
    rng: np.random.Generator
    draft: Decoder | None = None
    draft_p_min: float = 0.0
    tree_leaves: int = 0  # draft trees of up to this many leaves (the target holds one sequence more); <= 1: chains
    heads: Heads | None = None
    tree: Tree | None = None  # Medusa's static tree, cut to the heads' depth
    answers: AnswerPool | None = None  # earlier answers lookup may continue (auto's: it prices their guesses)
    suppressed: np.ndarray | None = None  # token ids the target never picks (ignore_eos): drafts leave them out
    mtp: Decoder | None = None  # the target's MTP head (mtp.MtpDecoder)


@dataclass(frozen=True)
class Source:
    """A row of PROPOSERS: how the proposer is built, and the model it needs loaded (None: nothing)."""

    build: Callable[[Setup], Proposer]
    needs: str | None = None  # "draft", "heads" or "mtp"
    help: str = ""


def _lookup(s: Setup) -> Proposer:
    return LookupProposer(s.target.n_vocab, answers=s.answers)


def _draft_model(s: Setup) -> Proposer:
    assert s.draft is not None
    return DraftModelProposer(s.draft, s.target.n_vocab, s.params, s.rng, s.draft_p_min, s.tree_leaves, s.suppressed)


def _mtp(s: Setup) -> Proposer:
    assert s.mtp is not None
    # chains, as llama.cpp's draft-mtp: the heads served are qwen35's, whose hybrid memory holds no token trees
    return MtpProposer(s.mtp, s.target.n_vocab, s.params, s.rng, s.draft_p_min, 0, s.suppressed)


def _medusa(s: Setup) -> Proposer:
    assert s.heads is not None and s.tree is not None
    return MedusaProposer(s.heads, s.tree)


# at the end: the proposer modules import Draft and Counters from here
from .draft_model import DraftModelProposer  # noqa: E402
from .lookup import AnswerPool, LookupProposer  # noqa: E402
from .medusa import MedusaProposer  # noqa: E402
from .mtp import MtpProposer  # noqa: E402

PROPOSERS: dict[str, Source] = {
    "lookup": Source(_lookup, help="n-grams of the text so far"),
    "draft": Source(_draft_model, "draft", "a draft model's chains or trees"),
    "medusa": Source(_medusa, "heads", "Medusa heads on the target's hidden state, a token tree"),
    "mtp": Source(_mtp, "mtp", "the target's own MTP head (multi-token prediction layers), chains"),
}
