"""The model's vocabulary through llama.cpp: tokenize, pieces, special ids, end-of-generation ids."""

from __future__ import annotations

import ctypes
import threading
from functools import cached_property

import llama_cpp

from .errors import ContextLengthError, GGUFSpecError


class Vocab:
    """llama.cpp's tokenizer for one loaded model; tokenize honours the GGUF's add_bos/add_eos settings."""

    def __init__(self, model: llama_cpp.llama_model_p) -> None:
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_tokens: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bos: int = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos: int = llama_cpp.llama_vocab_eos(self._vocab)
        self.eot: int = llama_cpp.llama_vocab_eot(self._vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))  # pairing compares it
        # BPE and SentencePiece tokens spell the text back whole (SentencePiece even adds a space); WordPiece and
        # Unigram tokenizers may drop whitespace or accents, so a text's length bounds their token count from below
        # only for the first two
        self.pieces_cover_text = llama_cpp.llama_vocab_type(self._vocab) in (llama_cpp.LLAMA_VOCAB_TYPE_SPM,
                                                                             llama_cpp.LLAMA_VOCAB_TYPE_BPE)
        self._local = threading.local()  # each thread's piece buffer: a pool's slots render their tokens at once
        self._pieces: dict[int, bytes] = {}  # token -> piece; -token-1 -> its special rendering (see piece)
        self._eog: dict[int, bool] = {}

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_special adds BOS/EOS as the GGUF asks; parse_special reads <|tags|>."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        out = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: llama.cpp returns minus the count needed
            n_max = -n
            out = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), out, n_max, add_special, parse_special)
        return list(out[:n])

    def encode(self, text: str, add_special: bool = True, n_ctx: int | None = None) -> list[int]:
        """tokenize(text) with special tokens parsed, for a prompt. With `n_ctx`, a text that cannot leave room for
        one token in it raises ContextLengthError, without tokenizing when its length in bytes already proves it
        (llama.cpp's tokenizer takes ~100 bytes of memory per byte of a long word, and seconds per megabyte)."""
        try:
            data_len = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise GGUFSpecError("the prompt is not valid Unicode (it holds an unpaired surrogate)") from None
        if n_ctx is not None and data_len >= n_ctx and self.pieces_cover_text:  # a shorter text is cheap to tokenize
            at_least = -(-data_len // self.max_piece_bytes)
            if at_least >= n_ctx:
                raise ContextLengthError.prompt(at_least, n_ctx, at_least=True)
        tokens = self.tokenize(text, add_special=add_special, parse_special=True)
        if not tokens:
            raise GGUFSpecError("the prompt has no tokens.")
        if n_ctx is not None and len(tokens) >= n_ctx:
            raise ContextLengthError.prompt(len(tokens), n_ctx)
        return tokens

    @cached_property
    def max_piece_bytes(self) -> int:
        """The most bytes of text one token stands for (special tokens included): a text of n bytes holds at least
        n / max_piece_bytes tokens. One pass over the vocabulary (~80 ms for 49k tokens)."""
        return max(1, max(len(self.piece(t, special=True)) for t in range(self.n_tokens)))

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes token `token` stands for; special tokens render as text only when `special`."""
        key = -token - 1 if special else token  # one memo for both renderings (a ctypes call cost ~10 us a token)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        piece = self._pieces[key] = buf.raw[:n]
        return piece

    def text(self, token: int) -> bytes:
        """The token's raw text as stored in the GGUF (what pairing compares)."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token) or b""

    def attr(self, token: int) -> int:
        return int(llama_cpp.llama_vocab_get_attr(self._vocab, token))

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT, or a chat template's end token such as <|im_end|>."""
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
        return eog

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        return frozenset(t for t in range(self.n_tokens) if self.is_eog(t))
