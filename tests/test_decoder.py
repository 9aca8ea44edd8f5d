"""LlamaCppDecoder on real llama.cpp contexts: verify batches, rollback, sync, trees, hidden states."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import open_decoder
from ggufspec import cli
from ggufspec import kv_cache
from ggufspec import decoder as decoder_module
from ggufspec.decoder import KV_TYPES, DecoderOptions, kv_label
from ggufspec.errors import GGUFSpecError

# f32 tiny models: a k-token batch and k single decodes agreed to ~1e-5 on one machine here and
# to 0.0037 on an AVX2-only one (other kernels for batches); quantized SmolLM2 agreed exactly on
# these shapes. Tolerances leave room for other CPUs' kernels.
ATOL_F32 = 1e-2
ATOL_Q = 0.25
# After a tree commit the kept cells sit between freed ones, and later decodes sum attention in
# another order: measured 0.007 on these f32 models, while one wrongly kept cell gives ~10.
ATOL_AFTER_TREE = 0.05

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _linear_logits(path, tokens: list[int]) -> np.ndarray:
    """Reference: a fresh context decoding one token at a time."""
    with open_decoder(path) as d:
        return np.stack([d.feed([t])[-1] for t in tokens])


@pytest.mark.parametrize("model,atol", [("tiny_target", ATOL_F32), ("smollm2_path", ATOL_Q)])
def test_verify_rows_equal_single_decodes(model, atol, request) -> None:
    path = request.getfixturevalue(model)
    with open_decoder(path) as d:
        tokens = d.vocab.tokenize(PROMPT)
        rows = d.feed(tokens)
        assert rows.shape == (len(tokens), d.n_vocab)
        assert d.history == tokens
    np.testing.assert_allclose(rows, _linear_logits(path, tokens), atol=atol, rtol=0)


def test_logits_view_is_read_only_and_equals_the_copy(tiny_target) -> None:
    with open_decoder(tiny_target) as d:
        tokens = d.vocab.tokenize(PROMPT)
        copied = d.feed(tokens[:4])
        d.rollback_to(0)
        view = d.feed(tokens[:4], view=True)
        np.testing.assert_array_equal(view, copied)
        with pytest.raises(ValueError):
            view[0, 0] = 1.0
        d.feed(tokens[4:5])  # the next decode owns the buffer: a view follows it, a copy does not
        assert not np.array_equal(view[0], copied[0])


def test_kept_logits_views_follow_batch_sizes_and_buffer_moves(tiny_target) -> None:
    """The decoder keeps a view per buffer address and row count: through batches of 1, 9, 1, 40 and 3 tokens (the
    output buffer grows, and may move, for the larger ones) every row read equals llama.cpp's own row getter."""
    import llama_cpp

    with open_decoder(tiny_target) as d:
        tokens = (d.vocab.tokenize(PROMPT) * 8)[:54]
        start = 0
        for n in (1, 9, 1, 40, 3):
            rows = d.feed(tokens[start : start + n], view=True)
            assert rows.shape == (n, d.n_vocab)
            for i in range(n):
                own = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(d.llama_context, i), shape=(d.n_vocab,))
                np.testing.assert_array_equal(rows[i], own)
            start += n


def test_rollback_then_next_logits_equal_fresh_context(tiny_target) -> None:
    rng = np.random.default_rng(0)
    with open_decoder(tiny_target) as d:
        for _ in range(30):
            if d.history and rng.random() < 0.4:
                d.rollback_to(int(rng.integers(0, len(d.history) + 1)))
            else:
                d.feed(rng.integers(10, 40_000, size=int(rng.integers(1, 6))).tolist())
        tokens = list(d.history) + [1234]
        got = d.feed([1234])[-1]
    with open_decoder(tiny_target) as fresh:
        want = fresh.feed(tokens)[-1]
    np.testing.assert_allclose(got, want, atol=ATOL_F32, rtol=0)


def test_sync_reuses_the_common_prefix(tiny_target) -> None:
    with open_decoder(tiny_target) as d:
        a = d.vocab.tokenize("one two three four five six")
        d.feed(a)
        before = d.n_decodes
        b = a[:4] + d.vocab.tokenize(" seven eight")
        last = d.sync(b)
        assert d.history == b
        assert d.n_decodes == before + 1, "sync must decode only the new tail, in one batch"
        np.testing.assert_allclose(last[-1], _linear_logits(tiny_target, b)[-1], atol=ATOL_F32, rtol=0)


