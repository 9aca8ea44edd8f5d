"""Medusa heads at run time: float32 stacked arrays, top-k candidates per head from one hidden state.

Head i: x = ResBlock_{L-1}(...ResBlock_0(h)), ResBlock(x) = x + SiLU(W x + b); logits_i = LM_i x, where
LM_i is the head's own LM head (v1) or the target's output matrix (v2). Head i predicts the token i + 2
positions after the one whose last hidden state h is (head 0 guesses the token after next). Weights may be
stored as f16 or q8_0 in the GGUF; they are dequantized once to float32, so every product runs in BLAS
with f32 sums.

A restricted candidate vocabulary (`candidates`: the N lowest ids, or a file of ids) keeps only those
rows of the LM heads, sliced once at load: each step multiplies by H x N instead of H x V, and the
top-k are mapped back to real token ids. The target's special/control tokens always stay in the set.
Exactness does not depend on it (the target verifies every proposal); only acceptance can drop.

The GGUF layout of a head set, and its reader and writers, are in `format.py`; this module re-exports the
names other modules import from here (ARCH, the KEY_* names, `load_medusa_gguf`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType, quants

from ..errors import ModelFileError
from ..gguf_check import GGUFHeader, TensorInfo, read_header
from .candidates import CandidateVocabError, Candidates, candidate_ids
from .format import ARCH, HeadSet, Keys, read_heads

if TYPE_CHECKING:  # not at run time: the converter and `medusa train` import this module without loading llama.cpp
    from ..decoder import DecoderOptions

__all__ = ["ARCH", "Heads", "MedusaHeads", "ResBlocks", "heads_memory", "load_medusa_gguf", "medusa_decoder_options",
           "target_lm_head"]

# the old flat names of the metadata keys, for modules that read them from here (convert/inspect.py)
KEY_VERSION = Keys.VERSION
KEY_HEAD_COUNT = Keys.HEAD_COUNT
KEY_LAYER_COUNT = Keys.LAYER_COUNT
KEY_HIDDEN_SIZE = Keys.HIDDEN_SIZE
KEY_VOCAB_SIZE = Keys.VOCAB_SIZE
KEY_BASE_MODEL = Keys.BASE_MODEL
KEY_TREE = Keys.TREE


@dataclass(frozen=True)
class ResBlocks:
    """Every head's ResBlocks stacked per layer (float32): w[j] [heads, H, H] and b[j] [heads, H] for layer j;
    layer 0 also as one [H, heads * H] matrix w0_t, so h @ w0_t gives all heads' first products at once."""

    n_heads: int
    hidden: int
    w: list[np.ndarray]
    b: list[np.ndarray]
    w0_t: np.ndarray | None  # None: no layers, each head passes h through

    @classmethod
    def stack(cls, res: list[list[tuple[np.ndarray, np.ndarray]]], hidden: int) -> ResBlocks:
        """From per-head lists of (W, b), as `MedusaHeads.res` holds them."""
        n_heads, layers = len(res), len(res[0])
        w = [np.stack([res[i][j][0] for i in range(n_heads)]).astype(np.float32) for j in range(layers)]
        b = [np.stack([res[i][j][1] for i in range(n_heads)]).astype(np.float32) for j in range(layers)]
        w0_t = np.ascontiguousarray(w[0].reshape(-1, hidden).T) if layers else None
        return cls(n_heads, hidden, w, b, w0_t)

    def __call__(self, h: np.ndarray, pre: list[np.ndarray] | None = None) -> np.ndarray:
        """Every head's output hidden state [..., heads, H] for base hidden states h [..., H], in float32; each
        layer's pre-activation W x + b [..., heads, H] is appended to `pre` when given (training's backward pass)."""
        h = np.asarray(h, dtype=np.float32)
        lead = h.shape[:-1]
        if self.w0_t is None:
            return np.broadcast_to(h[..., None, :], (*lead, self.n_heads, self.hidden)).copy()
        z = (h @ self.w0_t).reshape(*lead, self.n_heads, self.hidden) + self.b[0]
        x = h[..., None, :] + z / (1.0 + np.exp(-z))
        if pre is not None:
            pre.append(z)
        for w, b in zip(self.w[1:], self.b[1:]):
            z = np.matmul(w, x[..., None])[..., 0] + b
            x = x + z / (1.0 + np.exp(-z))
            if pre is not None:
                pre.append(z)
        return x


