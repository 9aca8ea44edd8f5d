"""Prompt lookup: continue the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import threading
import time

import numpy as np

from . import NO_DRAFT, Context, Counters, Draft

# How far back a match is measured: a guess whose context repeats earlier text this long is a copy, not a chance
# n-gram (the policy prices the two apart, and lets only copies run past the draft length)
LONG_MATCH = 16


ANSWERS_MAX = 1 << 16  # tokens an AnswerPool keeps by default (512 KiB): a few hundred answers


class AnswerPool:
    """Answers generated earlier, in any slot and across requests, for lookup to continue where the text itself
    has no match (as llama.cpp's ngram-mod keeps one pool for all slots, and SuffixDecoding keeps past answers
    for agents): code an agent writes again, JSON shapes, boilerplate. Bounded: the latest `max_tokens` tokens;
    thread-safe (an answer is added by replacing the array, which readers never see change)."""

    SEPARATOR = -1  # between answers: a guess never runs from one answer into the next

    def __init__(self, max_tokens: int = ANSWERS_MAX) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = np.zeros(0, dtype=np.int64)  # answers, oldest first, SEPARATOR before each
        self._lock = threading.Lock()

    def add(self, answer: list[int]) -> None:
        """Keep `answer` (the oldest tokens go past max_tokens)."""
        if len(answer) < 2:
            return
        with self._lock:
            joined = np.concatenate([self.tokens, [self.SEPARATOR], np.asarray(answer, dtype=np.int64)])
            self.tokens = joined[-self.max_tokens:]


class LookupProposer:
    """Guesses from the text itself (and, given `answers`, from earlier answers where the text has no match):
    point-mass proposals, no model, no cost but the search."""

    name = "lookup"

    def __init__(self, n_vocab: int, ngram_max: int = 4, ngram_min: int = 2, answers: AnswerPool | None = None) -> None:
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min
        self.answers = answers
        self.match = 0  # how many tokens before the guess the last find() matched (up to LONG_MATCH)
        self.counters = Counters()
        # the last find: (context, its length, k, guess, match)
        self._last: tuple[list[int], int, int, list[int], int] | None = None
        self._seen: list[int] = []  # the last context searched, and as an array in _array's buffer
        self._buffer = np.zeros(0, dtype=np.int64)

    def find(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens continuing the longest (then latest) earlier match of the context's tail; sets `match`.
        A prefix of a longer guess is the shorter guess: find(c, n) == find(c, k)[:n] for n <= k, so a second call
        on the same context list (the policy's, then the proposal's) is answered from the first."""
        last = self._last
        if last is not None and last[0] is context and last[1] == len(context) and k <= last[2]:
            self.match = last[4]
            return last[3][:k]
        guess = self._find(context, k)
        self._last = (context, len(context), k, guess, self.match)
        return guess

    def _array(self, context: list[int]) -> np.ndarray:
        """The context as an int64 array: the last one's, extended, when it continues the last context searched (a
        step's context is the last step's plus what the pass committed). np.asarray of the whole list cost O(context)
        conversions every step; a list copy and compare are much cheaper."""
        n, m = len(context), len(self._seen)
        if not (m and n > m and context[:m] == self._seen):
            m = 0
        if n > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), n, 256), dtype=np.int64)
            grown[:m] = self._buffer[:m]
            self._buffer = grown
        self._buffer[m:n] = context[m:]
        self._seen = list(context)
        return self._buffer[:n]

    def _find(self, context: list[int], k: int) -> list[int]:
        ctx = self._array(context)
        self.match = 0
        # where an earlier occurrence of the last token ends an n-gram equal to the tail (one pass over the
        # context, then only those places: searched every step, so cheap against a target's decode)
        hits = np.flatnonzero(ctx[:-1] == ctx[-1])
        # grown one token at a time (the places matching the tail's last n tokens are among those matching its last
        # n - 1): the longest n-gram with a match, after a few numpy calls when the tail has none (most steps)
        found = None
        for n in range(1, min(self.ngram_max, len(ctx) - 1) + 1):
            if n > 1:
                hits = hits[hits >= n - 1]
                hits = hits[ctx[hits - (n - 1)] == ctx[-n]]
            if not len(hits):
                break
            if n >= self.ngram_min:
                found = hits
        if found is not None:
            hits = found
            # how far back each earlier occurrence matches the tail (up to LONG_MATCH): the longest wins, the
            # latest among equals (text that repeats a phrase often has a later, shorter chance match)
            back = np.arange(LONG_MATCH)
            before = hits[:, None] - back
            same = (before >= 0) & (ctx[np.maximum(before, 0)] == ctx[np.maximum(len(ctx) - 1 - back, 0)])
            lengths = np.where(same.all(axis=1), LONG_MATCH, same.argmin(axis=1))
            at = len(hits) - 1 - int(np.argmax(lengths[::-1]))
            start, self.match = int(hits[at]) + 1, int(lengths[at])
            # a match that runs into the tail is text repeating with this period: the guess goes on repeating
            # it, as a lookup fed its own guess would (a loop shorter than k would otherwise cap the guess)
            period = len(ctx) - start
            return ctx[start + np.arange(k) % period].tolist()
        return self._find_in_answers(ctx, k) if self.answers is not None else []

    def _find_in_answers(self, ctx: np.ndarray, k: int) -> list[int]:
        """The continuation, in earlier answers, of the longest (then latest) match of the context's tail."""
        pool = self.answers.tokens  # one snapshot: another slot may add an answer meanwhile
        ends = np.flatnonzero(pool[:-1] == ctx[-1])
        for n in range(min(self.ngram_max, len(ctx)), self.ngram_min - 1, -1):
            hits = ends[ends >= n - 1]
            for j in range(1, n):
                hits = hits[pool[hits - j] == ctx[-1 - j]]
            if len(hits):
                back = np.arange(min(LONG_MATCH, len(ctx)))
                before = hits[:, None] - back
                same = (before >= 0) & (pool[np.maximum(before, 0)] == ctx[len(ctx) - 1 - back])
                lengths = np.where(same.all(axis=1), len(back), same.argmin(axis=1))
                at = len(hits) - 1 - int(np.argmax(lengths[::-1]))
                start, self.match = int(hits[at]) + 1, int(lengths[at])
                guess = pool[start : start + k]
                cut = np.flatnonzero(guess == AnswerPool.SEPARATOR)
                return guess[: cut[0] if len(cut) else len(guess)].tolist()
        return []

    def begin(self, prompt: list[int], warm: bool) -> None:
        pass

    def propose(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Draft:
        if k <= 0:
            return NO_DRAFT
        t0 = time.perf_counter()
        tokens = self.find(context.tokens, k)
        c = self.counters
        c.seconds += time.perf_counter() - t0
        c.drafts += bool(tokens)
        c.drafted += len(tokens)
        return Draft(tokens, source=self.name)

    def accept(self, n_kept: int) -> None:
        self.counters.accepted += n_kept
