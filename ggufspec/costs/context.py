"""A cost model per context size: what a long prompt teaches must not price a short one."""

from __future__ import annotations

from .table import CostModel

# Costs are learned per context size: up to this many cached tokens, twice as many, four times... A batch attends to
# the whole context, and past this many cached tokens llama.cpp's CPU flash attention decodes a batch with other
# kernels than one token, so a batch's price against a decode changes with the context, and what a long prompt
# teaches must not price a short one. docs/methods.md#measured-constants: CONTEXT_SIZE
CONTEXT_SIZE = 256


class ContextCosts:
    """A CostModel per context size (up to CONTEXT_SIZE cached tokens, up to twice that, ...), each
    learning from the steps taken at its size: a batch attends to the whole context, so what a long
    prompt teaches must not price a short one. A size first used starts from the next smaller one."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self._by_size: dict[int, CostModel] = {0: base}

    def at(self, n_ctx: int) -> CostModel:
        size = self._size(n_ctx)
        if size not in self._by_size:
            smaller = self._by_size[max(s for s in self._by_size if s < size)]
            self._by_size[size] = smaller.copy()
        return self._by_size[size]

    def last_at(self, n_ctx: int) -> int:
        """The longest context that at() prices with the same model as n_ctx."""
        return CONTEXT_SIZE << self._size(n_ctx)

    @staticmethod
    def _size(n_ctx: int) -> int:
        return (max(n_ctx - 1, 0) // CONTEXT_SIZE).bit_length()