class MedusaHeads(HeadSet):
    """A Medusa head set as float32 arrays (`load_medusa_gguf`), with the reference products of its heads."""

    @classmethod
    def of(cls, heads: HeadSet) -> MedusaHeads:
        """The same head set (its arrays shared, not copied)."""
        return cls(**{f.name: getattr(heads, f.name) for f in fields(heads)})

    def hidden_states(self, h: np.ndarray) -> list[np.ndarray]:
        """Each head's output hidden state for base hidden states h ([..., hidden])."""
        x = ResBlocks.stack(self.res, self.hidden)(h)
        return [x[..., i, :] for i in range(self.heads)]

    def logits(self, h: np.ndarray, base_lm_head: np.ndarray | None = None) -> list[np.ndarray]:
        """Each head's logits; v2 heads need the base model's LM head ([vocab, hidden])."""
        heads = self.lm_heads
        if heads is None:
            if base_lm_head is None:
                raise ValueError("a version 2 Medusa head set uses the base model's LM head: pass base_lm_head")
            heads = [base_lm_head] * self.heads
        return [x @ lm.T for x, lm in zip(self.hidden_states(h), heads)]


def load_medusa_gguf(path: Path) -> MedusaHeads:
    """Read a Medusa GGUF (`format.read_heads`: any storage type, float32 arrays); ModelFileError for anything
    damaged."""
    return MedusaHeads.of(read_heads(Path(path)))


TREE_SEQUENCES = 64  # n_seq_max for Medusa contexts: trees of up to 63 leaves (the 63-node tree has 42)


def medusa_decoder_options(options: DecoderOptions) -> DecoderOptions:
    """Target context settings for Medusa: hidden states on, room for a tree's sequences in one micro-batch."""
    return replace(options, embeddings=True, n_seq_max=max(options.n_seq_max, TREE_SEQUENCES),
                   n_batch=max(options.n_batch, TREE_SEQUENCES), n_ubatch=max(options.micro_batch, TREE_SEQUENCES))


def target_lm_head(target_path: str | Path) -> np.ndarray:
    """The target GGUF's output matrix [vocab, hidden] as float32 (the token embeddings when tied); only that
    tensor is read, memory-mapped, after read_header's bounds checks."""
    header = read_header(target_path)
    t = _lm_head_tensor(header)
    if t is None:
        raise ModelFileError(f"{target_path}: has neither output.weight nor token_embd.weight for Medusa v2 heads")
    shape = tuple(reversed(t.shape))  # numpy order: [vocab, hidden]
    try:
        qtype = GGMLQuantizationType(t.type)
        data = np.memmap(Path(target_path).expanduser(), dtype=np.uint8, mode="r", offset=header.data_start + t.offset,
                         shape=quants.quant_shape_to_byte_shape(shape, qtype))
        return np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(shape)
    except (OSError, ValueError, NotImplementedError) as e:  # NotImplementedError: gguf-py cannot dequantize the type
        raise ModelFileError(f"{target_path}: cannot read {t.name} ({type(e).__name__}: {e})") from None


def heads_memory(heads_path: str | Path, target: GGUFHeader,
                 candidates: Candidates | None = None) -> list[tuple[str, int]]:
    """RAM Heads.load adds beyond the GGUF files, as (what, bytes) for check_memory: the float32 [hidden, vocab]
    copy of the target's output matrix that v2 heads keep with the whole vocabulary; nothing for v1 heads or a
    restricted candidate vocabulary."""
    if candidates is not None or read_header(heads_path).metadata.get(Keys.VERSION) == 1:
        return []
    t = _lm_head_tensor(target)
    return [] if t is None else [("Medusa heads' float32 copy of the output matrix", 4 * math.prod(t.shape))]


def _lm_head_tensor(header: GGUFHeader) -> TensorInfo | None:
    """The tensor v2 heads share: the target's output matrix, or its token embeddings when they are tied."""
    tensors = {t.name: t for t in header.tensors}
    return tensors.get("output.weight") or tensors.get("token_embd.weight")