def test_prefill_in_chunks_equals_one_batch(tiny_target) -> None:
    with open_decoder(tiny_target, n_batch=7) as small, open_decoder(tiny_target) as big:
        tokens = small.vocab.tokenize(PROMPT * 3)
        np.testing.assert_allclose(small.feed(tokens, all_logits=False)[-1], big.feed(tokens)[-1], atol=ATOL_F32)
        assert small.n_decodes == -(-len(tokens) // 7)


# Node i's parent; -1 are children of the last history token. Two roots, branches of uneven depth.
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 2, 5, 3]


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_tree_logits_equal_linear_paths(tiny_target) -> None:
    rng = np.random.default_rng(3)
    with open_decoder(tiny_target, n_seq_max=8) as d:
        prefix = d.vocab.tokenize(PROMPT)
        d.feed(prefix)
        tokens = rng.integers(10, 40_000, size=len(TREE_PARENTS)).tolist()
        logits = d.tree_logits(tokens, TREE_PARENTS)
        assert d.history == prefix
    for node in range(len(TREE_PARENTS)):
        path = [tokens[i] for i in _path(TREE_PARENTS, node)]
        want = _linear_logits(tiny_target, prefix + path)[-1]
        np.testing.assert_allclose(logits[node], want, atol=ATOL_F32, rtol=0, err_msg=f"node {node}")


@pytest.mark.parametrize("accepted_node", [7, 4, 0, None])
def test_commit_tree_path_keeps_only_that_path(tiny_target, accepted_node) -> None:
    rng = np.random.default_rng(4)
    with open_decoder(tiny_target, n_seq_max=8) as d:
        prefix = d.vocab.tokenize(PROMPT)
        d.feed(prefix)
        tokens = rng.integers(10, 40_000, size=len(TREE_PARENTS)).tolist()
        d.tree_logits(tokens, TREE_PARENTS)
        path = [] if accepted_node is None else _path(TREE_PARENTS, accepted_node)
        d.commit_tree_path(path)
        expect = prefix + [tokens[i] for i in path]
        assert d.history == expect
        got = d.feed([99])[-1]
        # a second tree after the commit must see only the kept path too
        d.rollback_to(len(expect))
        second = d.tree_logits([99, 100], [-1, 0])
    want = _linear_logits(tiny_target, expect + [99, 100])
    np.testing.assert_allclose(got, want[-2], atol=ATOL_AFTER_TREE, rtol=0)
    np.testing.assert_allclose(second, want[-2:], atol=ATOL_AFTER_TREE, rtol=0)


@pytest.mark.parametrize("accepted_node", [7, 4, 8])  # paths 0-2-5-7, 1-4, 0-3-8: each with a gap in batch order
def test_tree_commits_keep_the_cache_in_position_order(smollm2_path, accepted_node) -> None:
    """The path's nodes after a gap are deferred and decoded again in front of the next batch: llama.cpp adds
    attention up in cache order, and with them left in place later logits drifted by up to 0.9 here."""
    rng = np.random.default_rng(5)
    with open_decoder(smollm2_path, n_seq_max=8) as d:
        prefix = d.vocab.tokenize(PROMPT)
        tokens = rng.integers(10, 40_000, size=len(TREE_PARENTS)).tolist()
        later = rng.integers(10, 40_000, size=4).tolist()
        d.feed(prefix)
        d.tree_logits(tokens, TREE_PARENTS)
        path = _path(TREE_PARENTS, accepted_node)
        deferred = d.commit_tree_path(path)
        committed = [tokens[i] for i in path]
        assert d.history == prefix + committed
        assert deferred == d.n_deferred == len(path) - next((i for i, node in enumerate(path) if node != i), len(path))
        n_deferred = d.n_deferred
        d.tree_logits([later[0], 77], [-1, -1])  # a tree left uncommitted leaves the history as it was
        d.rollback_to(len(d.history))
        assert d.history == prefix + committed and d.n_deferred == n_deferred
        got = [d.feed([t])[-1] for t in later]
        assert d.n_deferred == 0
    with open_decoder(smollm2_path) as plain:
        plain.feed(prefix)
        want = [plain.feed([t])[-1] for t in committed + later][len(committed):]
    np.testing.assert_array_equal(np.array(got), np.array(want))  # bit for bit: llama.cpp's flash attention, < 256 tokens


