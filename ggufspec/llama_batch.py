"""A thin llama_batch layer: numpy views over one preallocated batch, any sequence ids per token.

llama-cpp-python's own LlamaBatch helpers only ever use sequence 0; trees need several.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp
import numpy as np


class Batch:
    """One llama_batch of `capacity` tokens, each in up to `n_seq_max` sequences."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self._batch = llama_cpp.llama_batch_init(capacity, 0, n_seq_max)
        b = self._batch
        self.token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self._seq_rows = [np.ctypeslib.as_array(b.seq_id[i], shape=(n_seq_max,)) for i in range(capacity)]
        for row in self._seq_rows:
            row[0] = 0
        self.n_seq_id[:] = 1
        # Between fills every slot is in sequence 0 alone: fill_tree writes only the slots it puts elsewhere, listed
        # here for reset_sequences (a single stream's every token is in sequence 0: four numpy item writes saved)
        self._moved: list[int] = []

    def fill(self, tokens: Sequence[int], start_pos: int, all_logits: bool) -> None:
        """Tokens at consecutive positions in sequence 0; logits for all of them or only the last."""
        if self._moved:  # (a fill whose decode failed before its reset)
            self.reset_sequences()
        n = len(tokens)
        if n == 1:  # a decode step: item writes, not numpy slices (a third of the time)
            self.token[0], self.pos[0], self.logits[0] = tokens[0], start_pos, 1
            self._batch.n_tokens = 1
            return
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds its capacity {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = np.arange(start_pos, start_pos + n)
        self.logits[:n] = 1 if all_logits else 0
        self.logits[n - 1] = 1
        self._batch.n_tokens = n

    def fill_tree(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]]) -> None:
        """Tree tokens: each with its own position and set of sequence ids; logits for all."""
        if self._moved:  # (a fill whose decode failed before its reset)
            self.reset_sequences()
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"tree of {n} nodes exceeds the batch capacity {self.capacity}")
        if n == 1:  # a decode step: item writes, not numpy slices
            self.token[0], self.pos[0], self.logits[0] = tokens[0], positions[0], 1
        else:
            self.token[:n] = tokens
            self.pos[:n] = positions
            self.logits[:n] = 1
        for i, ids in enumerate(seq_ids):
            if len(ids) == 1:
                if ids[0]:  # (an item write)
                    self._seq_rows[i][0] = ids[0]
                    self._moved.append(i)
                continue
            if len(ids) > self.n_seq_max:
                raise ValueError(f"node {i} is in {len(ids)} sequences; the context allows {self.n_seq_max}")
            self._seq_rows[i][: len(ids)] = ids
            self.n_seq_id[i] = len(ids)
            self._moved.append(i)
        self._batch.n_tokens = n

    def fill_entries(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                     outputs: Sequence[bool]) -> None:
        """Tokens of any sequences (several slots' steps in one batch); logits for those with `outputs`."""
        self.fill_tree(tokens, positions, seq_ids)
        if len(tokens) == 1:
            self.logits[0] = outputs[0]
        else:
            self.logits[: len(tokens)] = outputs

    def reset_sequences(self) -> None:
        """Put the slots the last fill put in other sequences back in sequence 0 alone (after the decode)."""
        for i in self._moved:
            self._seq_rows[i][0] = 0
            self.n_seq_id[i] = 1
        self._moved.clear()

    @property
    def struct(self) -> llama_cpp.llama_batch:
        return self._batch

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
