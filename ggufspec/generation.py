"""What a generation is asked (`GenerationSettings`, the `Prompt`) and what it answers (`GenerationResponse` per
committed token, `GenerationResult` at the end): the engine's and the pool's vocabulary, with no model in it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .chat import Message
from .methods import METHODS
from .sampling import SamplingParams
from .stats import Stats

StopReason = Literal["stop", "max_tokens", "length", "interrupted"]


@dataclass
class GenerationSettings:
    """What to generate and how; `method` None picks auto when a draft, Medusa heads or an MTP head are loaded."""

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: str | None = None  # a name in methods.METHODS
    draft_max: int = 4
    draft_p_min: float = 0.0
    seed: int | None = None  # None or negative: a random seed (llama-server's -1)
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    truncate_prompt: bool = False
    context_shift: bool = False  # when the context is full, drop older tokens instead of stopping
    medusa_tree: str | None = None  # method medusa: a tree name or JSON choices file (default: the heads' own, else mc_sim_7b_63)
    typical: bool = False  # method medusa at temperature > 0: typical acceptance, faster but NOT exact
    ignore_eos: bool = False  # llama-server's: end-of-generation tokens are never picked; runs to max_tokens

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft_max < 1:
            raise ValueError(f"draft_max must be >= 1, got {self.draft_max}")
        if not 0 <= self.draft_p_min <= 1:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.seed is not None and self.seed < 0:
            self.seed = None
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stop_reason: StopReason
    stats: Stats


Prompt = str | list[Message] | list[int]  # plain text, chat messages (rendered with the GGUF's template), or token ids


@dataclass
class GenerationResponse:
    """What `stream` yields: one committed token (the last response: none, with the finish reason and result).

    `text` is the text that became safe to show with this token (UTF-8 complete, no stop string), possibly
    empty; `from_draft` says the token was proposed by a draft (model, lookup or Medusa) and kept by the target.
    """

    text: str
    token: int | None
    from_draft: bool
    stats: Stats
    finish_reason: StopReason | None = None
    result: GenerationResult | None = None
