"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023), for any drafter.

A drafter proposes up to k tokens, the target scores them all in one batch, and `accept`
keeps the longest prefix that the target's own sampling would have kept. A draft may be a token tree
instead: the target keeps the path its own argmax takes through it, or when sampling, the path that
recursive rejection sampling over each node's children keeps (`walk`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..decoder import Decoder
from ..drafters import Draft, Drafter
from ..trees import walk
from ..sampling import SamplingParams, pick, probabilities, sample
from . import Step


def accept_greedy(target_logits: np.ndarray, drafts: list[int]) -> list[int]:
    """Drafts up to the first that differs from the target's argmax, then the target's own token."""
    best = target_logits.argmax(axis=-1)
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [int(best[n])]


def accept_sampled(p: np.ndarray, q: np.ndarray, drafts: list[int], rng: np.random.Generator) -> list[int]:
    """Rejection sampling: p is (k+1, V) from the target, q is (k, V) from the drafter.

    Draft token i survives with probability min(1, p_i/q_i); the first rejected position
    is resampled from norm(max(0, p - q)); if all survive, a bonus token comes from p[k].
    The result is distributed exactly as sampling from p token by token.
    """
    k = len(drafts)
    rows = np.arange(k)
    px, qx = p[rows, drafts], q[rows, drafts]
    kept = rng.random(k) * qx <= px
    n = k if kept.all() else int(np.argmin(kept))
    dist = np.maximum(p[n] - q[n], 0.0) if n < k else p[k]
    return drafts[:n] + [sample(dist, rng)]


def speculative(
    target: Decoder,
    drafter: Drafter,
    k_max: int,
    last: int,
    limit: int,
    params: SamplingParams,
    rng: np.random.Generator,
) -> Iterator[Step]:
    """Yield the tokens each target pass commits, at most `limit` in all; `last` is not yet decoded."""
    while limit > 0:
        # tokens the target deferred after a tree (see commit_tree_path) take draft slots: same batch size
        k = max(0, min(k_max - target.n_deferred, limit - 1))
        draft = drafter.propose(target.history + [last], k, params, rng)
        drafts = draft.tokens
        if draft.tree is not None:  # greedy: the target's own picks node by node; sampling: recursive rejection
            nodes = np.array([last, *drafts])
            logits = target.tree_logits(nodes, draft.tree.parents)
            q = None if draft.q is None else [None, *pad_vocab(draft.q, logits.shape[-1])]
            path, nxt = walk(draft.tree, nodes, logits, params, rng, q)
            target.commit_tree_path(path)
            new = [int(t) for t in nodes[path[1:]]] + [nxt]
        else:
            new = verify_chain(target, last, draft, params, rng)
        drafter.observe(len(drafts), len(new) - 1)
        yield Step(new, len(drafts))
        last = new[-1]
        limit -= len(new)


def verify_chain(target: Decoder, last: int, draft: Draft, params: SamplingParams, rng: np.random.Generator) -> list[int]:
    """One target pass over [last, *draft.tokens]: the tokens it commits. The cache keeps all but the last of them,
    and the pass's row for the last (its logits, its hidden state) is row len(new) - 1."""
    drafts = draft.tokens
    logits = target.feed([last, *drafts], view=True)
    if not drafts:
        new = [pick(logits[-1], params, rng)]
    elif params.greedy:
        new = accept_greedy(logits, drafts)
    else:
        p = probabilities(logits, params)
        new = accept_sampled(p, pad_vocab(draft.q, p.shape[-1]), drafts, rng)
    target.rollback_to(len(target.history) - len(drafts) + len(new) - 1)
    return new


def pad_vocab(q: np.ndarray, n_vocab: int) -> np.ndarray:
    """Draft distributions over the target's vocabulary (the target's padding rows get q = 0)."""
    if q.shape[-1] == n_vocab:
        return q
    return np.pad(q, [(0, 0), (0, n_vocab - q.shape[-1])])
