"""Can a draft propose tokens for a target? Same tokenizer, same special ids, same token texts."""

from __future__ import annotations

from typing import Protocol

import llama_cpp

from .errors import PairingError
from .vocab import Vocab


class HasVocab(Protocol):
    vocab: Vocab
    path: object

    def metadata(self, key: str) -> str | None: ...


def is_padding(vocab: Vocab, token: int) -> bool:
    """Rows converters add to round the embedding up (Qwen2.5-7B's [PAD151936], unused tokens)."""
    return bool(vocab.attr(token) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED) or vocab.text(token).startswith(b"[PAD")


def _digest(d: HasVocab) -> bytes:
    """The token texts' digest in the file `d` was loaded from (gguf_check.GGUFHeader.tokens_digest), where known."""
    header = getattr(d, "header", None)
    return getattr(header, "tokens_digest", b"")


def check_pair(target: HasVocab, draft: HasVocab) -> None:
    """Raise PairingError naming the first difference that would make draft tokens mean other text."""
    tv, dv = target.vocab, draft.vocab
    where = f"target {target.path} and draft {draft.path}"
    t_model, d_model = target.metadata("tokenizer.ggml.model"), draft.metadata("tokenizer.ggml.model")
    if t_model != d_model:
        raise PairingError(f"{where} use different tokenizers ({t_model!r} vs {d_model!r}).")
    for name in ("bos", "eos", "eot", "add_bos"):
        a, b = getattr(tv, name), getattr(dv, name)
        if a != b:
            raise PairingError(f"{where} differ in {name}: {a} vs {b}.")
    if tv.n_tokens == dv.n_tokens and _digest(target) == _digest(draft) != b"":
        return  # the same token texts, byte for byte (what the loops below compare, token by token)
    shared = min(tv.n_tokens, dv.n_tokens)
    larger = tv if tv.n_tokens > dv.n_tokens else dv
    for t in range(shared, larger.n_tokens):
        if not is_padding(larger, t):
            raise PairingError(
                f"{where} have {tv.n_tokens} and {dv.n_tokens} tokens, and token {t} "
                f"({larger.text(t)!r}) of the larger one is not padding."
            )
    for t in range(shared):
        a, b = tv.text(t), dv.text(t)
        if a != b:
            raise PairingError(f"{where} differ at token {t}: {a!r} vs {b!r}.")
