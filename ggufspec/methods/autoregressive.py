"""The baseline: one target decode per token. The reference for output and for speed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..decoder import Decoder
from ..sampling import SamplingParams, pick
from . import Step


def autoregressive(
    target: Decoder, last: int, limit: int, params: SamplingParams, rng: np.random.Generator
) -> Iterator[Step]:
    """Yield one token per target pass, at most `limit`; `last` is not yet decoded."""
    for _ in range(limit):
        last = pick(target.feed([last], view=True)[-1], params, rng)
        yield Step([last], 0)
