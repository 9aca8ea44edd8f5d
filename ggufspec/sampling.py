"""Sampling settings and the logits -> probabilities transform shared by target and draft.

Speculative sampling is exact only if p (target) and q (draft) go through the same
transform, so there is exactly one: temperature, then top-k, top-p and min-p filters
on the tempered distribution, renormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import GGUFSpecError

# Temperatures below this are greedy (the limit T -> 0), in sampling and verification alike: every consumer asks
# `SamplingParams.greedy`. Why 1e-30: below it the tempered distribution already is the argmax's one-hot in float32
# (exp(-gap/T) underflows once a logit gap exceeds 104 T = 1e-28, less than the spacing of float32 numbers over
# 1e-20), and above it logits * (1/T) stays finite for |logits| up to 3e8, a wide margin over real models' logits.
# Without it, logits * (1/T) overflowed float32 from T = 3e-38 (logits of 10) and every probability was NaN.
GREEDY_BELOW = 1e-30


class DistributionError(GGUFSpecError):
    """A row of probabilities could not be made: its logits were not finite numbers (NaN or infinite). The model's
    fault (a damaged file, a broken backend), never a request's."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or any below GREEDY_BELOW) means greedy (argmax); top_k 0, top_p 1 and min_p 0 turn a filter
    off. A temperature must be finite: infinity would make every token equally likely."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one so small that only the argmax keeps any probability."""
        return self.temperature < GREEDY_BELOW


def suppress(logits: np.ndarray, tokens: np.ndarray | None) -> np.ndarray:
    """`logits` with the columns of `tokens` at -inf, a copy (the rows are often llama.cpp's buffer); the same
    array when `tokens` is None. llama-server's ignore_eos: end-of-generation tokens are never picked, so the
    target's distribution is the one over the other tokens, and greedy its argmax among them."""
    if tokens is None:
        return logits
    out = np.array(logits, dtype=np.float32)
    out[..., tokens] = -np.inf
    return out