def test_tree_needs_enough_sequences(tiny_target) -> None:
    with open_decoder(tiny_target, n_seq_max=2) as d:
        d.feed([1, 2, 3])
        with pytest.raises(GGUFSpecError, match="n_seq_max"):
            d.tree_logits([5, 6, 7], [-1, -1, -1])
        with pytest.raises(ValueError, match="parent"):
            d.tree_logits([5, 6], [1, -1])


def test_hidden_states_come_from_the_same_decode(tiny_target, tiny_weights) -> None:
    """The final-norm hidden state times the output matrix gives the logits of that decode."""
    with open_decoder(tiny_target, embeddings=True) as d:
        logits = d.feed(d.vocab.tokenize(PROMPT))
        hidden = d.hidden_states()
        assert hidden.shape == (len(logits), d.n_embd)
        np.testing.assert_allclose(hidden @ tiny_weights["output.weight"].T, logits, atol=1e-3, rtol=1e-4)
        tree = d.tree_logits([5, 6, 7], [-1, 0, 0]) if d.options.n_seq_max > 2 else None
        assert tree is None
    with open_decoder(tiny_target) as plain:
        plain.feed([1])
        with pytest.raises(GGUFSpecError, match="embeddings"):
            plain.hidden_states()


def test_a_prefill_with_hidden_states_on_gives_the_last_tokens_logits(tiny_target, tiny_weights) -> None:
    """llama.cpp outputs every token of a batch while embeddings are on: a prefill asking for the last logits got
    the first token's row (and paid for all of them). It now decodes without hidden states, which it has none of."""
    with open_decoder(tiny_target) as plain:
        tokens = plain.vocab.tokenize(PROMPT)
        want = plain.sync(tokens)
        want_next = plain.feed([5])
    with open_decoder(tiny_target, embeddings=True, n_seq_max=4) as d:
        got = d.sync(tokens)
        np.testing.assert_allclose(got, want, atol=ATOL_F32, rtol=0)
        with pytest.raises(GGUFSpecError, match="no hidden states"):
            d.hidden_states()
        nxt = d.feed([5])  # a single token: its hidden state, from the same decode
        np.testing.assert_allclose(nxt, want_next, atol=ATOL_F32, rtol=0)
        np.testing.assert_allclose(d.hidden_states() @ tiny_weights["output.weight"].T, nxt, atol=1e-3, rtol=1e-4)


def test_decode_sequences_equals_each_sequence_alone(tiny_target) -> None:
    """Independent sequences in one batch (Medusa training's collection): each token's logits and hidden
    state as in a context of its own; the cache's positions per sequence; clearing one; the history apart."""
    a, b = [1, 2, 3, 4], [7, 8, 9]
    with open_decoder(tiny_target, embeddings=True, n_seq_max=3) as d:
        logits = d.decode_sequences(a + b, [0, 1, 2, 3, 0, 1, 2], [0, 0, 0, 0, 2, 2, 2])
        hidden = d.hidden_states()
        assert logits.shape == (7, d.n_vocab) and hidden.shape == (7, d.n_embd) and d.history == []
        assert (d.kv_positions(0), d.kv_positions(1), d.kv_positions(2)) == ((0, 3), (-1, -1), (0, 2))
        more = d.decode_sequences([5, 10], [4, 3], [0, 2])  # each sequence continues after its own tokens
        more_hidden = d.hidden_states()
        d.clear_sequence(2)
        assert (d.kv_positions(0), d.kv_positions(2)) == ((0, 4), (-1, -1))
        with pytest.raises(ValueError, match="sequence ids"):
            d.decode_sequences([1], [0], [3])
        d.reset()
        assert d.kv_positions(0) == (-1, -1)
        d.feed([1, 2])
        with pytest.raises(GGUFSpecError, match="history"):
            d.decode_sequences([1], [0], [1])
        with pytest.raises(GGUFSpecError, match="history"):
            d.clear_sequence(1)
    with open_decoder(tiny_target, embeddings=True) as alone:
        for seq, rows, nxt in ((a, slice(0, 4), 5), (b, slice(4, 7), 10)):
            alone.rollback_to(0)
            want = alone.feed(seq + [nxt])
            want_hidden = alone.hidden_states()
            k = 0 if nxt == 5 else 1
            np.testing.assert_allclose(logits[rows], want[:-1], atol=ATOL_F32, rtol=0)
            np.testing.assert_allclose(more[k], want[-1], atol=ATOL_F32, rtol=0)
            np.testing.assert_allclose(hidden[rows], want_hidden[:-1], atol=ATOL_F32, rtol=0)
            np.testing.assert_allclose(more_hidden[k], want_hidden[-1], atol=ATOL_F32, rtol=0)


