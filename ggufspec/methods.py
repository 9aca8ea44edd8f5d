"""Decoding methods, one table: the proposers each drafts from, the policy that decides, what it needs loaded.

Every method runs the same loop (loop.generate_steps) with one verifier; a method is a choice of proposers
(proposers.PROPOSERS) and a policy (policy/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import GGUFSpecError
from .policy import Fixed, Policy, SizedTree, WholeTree
from .proposers import PROPOSERS

if TYPE_CHECKING:
    from .trees import Tree


@dataclass(frozen=True)
class Method:
    """A decoding method. It drafts from each of its `proposers` whose model is loaded (`auto` from Medusa heads
    only without a draft model or an MTP head); `policy` is built from (engine, settings, the proposers used, Medusa's
    tree)."""

    name: str
    help: str
    proposers: tuple[str, ...]
    policy: Callable[[Any, Any, tuple[str, ...], Tree | None], Policy]
    needs: str | None = None  # "draft" or "heads": refuses to run without it; "mtp": auto runs instead (engine)
    draft_trees: bool = False  # the draft model proposes trees where the target holds their sequences
    answers: bool = False  # lookup continues earlier answers too (engine.answers) where its policy prices them

    def sources(self, has_draft: bool, has_heads: bool, has_mtp: bool = False) -> tuple[str, ...]:
        """The proposers this method drafts from with these models loaded."""
        loaded = {None, "draft" if has_draft else None, "heads" if has_heads else None, "mtp" if has_mtp else None}
        used = [p for p in self.proposers if PROPOSERS[p].needs in loaded]
        # Medusa heads draft only where no draft model or MTP head does (`auto` with both loaded uses those)
        return tuple(p for p in used if not (p == "medusa" and {"draft", "mtp"} & set(used)))


def _plain(engine, s, sources, tree) -> Policy:
    return Fixed(None)


def _fixed(engine, s, sources, tree) -> Policy:
    return Fixed(sources[0], s.draft_max)


def _auto(engine, s, sources, tree) -> Policy:
    return engine.auto_policy(s, "draft" in sources, tree, "mtp" in sources)


def _medusa(engine, s, sources, tree) -> Policy:
    # a tree named by the user runs whole; else the sizer cuts the default tree to what pays here
    return WholeTree(tree) if s.medusa_tree is not None else SizedTree(engine.tree_sizer(tree))


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("autoregressive", "one target pass per token", (), _plain),
    Method("vanilla", "draft model chains of --draft-max tokens", ("draft",), _fixed, needs="draft"),
    Method("lookup", "n-grams of the text so far", ("lookup",), _fixed),
    Method("auto", "lookup, then the draft model (chains or trees) or the target's MTP head, or else --medusa heads (a "
           "tree); sizes from a measured cost model; off when it cannot pay", ("lookup", "draft", "mtp", "medusa"),
           _auto, draft_trees=True, answers=True),
    Method("medusa", "--medusa heads propose a token tree, verified in one target pass", ("medusa",), _medusa,
           needs="heads"),
    Method("mtp", "the target's own MTP head (multi-token prediction layers: Qwen3.5/3.6) drafts chains of "
           "--draft-max tokens", ("mtp",), _fixed, needs="mtp"),
)}


def get_method(name: str, has_draft: bool, has_heads: bool) -> Method:
    """The method called `name`; GGUFSpecError when it is unknown or needs a model that is not loaded (`mtp` never:
    the engine runs `auto` where the target's MTP head cannot draft, and says why)."""
    m = METHODS.get(name)
    if m is None:
        raise GGUFSpecError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}.")
    if m.needs == "draft" and not has_draft:
        raise GGUFSpecError(f"method {name!r} needs a draft model (-d DRAFT.gguf).")
    if m.needs == "heads" and not has_heads:
        raise GGUFSpecError(f"method {name!r} needs Medusa heads (--medusa HEADS.gguf).")
    return m


def methods_help() -> str:
    """`name (what it does) | ...` for --help."""
    return " | ".join(f"{m.name} ({m.help})" for m in METHODS.values())
