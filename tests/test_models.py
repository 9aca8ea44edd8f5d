"""The files shipped in models/: size limits, and the demo draft pairs with its target in llama.cpp."""

from __future__ import annotations

from pathlib import Path

from ggufspec import hub
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.pairing import check_pair

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_every_shipped_file_is_at_most_25_mb():
    for f in MODELS.rglob("*"):
        if f.is_file():
            assert f.stat().st_size <= 25_000_000, f


def test_demo_draft_is_narrow_llama_and_pairs_with_the_target(smollm2_path):
    path = hub.bundled_path(hub.get_preset("demo").draft.bundled)  # a broken registry or missing file fails here
    assert path.is_file(), path
    opts = DecoderOptions(n_ctx=128, n_threads=1)
    with LlamaCppDecoder(smollm2_path, opts) as target, LlamaCppDecoder(path, opts) as draft:
        assert draft.metadata("general.architecture") == "llama"
        assert draft.n_embd <= 256 < target.n_embd
        check_pair(target, draft)
        ids = target.vocab.tokenize("def add(a, b):\n    return", add_special=False)
        assert draft.feed(ids).shape == (len(ids), target.n_vocab)
