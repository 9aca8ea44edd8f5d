"""Prompt lookup: continue the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence

import numpy as np

from . import NO_DRAFT, Context, Counters, Draft, PlainSteps

# How far back a match is measured: a guess whose context repeats earlier text this long is a copy, not a chance
# n-gram (the policy prices the two apart, and lets only copies run past the draft length)
LONG_MATCH = 16


ANSWERS_MAX = 1 << 16  # tokens an AnswerPool keeps by default (512 KiB, 1.5 MiB with its pairs): a few hundred answers


class AnswerPool:
    """Answers generated earlier, in any slot and across requests, for lookup to continue where the text itself
    has no match (as llama.cpp's ngram-mod keeps one pool for all slots, and SuffixDecoding keeps past answers
    for agents): code an agent writes again, JSON shapes, boilerplate. Bounded: the latest `max_tokens` tokens;
    thread-safe (an answer is added by replacing the arrays, which readers never see change)."""

    SEPARATOR = -1  # between answers: a guess never runs from one answer into the next

    def __init__(self, max_tokens: int = ANSWERS_MAX) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        empty = np.zeros(0, dtype=np.int64)
        self._arrays = (empty, empty, empty)  # tokens, bigram codes sorted, where each ends: replaced together
        self._lock = threading.Lock()

    @property
    def tokens(self) -> np.ndarray:
        """Answers, oldest first, SEPARATOR before each."""
        return self._arrays[0]

    def add(self, answer: list[int]) -> None:
        """Keep `answer` (the oldest tokens go past max_tokens)."""
        if len(answer) < 2:
            return
        with self._lock:
            tokens, codes, ends = self._arrays
            joined = np.concatenate([tokens, [self.SEPARATOR], np.asarray(answer, dtype=np.int64)])
            dropped = max(0, len(joined) - self.max_tokens)
            # every two tokens that a guess could follow (not the last two), by the pair, then where they end: each
            # step finds the context's last two by bisection (1 us in a full pool), where a scan of the full pool
            # took 11 us alone and 35 beside a busy thread (it releases the GIL: see _longest_latest). The answer's
            # pairs (and the one ending at the last answer's last token) are merged into the sorted ones, where
            # sorting the whole pool again took 3.5 ms an answer in a full pool: in a busy pool, a stall of every slot
            first = max(1, len(tokens) - 1)  # where the first pair not sorted yet ends
            new = _bigrams(joined[first - 1 : -2], joined[first:-1])
            order = np.argsort(new, kind="stable")  # (stable: each code's ends ascending, after the older ones)
            at = np.searchsorted(codes, new[order], side="right")
            codes, ends = np.insert(codes, at, new[order]), np.insert(ends, at, order + first)
            if dropped:  # pairs whose first token went (all positions move back)
                kept = ends > dropped
                codes, ends = codes[kept], ends[kept] - dropped
            self._arrays = (joined[dropped:], codes, ends)

    def ends(self, first: int, second: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens, and where in them `first, second` ends, ascending (never at the last token: a guess follows)."""
        tokens, codes, ends = self._arrays  # one snapshot: another slot may add an answer meanwhile
        code = _bigrams(first, second)
        # bisect (on the array: no copy), not np.searchsorted, which releases the GIL (see _longest_latest)
        return tokens, ends[bisect.bisect_left(codes, code):bisect.bisect_right(codes, code)]


