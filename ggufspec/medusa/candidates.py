"""A restricted candidate vocabulary for Medusa heads: the token ids they may propose.

`candidates` is N (the N lowest ids: BPE vocabularies are numbered in merge order, roughly by frequency) or
a file of ids; the target's end-of-generation and control tokens always stay in the set. `Heads` keeps only
those rows of its LM heads. Exactness does not depend on the set (the target verifies every proposal);
only acceptance can drop.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import GGUFSpecError

if TYPE_CHECKING:
    from ..vocab import Vocab

Candidates = int | str | os.PathLike  # a restricted candidate vocabulary: N (the N lowest ids) or a file of ids


class CandidateVocabError(GGUFSpecError):
    """A restricted Medusa candidate vocabulary is out of range, unreadable or malformed."""


def special_ids(vocab: Vocab) -> set[int]:
    """Ids the target may emit that a restricted candidate set must keep: end-of-generation and control tokens."""
    import llama_cpp

    control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    return set(vocab.eog_ids) | {t for t in range(vocab.n_tokens) if vocab.attr(t) & control}


def candidate_ids(candidates: Candidates | None, n_vocab: int, keep: Iterable[int] = ()) -> np.ndarray | None:
    """Sorted token ids the heads may propose (plus `keep`), or None for the whole vocabulary.

    `candidates` is N (ids 0..N-1: BPE vocabularies are numbered in merge order, roughly by frequency)
    or a file of ids: a JSON list, or integers separated by whitespace or commas (`#` starts a comment).
    """
    if candidates is None:
        return None
    if isinstance(candidates, bool):
        raise CandidateVocabError(f"Medusa candidate vocabulary: expected a token count or a file, got {candidates!r}")
    if isinstance(candidates, (int, np.integer)):
        n = int(candidates)
        if not 1 <= n <= n_vocab:
            raise CandidateVocabError(
                f"Medusa candidate vocabulary of {n} tokens: give 1..{n_vocab} (the target's vocabulary size)")
        ids = np.arange(n, dtype=np.int64)
    else:
        ids = _read_ids(Path(candidates), n_vocab)
    extra = np.array(sorted(k for k in keep if 0 <= k < n_vocab), dtype=np.int64)
    ids = np.union1d(ids, extra)
    return None if len(ids) == n_vocab else ids


def _read_ids(path: Path, n_vocab: int) -> np.ndarray:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CandidateVocabError(f"{path}: cannot read the Medusa candidate vocabulary file ({e})") from e
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise CandidateVocabError(f"{path}: not a JSON list of token ids ({e})") from e
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise CandidateVocabError(f"{path}: expected a JSON list of integer token ids")
    else:
        words = [w for line in text.splitlines() for w in re.split(r"[\s,]+", line.split("#", 1)[0]) if w]
        bad = [w for w in words if not re.fullmatch(r"[+-]?\d+", w)]
        if bad:
            raise CandidateVocabError(f"{path}: not a token id: {bad[0]!r} (expected integers separated by whitespace or commas)")
        values = [int(w) for w in words]
    if not values:
        raise CandidateVocabError(f"{path}: holds no token ids")
    out = [v for v in values if not 0 <= v < n_vocab]
    if out:
        raise CandidateVocabError(f"{path}: token id {out[0]} is outside the target's vocabulary 0..{n_vocab - 1}")
    return np.unique(np.asarray(values, dtype=np.int64))