class Heads:
    """A Medusa head set ready to propose: ResBlocks stacked per layer, LM heads as [H, V] float32.

    `ids` (sorted token ids, or None for all): the candidate vocabulary; only those LM-head rows are kept.
    """

    def __init__(self, heads: MedusaHeads, lm_head: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
        self.n_heads, self.hidden, self.version = heads.heads, heads.hidden, heads.version
        self.choices = heads.choices  # the tree fitted to these heads (used when no other is asked for), or None
        self.blocks = ResBlocks.stack(heads.res, self.hidden)
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64)
        rows = slice(None) if self.ids is None else self.ids
        if heads.lm_heads is not None:
            self.vocab = heads.lm_heads[0].shape[0]
            # [heads, H, N]: the candidates' rows only
            self.lm_t = np.stack([np.ascontiguousarray(np.asarray(m)[rows].T, dtype=np.float32) for m in heads.lm_heads])
            self.shared_lm_t = None
        else:
            if lm_head is None:
                raise ValueError("version 2 Medusa heads use the target's LM head: pass lm_head")
            self.vocab = lm_head.shape[0]
            self.lm_t = None
            self.shared_lm_t = np.ascontiguousarray(np.asarray(lm_head)[rows].T, dtype=np.float32)  # [H, N]
        self.n_candidates = self.vocab if self.ids is None else len(self.ids)

    @classmethod
    def load(cls, path: str | Path, target_path: str | Path, n_embd: int, n_vocab: int,
             candidates: Candidates | None = None, keep: Iterable[int] = ()) -> Heads:
        """Load a Medusa GGUF for a target; ModelFileError when its sizes don't match the target's.

        `candidates`: restrict proposals to the N lowest ids or to a file's ids, plus `keep` (the target's
        special ids, see `special_ids`); CandidateVocabError when out of range or malformed.
        """
        ids = candidate_ids(candidates, n_vocab, keep)
        raw = load_medusa_gguf(Path(path))
        if raw.heads == 0:
            raise ModelFileError(f"{path}: holds no Medusa heads")
        if raw.hidden != n_embd:
            raise ModelFileError(
                f"{path}: these Medusa heads expect hidden size {raw.hidden}, the target {target_path} has {n_embd}; "
                "heads only work with the model they were trained for"
            )
        vocab = raw.lm_heads[0].shape[0] if raw.lm_heads is not None else raw.vocab
        if vocab and vocab != n_vocab:
            raise ModelFileError(
                f"{path}: these Medusa heads have a vocabulary of {vocab} tokens, the target {target_path} has {n_vocab}"
            )
        lm = target_lm_head(target_path) if raw.lm_heads is None else None
        if lm is not None and lm.shape != (n_vocab, n_embd):
            raise ModelFileError(f"{target_path}: output matrix has shape {list(lm.shape)}, expected {[n_vocab, n_embd]}")
        return cls(raw, lm, ids)

    def states(self, h: np.ndarray) -> np.ndarray:
        """Every head's output hidden state [..., heads, H] for base hidden states h [..., H]."""
        return self.blocks(h)

    def logits(self, h: np.ndarray, n: int | None = None) -> np.ndarray:
        """The first n (default all) heads' logits [..., n, N] for base hidden states h [..., H]: one column
        per candidate (`ids`), i.e. [..., n, V] without a restricted vocabulary."""
        x = self.states(h)[..., :n, :]
        if self.shared_lm_t is not None:  # one 2-D product: a stack of small ones would read the LM head per row
            return (x.reshape(-1, self.hidden) @ self.shared_lm_t).reshape(*x.shape[:-1], -1)
        return np.stack([x[..., k, :] @ self.lm_t[k] for k in range(x.shape[-2])], axis=-2)

    def ranks(self, h: np.ndarray, labels: np.ndarray, below: int) -> np.ndarray:
        """ranks[i, k]: where token labels[i, k] stands in head k's ranking at hidden state h[i] (0: best),
        or -1 when it is past `below` or the label is unknown (< 0). Full vocabulary only."""
        if self.ids is not None:
            raise ValueError("ranks are measured over the whole vocabulary: load the heads without candidates")
        labels = np.asarray(labels)
        logits = self.logits(h, labels.shape[1])
        mine = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], axis=-1)
        r = (logits >= mine).sum(-1) - 1  # ties count as ahead: top_k's order among them is arbitrary
        return np.where((labels >= 0) & (r < below), r, -1)

    def check_top_k(self, ks: tuple[int, ...]) -> None:
        """CandidateVocabError when a tree asks a head for more tokens than the candidate vocabulary holds."""
        if max(ks, default=0) > self.n_candidates:
            raise CandidateVocabError(
                f"the Medusa tree takes the top {max(ks)} tokens of a head, but the candidate vocabulary holds only "
                f"{self.n_candidates}: give more candidates (--medusa-vocab) or a smaller tree")

    def top_k(self, h: np.ndarray, ks: tuple[int, ...]) -> list[np.ndarray]:
        """Head i's ks[i] best token ids, best first (argpartition, then a sort of those k only)."""
        self.check_top_k(ks)
        logits = self.logits(h, len(ks))
        out = []
        for row, k in zip(logits, ks):
            part = np.argpartition(row, -k)[-k:]
            best = part[np.argsort(-row[part], kind="stable")]
            out.append(best if self.ids is None else self.ids[best])
        return out
