"""Token histories: how much of two agree."""

from __future__ import annotations

import numpy as np


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, compared in C (histories run to thousands of tokens)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    head = max(0, n - 32)  # they mostly part near the end (a draft catching up on a pass): no arrays then
    if a[:head] == b[:head]:
        return next(i for i in range(head, n) if a[i] != b[i])
    return int(np.flatnonzero(np.asarray(a[:head]) != np.asarray(b[:head]))[0])
