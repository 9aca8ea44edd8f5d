"""Decoding methods: generators that yield the tokens each target pass commits, and the one table of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GGUFSpecError
from ..sampling import SamplingParams

from ..drafters import Drafter, LookupDrafter, ModelDrafter

if TYPE_CHECKING:
    from ..decoder import Decoder


@dataclass
class Step:
    """Tokens committed by one target pass, and how many draft tokens that pass verified."""

    tokens: list[int]
    drafted: int


@dataclass
class Run:
    """What a method's steps need for one generation; `last` (the prompt's last token) is not yet decoded."""

    target: Decoder
    last: int
    limit: int  # most tokens to commit
    params: SamplingParams
    rng: np.random.Generator
    k_max: int = 0  # speculative methods: most tokens drafted per step
    drafter: Drafter | None = None
    heads: Any = None  # medusa: its Heads and Tree
    tree: Any = None
    sizer: Any = None  # medusa: cuts the tree each step (None: the whole tree)
    typical: bool = False


@dataclass(frozen=True)
class Method:
    """A decoding method: what it needs loaded besides the target, and how its steps are made."""

    name: str
    help: str
    steps: Callable[[Run], Iterator[Step]]
    # speculative methods: their drafter, from (engine, settings, the draft decoder or None)
    drafter: Callable[[Any, Any, Decoder | None], Drafter] | None = None
    needs_draft: bool = False  # refuses to run without a draft model
    uses_draft: bool = False  # drafts with the draft model when one is loaded
    needs_heads: bool = False
    uses_heads: bool = False  # without a draft model, drafts with Medusa heads when they are loaded


def _autoregressive(r: Run) -> Iterator[Step]:
    return autoregressive(r.target, r.last, r.limit, r.params, r.rng)


def _speculative(r: Run) -> Iterator[Step]:
    return speculative(r.target, r.drafter, r.k_max, r.last, r.limit, r.params, r.rng)


def _medusa(r: Run) -> Iterator[Step]:
    return medusa(r.target, r.heads, r.tree, r.last, r.limit, r.params, r.rng, r.typical, r.sizer)


def _auto_steps(r: Run) -> Iterator[Step]:
    if r.heads is None:
        return _speculative(r)
    return medusa(r.target, r.heads, r.tree, r.last, r.limit, r.params, r.rng, False, r.sizer, r.drafter, r.k_max)


def _model_chains(engine, s, draft: Decoder) -> Drafter:
    return ModelDrafter(draft, engine.target.n_vocab, s.draft_p_min)


def _lookup(engine, s, draft: None) -> Drafter:
    return LookupDrafter(engine.target.n_vocab)


def _auto(engine, s, draft: Decoder | None) -> Drafter:
    return engine.auto_drafter(s, draft)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("autoregressive", "one target pass per token", _autoregressive),
    Method("vanilla", "draft model chains of --draft-max tokens", _speculative, _model_chains,
           needs_draft=True, uses_draft=True),
    Method("lookup", "n-grams of the text so far", _speculative, _lookup),
    Method("auto", "lookup, then the draft model (chains or trees) or else --medusa heads (a tree); sizes from a "
           "measured cost model; off when it cannot pay", _auto_steps, _auto, uses_draft=True, uses_heads=True),
    Method("medusa", "--medusa heads propose a token tree, verified in one target pass", _medusa, needs_heads=True),
)}


def get_method(name: str, has_draft: bool, has_heads: bool) -> Method:
    """The method called `name`; GGUFSpecError when it is unknown or needs a model that is not loaded."""
    m = METHODS.get(name)
    if m is None:
        raise GGUFSpecError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}.")
    if m.needs_draft and not has_draft:
        raise GGUFSpecError(f"method {name!r} needs a draft model (-d DRAFT.gguf).")
    if m.needs_heads and not has_heads:
        raise GGUFSpecError(f"method {name!r} needs Medusa heads (--medusa HEADS.gguf).")
    return m


def methods_help() -> str:
    """`name (what it does) | ...` for --help."""
    return " | ".join(f"{m.name} ({m.help})" for m in METHODS.values())


# at the end: the method modules import Step from here
from .autoregressive import autoregressive  # noqa: E402
from .medusa import medusa  # noqa: E402
from .speculative import speculative  # noqa: E402
