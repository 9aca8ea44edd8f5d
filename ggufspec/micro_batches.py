"""How llama.cpp splits a batch of several sequences' tokens into micro-batches (its `split_equal`, on a cache with a
KV stream per sequence: a pool's slots), and the paddings that run uneven chains as one: what a shared batch costs
(costs.table prices it) and how shared_context.SharedContext lays it out."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache


def micro_batches(lanes: Sequence[int]) -> list[int]:
    """The micro-batches (their token counts) llama.cpp runs a batch of `lanes[s]` tokens of each sequence s in, on
    a cache with a KV stream per sequence (the slots'): each takes as many tokens of every sequence in a run of
    consecutive ids, starting at the lowest with tokens left (llama_batch_allocr::split_equal, sequential). So
    chains of unequal lengths take several passes: 1 + 1 + 4 tokens of sequences 0, 1, 2 run as 3 tokens, then 3.
    (llama.cpp also caps each at n_ubatch tokens: prefill chunks; verification chains stay far below it.)"""
    return [seqs * each for seqs, each in _micro_shapes(tuple(lanes))]


def micro_shapes(lanes: Sequence[int]) -> list[tuple[int, int]]:
    """micro_batches' passes as (sequences, tokens of each): their price depends on both (CostModel.micro_seconds)."""
    return list(_micro_shapes(tuple(lanes)))


Price = Callable[[int, int], float]  # seconds for a micro-batch of `each` tokens in each of `seqs` sequences


def even_lanes(lanes: Sequence[int], seconds: Price, longest: int) -> tuple[int, ...]:
    """`lanes` with the shorter ones padded up to a common length of at most `longest` (a step's chain), the idle
    sequences among them (0) too or not, where that costs less by `seconds` (a micro-batch's price by its shape) than
    the micro-batches of the lanes as they are; else as they are. Uneven chains, or busy slots with idle ones between
    them, run in several micro-batches, each priced near a pass of its own; padded, they run in one, which on a CPU
    costs far less than the passes' sum. Prompt chunks are not padded, nor idle sequences beside
    them: llama.cpp also cuts those at n_ubatch, which micro_batches does not price. The pads' outputs are not read
    and their cells are removed after the batch (shared_context.SharedContext), so no sequence's tokens change: each
    sequence's rows attend only to its own stream, its earlier tokens."""
    return _cheapest(lanes, seconds, longest)[0]


def padded_seconds(lanes: Sequence[int], seconds: Price, longest: int) -> float:
    """What the batch of `lanes` costs by `seconds`, padded as even_lanes pads it."""
    return _cheapest(lanes, seconds, longest)[1]


def _cheapest(lanes: Sequence[int], seconds: Price, longest: int) -> tuple[tuple[int, ...], float]:
    best, cheapest = (), math.inf
    for padded, shapes in _paddings(tuple(lanes), longest):
        total = 0.0
        for seqs, each in shapes:  # (a loop, not sum() of a generator: `auto` prices many lanes a plan)
            total += seconds(seqs, each)  # CostModel.micro_seconds remembers each shape's price
        if total < cheapest:
            best, cheapest = padded, total
    return best, cheapest


# `auto` prices each slot's draft lengths every step (SharedBatch), on lanes that recur tick after tick while the prices
# change: the paddings are searched once per lanes, and each step only prices them
@lru_cache(maxsize=4096)
def _paddings(lanes: tuple[int, ...], longest: int) -> tuple[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], ...]:
    """The lanes as they are, then each padding even_lanes weighs (each once), with its micro-batches' shapes."""
    first = lanes[0] if lanes else 0
    if first and lanes.count(first) == len(lanes):  # every sequence with as many tokens: one micro-batch, no padding
        return ((lanes, ((len(lanes), first),)),)
    out, seen = [(lanes, _micro_shapes(lanes))], {lanes}
    steps = max(lanes, default=0) <= longest  # no prompt's chunk: idle sequences may be padded too
    for m in sorted({n for n in lanes if 0 < n <= longest}):
        busy = tuple(max(n, m) if n else 0 for n in lanes)
        for padded in (busy, tuple(max(n, m) for n in lanes)) if steps else (busy,):
            if padded not in seen:
                seen.add(padded)
                out.append((padded, _micro_shapes(padded)))
    return tuple(out)


@lru_cache(maxsize=4096)  # `auto` prices every draft length against the same lanes each step
def _micro_shapes(lanes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    left, shapes = list(lanes), []
    while True:
        first = next((i for i, n in enumerate(left) if n), None)
        if first is None:
            return tuple(shapes)
        end = first
        while end < len(left) and left[end]:
            end += 1
        m = min(left[first:end])
        for i in range(first, end):
            left[i] -= m
        shapes.append((end - first, m))
