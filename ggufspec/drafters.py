"""Where draft tokens come from: a draft model, or n-gram lookup in the text so far (`auto` uses both).

A drafter returns up to k tokens after `context` and, when sampling, the distribution q each
was drawn from (one-hot rows for deterministic proposals, which keeps rejection sampling exact).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .decoder import Decoder
from .sampling import SamplingParams, probabilities, sample, softmax


class Drafter(Protocol):
    def propose(
        self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        """Up to k tokens after `context`, and their q rows (None when greedy)."""


class ModelDrafter:
    """A small model sharing the target's vocabulary; stops early when its top probability < p_min."""

    def __init__(self, draft: Decoder, n_vocab: int, p_min: float = 0.0) -> None:
        self.draft, self.n_vocab, self.p_min = draft, n_vocab, p_min

    def propose(self, context, k, params, rng):
        logits = self.draft.sync(context, view=True)[-1, : self.n_vocab]
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        while True:
            if params.greedy:
                tokens.append(int(logits.argmax()))
            else:
                qs.append(probabilities(logits, params))
                tokens.append(sample(qs[-1], rng))
            if len(tokens) == k or (self.p_min > 0 and softmax(logits).max() < self.p_min):
                break
            logits = self.draft.feed([tokens[-1]], view=True)[-1, : self.n_vocab]
        return tokens, np.stack(qs) if qs else None


class LookupDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, n_vocab: int, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min

    def find(self, context: list[int], k: int) -> list[int]:
        ctx = np.asarray(context)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            tail = ctx[-n:]
            # windows starting at 0 .. len-n-1: every occurrence that ends before the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ctx[start : start + k].tolist()
        return []

    def propose(self, context, k, params, rng):
        tokens = self.find(context, k)
        if params.greedy or not tokens:
            return tokens, None
        q = np.zeros((len(tokens), self.n_vocab))
        q[np.arange(len(tokens)), tokens] = 1.0
        return tokens, q