def test_use_after_close_is_a_clear_error(tiny_target) -> None:
    d = open_decoder(tiny_target)
    d.feed([1, 2])
    d.close()
    d.close()  # twice is fine
    with pytest.raises(GGUFSpecError, match="closed"):
        d.feed([3])
    with pytest.raises(GGUFSpecError, match="closed"):
        d.rollback_to(0)


def test_context_overflow_is_an_error(tiny_target) -> None:
    with open_decoder(tiny_target, n_ctx=16) as d:
        d.feed(list(range(10, 26)))
        with pytest.raises(GGUFSpecError, match="context"):
            d.feed([5])
        d.rollback_to(15)
        d.feed([5])


@pytest.mark.parametrize("v_type,batches", [("q8_0", (2, 7)), ("f16", (4, 64))])
def test_q8_0_k_cache_verifies_bit_for_bit_past_512_cells(smollm2_path, v_type, batches) -> None:
    """With a q8_0 K cache on CPU (the default) and either V type the default may pick, batches of any size give the
    logits single-token decodes give, also once the cache holds more than 512 cells (where llama.cpp's f16 cache
    switches single tokens to a split kernel) and for 64-row batches (where it tiles). Each V type's batch sizes
    share one 600-token prefix and one pass of single decodes (a prefill each cost seconds)."""
    rng = np.random.default_rng(batches[0])
    prefix = rng.integers(10, 40_000, size=600).tolist()
    tokens = rng.integers(10, 40_000, size=70).tolist()
    with open_decoder(smollm2_path, kv_type="q8_0", kv_type_v=v_type) as d:
        assert (d.kv_type, d.kv_type_v) == ("q8_0", v_type)
        d.feed(prefix)
        single = np.array([d.feed([t])[-1] for t in tokens])
        for batch in batches:
            d.rollback_to(len(prefix))
            batched = np.concatenate([d.feed(tokens[i:i + batch]) for i in range(0, len(tokens), batch)])
            np.testing.assert_array_equal(batched, single, err_msg=f"batches of {batch}")


def test_the_default_cpu_cache_is_q8_0_k_with_the_measured_v(smollm2_path) -> None:
    with open_decoder(smollm2_path) as d:
        assert (d.kv_type, d.kv_type_v) == ("q8_0", kv_cache.default_v_type())
        assert d.kv_cache == kv_label("q8_0", d.kv_type_v)


def test_cpu_micro_batches_of_64_change_no_logit(smollm2_path, monkeypatch) -> None:
    """The default 64-token micro-batch (less activation memory) prefills to the logits one 512-token step gives."""
    tokens = np.random.default_rng(3).integers(10, 40_000, size=300).tolist()
    with open_decoder(smollm2_path) as small, open_decoder(smollm2_path, n_ubatch=512) as big:
        assert (small.n_ubatch, big.n_ubatch) == (64, 512)
        np.testing.assert_array_equal(small.feed(tokens, all_logits=False)[-1], big.feed(tokens, all_logits=False)[-1])
        assert small.n_decodes == big.n_decodes == 1, "n_batch still sets the chunks we hand llama.cpp"
    monkeypatch.setattr(decoder_module, "gpu_offload", lambda: False)  # a CPU build ignores -ngl: CPU defaults
    assert DecoderOptions(n_gpu_layers=-1).micro_batch == 64
    monkeypatch.setattr(decoder_module, "gpu_offload", lambda: True)
    assert DecoderOptions(n_gpu_layers=-1).micro_batch == 512
    assert DecoderOptions(n_batch=32).micro_batch == 32
    with pytest.raises(ValueError, match="n_ubatch must be between 1 and n_batch"):
        DecoderOptions(n_batch=128, n_ubatch=256)