_UNSORTED: tuple[list[int], np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # no pairs sorted (never mutated)


def _bigrams(first: np.ndarray | int, second: np.ndarray | int) -> np.ndarray | int:
    """One int64 per pair of tokens (SEPARATOR included), elementwise."""
    return ((first + 1) << 32) | (second + 1)


class LookupProposer(PlainSteps):
    """Guesses from the text itself (and, given `answers`, from earlier answers where the text has no match):
    point-mass proposals, no model, no cost but the search."""

    name = "lookup"

    def __init__(self, n_vocab: int, ngram_max: int = 4, ngram_min: int = 2, answers: AnswerPool | None = None) -> None:
        self.n_vocab, self.ngram_max, self.ngram_min = n_vocab, ngram_max, ngram_min
        self.answers = answers
        self.match = 0  # how many tokens before the guess the last find() matched (up to LONG_MATCH)
        self.searches = 0  # contexts searched: find() answers a repeated question from its last search
        self.counters = Counters()
        # the last find: (context, its length, k, guess, match)
        self._last: tuple[list[int], int, int, list[int], int] | None = None
        self._seen: list[int] = []  # the last context searched, and as an array in _array's buffer
        self._buffer = np.zeros(0, dtype=np.int64)
        # each two tokens of the context searched -> where they end (ascending), up to its last token but one: kept
        # as the context grows (a Python int per token), so a step looks its tail up instead of comparing the whole
        # context, which past a few hundred tokens releases the GIL twice a step (see _longest_latest). A context
        # searched afresh (a prompt) has its pairs sorted at once instead (_sorted: the codes, as a list that bisect
        # reads fast, and where each ends), a third of the time of a dict built token by token; later ones go to _pairs
        self._sorted: tuple[list[int], np.ndarray] = _UNSORTED
        self._pairs: dict[int, list[int]] = {}
        self._paired = 1  # the first place whose pair is in neither yet

    def find(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens continuing the longest (then latest) earlier match of the context's tail; sets `match`.
        A prefix of a longer guess is the shorter guess: find(c, n) == find(c, k)[:n] for n <= k, so a second call
        on the same context list (the policy's, then the proposal's) is answered from the first."""
        last = self._last
        if last is not None and last[0] is context and last[1] == len(context) and k <= last[2]:
            self.match = last[4]
            return last[3][:k]
        self.searches += 1
        guess = self._find(context, k)
        self._last = (context, len(context), k, guess, self.match)
        return guess

    def _array(self, context: list[int]) -> np.ndarray:
        """The context as an int64 array: the last one's, extended, when it continues the last context searched (a
        step's context is the last step's plus what the pass committed). np.asarray of the whole list cost O(context)
        conversions every step; a list copy and compare are much cheaper."""
        n, m = len(context), len(self._seen)
        if not (m and n >= m and context[:m] == self._seen):
            m = 0
            self._pairs, self._paired = {}, 1
            self._sorted = _UNSORTED
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
        n_max = min(self.ngram_max, len(ctx) - 1)  # an earlier occurrence ends before the tail
        ends = None
        if n_max >= 2:  # where an earlier occurrence of the tail's last two tokens ends
            last = len(context) - 1
            if self._paired == 1:  # (a context of 3 tokens at least: one pair before the tail's)
                codes = _bigrams(ctx[: last - 1], ctx[1:last])
                order = np.argsort(codes, kind="stable")  # (stable: each code's ends ascending)
                self._sorted, self._paired = (codes[order].tolist(), order + 1), last
            pairs = self._pairs
            for end in range(self._paired, last):
                pairs.setdefault(_bigrams(context[end - 1], context[end]), []).append(end)
            self._paired = max(self._paired, last)
            code = _bigrams(context[-2], context[-1])
            codes, at = self._sorted  # (bisect, not np.searchsorted, which releases the GIL: see _longest_latest)
            ends = at[bisect.bisect_left(codes, code):bisect.bisect_right(codes, code)]
            later = pairs.get(code)
            if later:
                ends = np.concatenate([ends, np.array(later, dtype=np.int64)])
        hits = _grown(ctx, ends, ctx, n_max, self.ngram_min)
        if hits is not None:
            start, self.match = _longest_latest(ctx, hits, ctx, LONG_MATCH)
            # a match that runs into the tail is text repeating with this period: the guess goes on repeating
            # it, as a lookup fed its own guess would (a loop shorter than k would otherwise cap the guess)
            period = len(ctx) - start
            return ctx[start + np.arange(k) % period].tolist()
        return self._find_in_answers(ctx, k) if self.answers is not None else []

    def find_in_answers(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing the longest (then latest) match of the context's tail in earlier answers
        (`answers`, which must be set), as find() guesses where the text itself holds no match: never past the end of
        the answer matched; sets `match`."""
        return self._find_in_answers(np.asarray(context, dtype=np.int64), k)

    def _find_in_answers(self, ctx: np.ndarray, k: int) -> list[int]:
        """The continuation, in earlier answers, of the longest (then latest) match of the context's tail."""
        n_max = min(self.ngram_max, len(ctx))
        if n_max < self.ngram_min:
            return []
        pool, ends = self.answers.tokens, None
        if n_max >= 2:  # where the tail's last two tokens end (one snapshot: another slot may add an answer meanwhile)
            pool, ends = self.answers.ends(int(ctx[-2]), int(ctx[-1]))
        hits = _grown(pool, ends, ctx, n_max, self.ngram_min)
        if hits is None:
            return []
        start, self.match = _longest_latest(pool, hits, ctx, min(LONG_MATCH, len(ctx)))
        guess = pool[start : start + k].tolist()
        return guess[: guess.index(AnswerPool.SEPARATOR)] if AnswerPool.SEPARATOR in guess else guess

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


def _grown(source: np.ndarray, pairs: np.ndarray | None, ctx: np.ndarray, n_max: int, n_min: int) -> np.ndarray | None:
    """Where in `source` the longest tail of `ctx` (n_min to n_max tokens) ends, from `pairs`, where its last two end
    (None: not looked up, the tail being shorter); None if nowhere. With no pair, a one-token tail is searched for
    (one pass over `source`) only where n_min allows it. Grown one token at a time: the places matching the last
    n + 1 are among those matching the last n, so a tail with no match (most steps) costs a few numpy calls."""
    hits, n = pairs, 2
    if pairs is None or (not len(pairs) and n_min < 2):
        hits, n = np.flatnonzero(source[:-1] == ctx[-1]), 1
    found = hits if len(hits) and n >= n_min else None
    while len(hits) and n < n_max:
        n += 1
        hits = hits[hits >= n - 1]
        hits = hits[source[hits - (n - 1)] == ctx[-n]]
        if len(hits) and n >= n_min:
            found = hits
    return found


def _longest_latest(source: np.ndarray, hits: np.ndarray, ctx: np.ndarray, cap: int) -> tuple[int, int]:
    """Of the places `hits` in `source`, the one that matches the tail of `ctx` furthest back (up to `cap` tokens),
    the latest among equals (text that repeats a phrase often has a later, shorter chance match): where its
    continuation starts, and how far back it matches.

    Counted without argmin or argmax: like np.searchsorted, and comparisons and nonzero over more than a few hundred
    elements, they release the GIL, and each release may hand the interpreter to another busy thread (a server's
    request threads, a member thread), so beside busy threads such a call takes several times its CPU time alone
    (docs/engine-overhead.md)."""
    back = np.arange(cap)
    before = hits[:, None] - back
    same = (before >= 0) & (source[np.maximum(before, 0)] == ctx[np.maximum(len(ctx) - 1 - back, 0)])
    lengths = same.cumprod(axis=1).sum(axis=1).tolist()  # the leading matches of each
    longest = max(lengths)
    at = len(lengths) - 1 - lengths[::-1].index(longest)
    return int(hits[at]) + 1, longest