def softmax(logits: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Row-wise softmax of `logits * scale`, float32, rows normalised by float64 sums.

    exp runs in float32 because numpy vectorises it: float64's took 0.9 ms a 49k-token row here, float32's 0.08 ms
    (docs/engine-overhead.md). The sums stay float64 (float32 sums drift enough to bias chi-square tests).
    """
    z = _weights(logits, scale)
    sums = z.sum(axis=-1, keepdims=True, dtype=np.float64)
    _check_mass(sums)
    z /= sums
    return z


def _check_mass(mass: np.ndarray | float) -> None:
    """DistributionError unless every row's mass (its weights' sum) is a finite number > 0: a NaN or infinite
    logit makes it NaN, and a row of NaN would pick a junk token silently."""
    if not np.all(np.isfinite(mass) & (np.asarray(mass) > 0)):
        raise DistributionError("the model's logits are not finite numbers (NaN or infinite), so no token can be "
                                "chosen: the model file may be damaged, or its backend computed garbage)")


def _weights(logits: np.ndarray, scale: float) -> np.ndarray:
    """exp(logits * scale - row max) in float32: softmax before normalising, a new array (never the caller's rows,
    often llama.cpp's buffer)."""
    z = np.multiply(logits, scale, dtype=np.float32)
    z -= z.max(axis=-1, keepdims=True)
    return np.exp(z, out=z)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Transformed distribution for each row of `logits` (shape (..., V)); float32, rows sum to 1. The filters work
    on the tempered weights (softmax before normalising: each keeps what it would of the distribution), and the
    rows are normalised once, by float64 sums."""
    if params.greedy:
        out = np.zeros(logits.shape, dtype=np.float32)
        np.put_along_axis(out, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    scale = 1.0 / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        probs = _top_k_weights(logits, params.top_k, scale)
    else:
        probs = _weights(logits, scale)
    mass = probs.sum(axis=-1, keepdims=True, dtype=np.float64)
    _check_mass(mass)
    if params.top_p < 1.0:
        for row in probs.reshape(-1, probs.shape[-1]):
            _nucleus(row, params.top_p)
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max(axis=-1, keepdims=True)] = 0.0
    if params.top_p < 1.0 or params.min_p > 0.0:
        mass = probs.sum(axis=-1, keepdims=True, dtype=np.float64)
    probs /= mass
    return probs


def _top_k_weights(logits: np.ndarray, k: int, scale: float) -> np.ndarray:
    """_weights's, kept only for each row's k largest logits (and any tied with the k-th), 0 elsewhere: the tempered
    order is the logits' order, so the k-th is found among the logits, and exp runs on those kept alone (a 49k-token
    row's exp, then its partition, took 0.3 ms). A NaN logit is kept (partition puts it among the largest, and every
    comparison with it fails), so _check_mass sees it."""
    n_vocab = logits.shape[-1]
    rows = logits.reshape(-1, n_vocab)
    top = np.partition(rows, -k, axis=-1)[:, -k:]
    kept = rows >= top.min(axis=-1, keepdims=True)
    kept |= np.isnan(rows)
    at = np.flatnonzero(kept)  # (a 2-D nonzero took 0.27 ms)
    z = np.multiply(rows.ravel()[at], scale, dtype=np.float32)
    z -= np.multiply(top.max(axis=-1), scale, dtype=np.float32)[at // n_vocab]
    out = np.zeros(rows.size, dtype=np.float32)
    out[at] = np.exp(z)
    return out.reshape(logits.shape)


def _nucleus(p: np.ndarray, top_p: float) -> None:
    """Zero, in place, what top-p drops: keep the smallest prefix, by descending p (ties in index order), whose mass
    reaches top_p of the row's (the token that crosses it stays).

    Only tokens with p >= eps = (1 - top_p) * mass / 2V are sorted: every token below eps has at least mass - V*eps
    > top_p * mass before it, so it is dropped whatever the order (a full stable argsort of a 49k row took 6 ms).
    """
    total = p.sum(dtype=np.float64)
    eps = (1.0 - top_p) * total / (2 * len(p))
    candidates = np.flatnonzero(p >= eps)
    order = candidates[np.argsort(-p[candidates], kind="stable")]
    sorted_p = p[order].astype(np.float64)
    before = np.cumsum(sorted_p) - sorted_p
    keep = np.zeros(len(p), dtype=bool)
    keep[order[before < top_p * total]] = True
    p[~keep] = 0.0


SAMPLE_BLOCK = 256


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from a 1-D distribution (weights >= 0, not all 0; need not sum to 1), by inverse CDF;
    DistributionError when the weights hold a NaN or an infinity.

    Two levels, blocks of SAMPLE_BLOCK tokens then a token in the block: numpy's cumsum runs serially, and over a
    whole 49k vocabulary it took 0.16 ms a draw here (a draw per committed token, and per judged row when sampling).
    """
    n_full = len(probs) // SAMPLE_BLOCK * SAMPLE_BLOCK
    # a block's sum: pairwise, exact enough in the weights' own type; the running sums across blocks in float64
    sums = probs[:n_full].reshape(-1, SAMPLE_BLOCK).sum(axis=1)
    if n_full < len(probs):
        sums = np.append(sums, probs[n_full:].sum())
    cdf = np.cumsum(sums, dtype=np.float64)
    _check_mass(cdf[-1])
    r = rng.random() * cdf[-1]
    i = int(np.searchsorted(cdf, r, side="right"))
    if i >= len(sums):  # rounding put r at the very end: the last block of weight > 0
        i = int(np.flatnonzero(sums)[-1])
    block = probs[i * SAMPLE_BLOCK : (i + 1) * SAMPLE_BLOCK]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64), r - (cdf[i - 1] if i else 0.0), side="right"))
    if j >= len(block):  # likewise within the block (never a token of weight 0)
        j = int(np.flatnonzero(block)[-1])
    return i * SAMPLE_BLOCK + j


def argmax(logits: np.ndarray, best: int | None = None) -> int:
    """The greedy pick of one row of logits (`best`, where its argmax was worked out already); DistributionError where
    that logit is not a finite number (numpy's argmax picks the first NaN: a broken model would print junk)."""
    best = int(logits.argmax()) if best is None else int(best)
    if not np.isfinite(logits[best]):
        raise DistributionError(f"the model's logits are not finite numbers (the top one is {logits[best]}): a damaged "
                                "model file or a broken backend")
    return best


def pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax when greedy, else a draw from the transform."""
    if params.greedy:
        return argmax(logits)
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        return sample(probabilities(logits, params), rng)
    return sample(_weights(logits, 1.0 / params.temperature), rng)  # no filter: `sample` needs no normalising