def test_kv_type_is_checked_and_used(smollm2_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="kv_type must be one of"):
        DecoderOptions(kv_type="q9_0")
    with pytest.raises(ValueError, match="needs flash attention"):
        DecoderOptions(kv_type="q8_0", flash_attn=False)
    with pytest.raises(ValueError, match="kv_type_v must be one of"):
        DecoderOptions(kv_type_v="q8")
    with pytest.raises(ValueError, match="a q4_0 KV cache needs flash attention"):
        DecoderOptions(kv_type="f16", kv_type_v="q4_0", flash_attn=False)
    assert (DecoderOptions(kv_type="q8_0").cache_type_v, DecoderOptions(kv_type_v="f16").cache_type) == ("q8_0", "q8_0")
    assert cli.KV_TYPES == KV_TYPES  # spelled twice so that `--help` need not import llama.cpp
    assert DecoderOptions(flash_attn=False).cache_type == "f16"
    monkeypatch.setattr(decoder_module, "gpu_offload", lambda: False)  # a CPU build ignores -ngl: CPU defaults
    assert DecoderOptions(n_gpu_layers=-1).cache_type == "q8_0"
    monkeypatch.setattr(decoder_module, "gpu_offload", lambda: True)
    assert DecoderOptions(n_gpu_layers=-1).cache_type == "f16"
    monkeypatch.undo()
    assert DecoderOptions(kv_type="f16", kv_type_k="q8_0").cache_type == "q8_0"  # llama.cpp's -ctk: K alone
    assert DecoderOptions(kv_type="f16", kv_type_k="q8_0").cache_type_v == "f16"
    with open_decoder(smollm2_path, kv_type="f16") as d:
        assert (d.kv_type, d.kv_type_v, d.kv_cache) == ("f16", "f16", "f16")


def test_default_cache_falls_back_to_f16_where_q8_0_cannot_hold_the_heads(tiny_target) -> None:
    """The tiny model's heads have 16 values, q8_0 blocks 32: the default falls back, an explicit q8_0 fails clearly."""
    with open_decoder(tiny_target) as d:
        assert d.kv_type == "f16"
        assert d.feed([1, 2, 3]).shape[0] == 3
    with pytest.raises(GGUFSpecError, match="--kv-type f16"):
        open_decoder(tiny_target, kv_type="q8_0")


def test_a_batch_puts_its_tokens_back_in_sequence_0_after_a_tree_and_after_a_fill_that_failed() -> None:
    """Between fills every slot of a llama_batch is in sequence 0 alone (fill writes no sequence ids, and fill_tree
    only those it moves): a tree's slots go back after its decode, and so do those of a fill that raised midway."""
    from ggufspec.llama_batch import Batch

    batch = Batch(4, n_seq_max=2)
    seqs = batch.struct.seq_id

    def sequences(n: int) -> list[list[int]]:
        return [[seqs[i][j] for j in range(batch.n_seq_id[i])] for i in range(n)]

    try:
        batch.fill_entries([5, 6, 7], [0, 1, 1], [[0], [3], [1, 2]], [True, True, True])
        assert sequences(3) == [[0], [3], [1, 2]]
        batch.reset_sequences()
        assert sequences(4) == [[0]] * 4
        with pytest.raises(ValueError, match="3 sequences"):  # a node in more sequences than the batch holds
            batch.fill_tree([5, 6], [0, 1], [[2], [0, 1, 2]])
        batch.fill([8, 9], 4, True)  # a chain in sequence 0: its slots are there again
        assert sequences(2) == [[0], [0]]
        batch.fill_tree([5], [0], [[0]])
        assert sequences(1) == [[0]]
    finally:
        batch.close()
