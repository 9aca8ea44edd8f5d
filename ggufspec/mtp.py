"""MTP heads: the multi-token-prediction block a model carries beside its layers (Qwen3.5/3.6's `nextn` block), run by
llama.cpp in a context of its own over the same weights, as its `draft-mtp` speculative type does.

How llama.cpp runs one (common/speculative.cpp, `common_speculative_impl_draft_mtp`; src/models/qwen35.cpp,
`graph_mtp`): the model is loaded with `load_mtp`; a second context (`ctx_type` LLAMA_CONTEXT_TYPE_MTP) holds the
block's own KV cache, one attention layer. Its entry at position p is token x_p read together with the target's hidden
row at p - 1 (`h_nextn`: the last layer's output after the final norm, the row whose logits picked x_p), and its
logits there guess x_{p+1}. Drafting goes on from its own hidden row: (guess, the head's row) one token at a time.

Here (docs/mtp.md):
- the target keeps its hidden rows by position (`HiddenRows`; llama.cpp's unmasked nextn rows: every token's, without
  the vocabulary's logits; the target's own logits stay bit for bit what they are without them);
- `MtpDecoder` is the head as a `Decoder`: `sync(context)` catches up on the committed tokens, each with the target's
  row before it, in one batch with the last one (llama.cpp decodes the target's batch again, then drafts); `feed` of a
  guess reads the head's own row. Entries made from its own rows are decoded again with the target's once it has
  judged them (the head is trained on the target's rows), so `proposers.mtp` is the draft model's proposer over it;
- rollbacks remove KV cells (the head's memory is attention only, whatever the target's is).

The staging functions (`llama_set_embeddings_nextn`, `llama_get_embeddings_nextn`) are C++ names bound by
llama-cpp-python's `llama_cpp_ext`, which raises at import where its library lacks them: `library_lacks` says so, and
the engine drafts without the head (one notice line).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from .errors import ContextLengthError, GGUFSpecError
from .history import common_prefix
from .lockstep import DecodeSteps, Lockstep, LockstepSlot
from .submission import NO_BATCH, Steps, Submission, run_steps

if TYPE_CHECKING:
    from .decoder import LlamaCppDecoder
    from .gguf_check import GGUFHeader

# What llama_cpp must offer (besides llama_cpp_ext's staging functions)
_NEEDED = ("LLAMA_CONTEXT_TYPE_MTP", "LLAMA_PROCESS_TYPE_DECODE", "llama_process", "llama_embd", "llama_batch_ext_init",
           "llama_batch_ext_free", "llama_batch_ext_clear", "llama_batch_ext_add_token", "llama_batch_ext_set_pos",
           "llama_batch_ext_set_embd_token", "llama_batch_ext_set_output_logits", "llama_model_n_layer_nextn")
_EXT = ("llama_set_embeddings_nextn", "llama_get_embeddings_nextn")
# The target's hidden rows kept for a head that is not drafting (auto's plain or lookup steps) take at most this much
# memory; older rows are dropped, and the head reads zeros there (its drafts get worse, never the text)
ROWS_BYTES = 64 << 20
ROWS_MIN = 256


def mtp_layers(header: GGUFHeader) -> int:
    """The MTP blocks a GGUF carries (`{arch}.nextn_predict_layers`), 0 for none."""
    meta = header.metadata
    n = meta.get(f"{meta.get('general.architecture')}.nextn_predict_layers")
    return n if isinstance(n, int) and n > 0 else 0


def library_lacks() -> str | None:
    """What this llama-cpp-python lacks to run MTP heads, as a user reads it; None: nothing."""
    missing = [name for name in _NEEDED if not hasattr(llama_cpp, name)]
    if not any(name == "load_mtp" for name, *_ in getattr(llama_cpp.llama_model_params, "_fields_", ())):
        missing.append("llama_model_params.load_mtp")
    try:  # its functions are bound at import, which raises where the shared library lacks one
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError, OSError) as e:
        return f"llama_cpp.llama_cpp_ext does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    missing += [name for name in _EXT if not hasattr(llama_cpp_ext, name)]
    return f"it lacks {', '.join(missing)}" if missing else None


def unavailable(header: GGUFHeader, name: str) -> str | None:
    """Why the MTP head of the model `name` (its header) cannot draft here; None: it can."""
    n = mtp_layers(header)
    if n == 0:
        return f"{name} has no MTP layers"
    if n > 1:  # step35's chained heads: llama.cpp drafts each step with another block (llama_set_nextn_layer_offset)
        return f"{name} has {n} chained MTP heads, which ggufspec does not drive yet (one head only)"
    lacks = library_lacks()
    if lacks is not None:
        return (f"{name} has MTP layers, but this llama-cpp-python ({llama_cpp.__version__}) cannot run them: {lacks} "
                "(0.3.36 or later, built with its own llama.cpp, can)")
    return None


def _ext():
    from llama_cpp import llama_cpp_ext

    return llama_cpp_ext


def record_hidden(ctx) -> None:
    """Make a target context keep every token's hidden row (llama_get_embeddings_nextn): unmasked, so a batch's own
    outputs and their logits stay as they are without it."""
    _ext().llama_set_embeddings_nextn(ctx, True, False)


def hidden_rows(ctx, n: int, width: int) -> np.ndarray:
    """The hidden rows of the last batch's n tokens, in batch order (a view of llama.cpp's buffer)."""
    ptr = _ext().llama_get_embeddings_nextn(ctx)
    if not ptr:
        raise GGUFSpecError("llama.cpp kept no hidden rows for the MTP head")
    return np.ctypeslib.as_array(ptr, shape=(n, width))


class HiddenRows:
    """A target's hidden rows by position, from `lo` to `hi` (exclusive): the row at p picked the token at p + 1, and
    is what the MTP head reads with it. At most `cap` rows (the oldest go)."""

    def __init__(self, width: int, cap: int | None = None) -> None:
        self.width = width
        self.cap = cap or max(ROWS_MIN, ROWS_BYTES // (4 * width))
        self._buf = np.zeros((min(self.cap, 64), width), np.float32)
        self.lo = self.hi = 0

    def put(self, start: int, rows: np.ndarray) -> None:
        """Rows for positions start, start + 1, ... A start past `hi` leaves a gap: the rows before it go (never read
        across it). Rows after the new ones stay: a decode at `start` without a rollback before it decodes the same
        tokens again (deferred ones)."""
        n = len(rows)
        if not self.lo <= start <= self.hi:
            self.lo = self.hi = start
        end = start - self.lo + n
        if end > self.cap:  # the oldest rows go
            drop = min(end - self.cap, self.hi - self.lo)
            self._buf[: self.hi - self.lo - drop] = self._buf[drop : self.hi - self.lo]
            self.lo += drop
            end -= drop
            if end > self.cap:  # more rows than fit at all: the last ones
                rows, start, end = rows[end - self.cap:], start + end - self.cap, self.cap
                self.lo = self.hi = start
        if end > len(self._buf):
            grown = np.zeros((min(self.cap, max(end, 2 * len(self._buf))), self.width), np.float32)
            grown[: self.hi - self.lo] = self._buf[: self.hi - self.lo]
            self._buf = grown
        self._buf[start - self.lo : end] = rows
        self.hi = max(self.hi, self.lo + end)

    def row(self, p: int) -> np.ndarray | None:
        """The row at position p (a view), None where none is kept."""
        return self._buf[p - self.lo] if self.lo <= p < self.hi else None

    def block(self, a: int, b: int) -> np.ndarray:
        """The rows at positions a..b-1, all kept (lo <= a <= b <= hi): a view."""
        return self._buf[a - self.lo : b - self.lo]

    def cut(self, n: int) -> None:
        """Forget the rows at positions n and later (a rollback to n tokens)."""
        if n <= self.lo:
            self.lo = self.hi = n
        self.hi = min(self.hi, n)

    def shift(self, keep: int, discard: int) -> None:
        """As a context shift moves the positions: rows at keep..keep+discard-1 go, later ones move down by discard."""
        rows = [(p, self.row(p)) for p in range(self.lo, self.hi) if not keep <= p < keep + discard]
        self.lo = self.hi = 0
        if rows:
            first = rows[0][0] - (discard if rows[0][0] >= keep + discard else 0)
            self.put(first, np.stack([r for _, r in rows]))

    def clear(self) -> None:
        self.lo = self.hi = 0


class _ExtBatch:
    """llama.cpp's extended batch (llama_batch_ext) of one MTP context: tokens, each with its position, sequence and
    hidden row (the row is copied in)."""

    def __init__(self, ctx) -> None:
        self.ptr = llama_cpp.llama_batch_ext_init(ctx)
        if not self.ptr:
            raise GGUFSpecError("llama.cpp could not make a batch for the MTP head")
        self._pos = (llama_cpp.llama_pos * 4)()

    def fill(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], rows: np.ndarray,
             outputs: Sequence[bool]) -> None:
        b, pos, width = self.ptr, self._pos, rows.shape[1]
        llama_cpp.llama_batch_ext_clear(b)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        base, stride = rows.ctypes.data, 4 * width
        f = ctypes.POINTER(ctypes.c_float)
        for i, (t, p, s, out) in enumerate(zip(tokens, positions, seqs, outputs)):
            idx = llama_cpp.llama_batch_ext_add_token(b, s, int(t))
            if idx < 0:
                raise GGUFSpecError(f"the MTP head's batch refused token {t} (error {idx})")
            pos[0] = p
            embd = llama_cpp.llama_embd(ctypes.cast(base + i * stride, f), 1, width)
            ok = llama_cpp.llama_batch_ext_set_pos(b, idx, pos)
            if not (ok and llama_cpp.llama_batch_ext_set_embd_token(b, idx, embd)):
                raise GGUFSpecError("the MTP head's batch refused a hidden row")
            if out:
                llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_batch_ext_free(self.ptr)
            self.ptr = None


def _mtp_context(target: LlamaCppDecoder, n_ctx: int, n_batch: int, n_seq: int, unified: bool):
    """An MTP context over the target's weights, with the target's threads, attention and cache types."""
    o = target.options
    cp = llama_cpp.llama_context_default_params()
    cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(n_batch, target.n_ubatch)
    cp.n_seq_max, cp.kv_unified = n_seq, unified
    cp.n_threads = llama_cpp.llama_n_threads(target.llama_context)
    cp.n_threads_batch = llama_cpp.llama_n_threads_batch(target.llama_context)
    if o.flash_attn is not None:
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if o.flash_attn else
                              llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    from gguf import GGMLQuantizationType

    cp.type_k = int(GGMLQuantizationType[target.kv_type.upper()])
    cp.type_v = int(GGMLQuantizationType[target.kv_type_v.upper()])
    cp.no_perf = True
    ctx = llama_cpp.llama_init_from_model(target.model.handle, cp)
    if not ctx:
        raise GGUFSpecError(f"{target.path.name}: llama.cpp could not make a context for its MTP head "
                            "(--verbose shows llama.cpp's reason)")
    _ext().llama_set_embeddings_nextn(ctx, True, False)  # every token's row: a batch's last one drafts on
    return ctx


class _Shared:
    """The MTP context several slots share: runs one tick's submissions as one batch (submission.Runner). It leads, as
    a draft model's context: every slot's draft position in one batch before the target's verification."""

    leads = True

    def __init__(self, ctx, width: int, n_vocab: int) -> None:
        self.ctx, self.width, self.n_vocab = ctx, width, n_vocab
        self.batch = _ExtBatch(ctx)

    def run(self, subs: list[Submission]) -> tuple[int, ...]:
        subs = sorted(subs, key=lambda s: s.lane)
        lanes = [0] * (1 + subs[-1].lane)
        for s in subs:
            lanes[s.lane] += len(s.tokens)
        self.batch.fill([t for s in subs for t in s.tokens], [p for s in subs for p in s.positions],
                        [s.lane for s in subs for _ in s.tokens], np.concatenate([s.embd for s in subs]),
                        [o for s in subs for o in s.outputs])
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch.ptr)
        if rc == 0:
            llama_cpp.llama_synchronize(self.ctx)
        for s in subs:
            s.rc = rc
        if rc != 0:
            return tuple(lanes)
        n_out = sum(sum(map(bool, s.outputs)) for s in subs)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        rows = hidden_rows(self.ctx, sum(lanes), self.width)
        row = at = 0
        for s in subs:
            out = [i for i, o in enumerate(s.outputs) if o]
            s.logits = logits[row : row + len(out)].copy()
            s.nextn = rows[[at + i for i in out]].copy()
            row, at = row + len(out), at + len(s.tokens)
        return tuple(lanes)

    def close(self) -> None:
        self.batch.close()
        if self.ctx is not None:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


class MtpDecoder(DecodeSteps, LockstepSlot):
    """A target's MTP head as a Decoder (what the draft model's proposer drafts from: proposers.mtp). Its history is
    the tokens its cache holds, at positions 0.., each read with the target's hidden row at the position before it
    (`rows`, the target's HiddenRows); a guess past what the target has decoded is read with the head's own row of the
    token before it, and such entries are not kept as a prefix (`sync` decodes them again with the target's rows).

    On a context of its own (`open`), or as one of the slots of a shared one (`slots`), whose decodes run in one batch
    per tick with the other slots' (lockstep.py)."""

    memory = None  # attention only: rollbacks remove cells (costs.measure reads it)
    n_deferred = 0
    hold_seconds = 0.0
    shift_keep: int | None = None

    def __init__(self, target: LlamaCppDecoder, ctx, batch: _ExtBatch | None, seq: int = 0,
                 lockstep: Lockstep | None = None, runner: _Shared | None = None) -> None:
        if target.hidden_rows is None:
            raise GGUFSpecError(f"{target.path.name} was loaded without its MTP layers (DecoderOptions.mtp)")
        self.target, self.rows = target, target.hidden_rows
        self.path, self.n_vocab, self.n_ctx = target.path, target.n_vocab, target.n_ctx
        self.width = target.hidden_rows.width  # llama.cpp's n_embd_out: the target's rows and the head's inputs
        self._ctx, self._batch, self._seq, self._lockstep, self._runner = ctx, batch, seq, lockstep, runner
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._n_batch = llama_cpp.llama_n_batch(ctx) if runner is None else target.options.n_batch
        self.history: list[int] = []
        self._exact = 0  # the history's leading entries made with the target's rows: a prefix sync may keep
        self._own: tuple[int, np.ndarray] | None = None  # (position, the head's row there): the last token it fed
        self.decode_seconds = 0.0
        self.n_decodes = self.n_decoded_tokens = self.n_batched_tokens = 0
        self.last_batch = NO_BATCH  # a slot's last decode's whole batch (submission.BatchShape)

    @classmethod
    def open(cls, target: LlamaCppDecoder) -> MtpDecoder:
        """The head of `target` (loaded with DecoderOptions.mtp), on a context of its own as long as the target's."""
        ctx = _mtp_context(target, target.n_ctx, target.options.n_batch, 1, True)
        return cls(target, ctx, _ExtBatch(ctx))

    @classmethod
    def slots(cls, targets: Sequence[LlamaCppDecoder], lockstep: Lockstep) -> list[MtpDecoder]:
        """The heads of a pool's target slots (LlamaCppDecoder.slots), slot i in sequence i of one shared context, a
        KV stream each where several (as the target's)."""
        n, first = len(targets), targets[0]
        chunk = first.options.n_batch
        extra = n * chunk if n > 1 else 0  # as the target's slots (LlamaCppDecoder.slots)
        ctx = _mtp_context(first, first.n_ctx * n + extra, n * chunk, n, n == 1)
        runner = _Shared(ctx, first.hidden_rows.width, first.n_vocab)
        return [cls(t, ctx, None, i, lockstep, runner) for i, t in enumerate(targets)]

    @property
    def llama_context(self):
        if self._ctx is None:
            raise GGUFSpecError("this MTP head is closed")
        return self._ctx

    def _locked(self):
        return self._lockstep.lock if self._lockstep is not None else nullcontext()

    # --- decoding -------------------------------------------------------------------------

    def feed(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False) -> np.ndarray:
        """Decode `tokens` after the history (each with the row before it, see the class); logits of every token (or
        the last), (n, V). `view` is accepted for Decoder's sake: the rows are copies."""
        return run_steps(self.feed_steps(tokens, all_logits, view))

    def feed_steps(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False,
                   picks: bool = False) -> Steps[np.ndarray]:
        """feed as a decode coroutine (submission.Steps); its rows' argmax is never worked out with the batch (picks)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("feed needs at least one token")
        if len(self.history) + n > self.n_ctx:
            raise ContextLengthError(f"{len(self.history) + n} tokens do not fit the MTP head's context of "
                                     f"{self.n_ctx} tokens (raise --n-ctx).")
        out = []
        for at in range(0, n, self._n_batch):  # without all_logits, each chunk's last row only (its own row)
            logits = yield from self._decode(list(map(int, tokens[at : at + self._n_batch])), all_logits)
            if all_logits or at + self._n_batch >= n:
                out.append(logits)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _inputs(self, start: int, n: int) -> tuple[np.ndarray, int]:
        """The rows tokens at start..start+n-1 read (the target's at the position before each, zeros at position 0 or
        where the target's rows were dropped, the head's own after the last token it fed), and how many of the first
        tokens read the target's (or zeros for good): those entries may be kept as a prefix."""
        rows, first = np.zeros((n, self.width), np.float32), start - 1
        a, b = max(first, self.rows.lo), min(first + n, self.rows.hi)
        if a < b:
            rows[a - first : b - first] = self.rows.block(a, b)
        exact = min(n, max(0, self.rows.hi - first))
        if exact == 0 and self._own is not None and self._own[0] == first:
            rows[0] = self._own[1]
        return rows, exact

    def _decode(self, tokens: list[int], all_logits: bool) -> Steps[np.ndarray]:
        start, n = len(self.history), len(tokens)
        rows, exact = self._inputs(start, n)
        outputs = [all_logits or i == n - 1 for i in range(n)]
        positions = range(start, start + n)
        if self._runner is not None:
            sub = Submission(tokens, positions, [[self._seq]] * n, outputs, lane=self._seq, embd=rows,
                             lockstep=self._lockstep, runner=self._runner)
            yield sub
            self.decode_seconds += sub.seconds
            self.n_batched_tokens += sub.shape.tokens
            self.last_batch, rc = sub.shape, sub.rc
            logits, own = sub.logits, (sub.nextn[-1] if sub.rc == 0 else None)
        else:
            self._batch.fill(tokens, positions, [0] * n, rows, outputs)
            t0 = time.perf_counter()
            rc = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch.ptr)
            if rc == 0:
                llama_cpp.llama_synchronize(self._ctx)
            self.decode_seconds += time.perf_counter() - t0
            self.n_batched_tokens += n
            if rc == 0:
                n_out = sum(outputs)
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
                logits = logits.copy()
                own = hidden_rows(self._ctx, n, self.width)[-1].copy()
        self.n_decodes += 1
        self.n_decoded_tokens += n
        if rc != 0:
            raise GGUFSpecError(f"the MTP head's decode failed with code {rc} at position {start}")
        if self._exact == start:
            self._exact += exact
        self.history.extend(tokens)
        self._own = (start + n - 1, own)
        return logits

    def sync(self, tokens: Sequence[int], view: bool = False) -> np.ndarray:
        """Make the history `tokens`, keeping the common prefix made with the target's rows; logits after the last."""
        return run_steps(self.sync_steps(tokens, view))

    def sync_steps(self, tokens: Sequence[int], view: bool = False) -> Steps[np.ndarray]:
        tokens = list(tokens)
        if not tokens:
            raise ValueError("sync needs at least one token")
        keep = min(common_prefix(self.history, tokens), self._exact, len(tokens) - 1)
        self.rollback_to(keep)
        return (yield from self.feed_steps(tokens[keep:], all_logits=False))

    def unseen(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` a sync would decode."""
        return len(tokens) - min(common_prefix(self.history, list(tokens)), self._exact)

    def rollback_to(self, n: int) -> None:
        if not 0 <= n <= len(self.history):
            raise ValueError(f"cannot roll back to {n}: the history holds {len(self.history)} tokens")
        if n < len(self.history):
            with self._locked():
                llama_cpp.llama_memory_seq_rm(self._mem, self._seq, n, -1)
            del self.history[n:]
        self._exact = min(self._exact, n)
        if self._own is not None and self._own[0] >= n:
            self._own = None

    def hold(self, undo: int | None = None, anchor: bool = False) -> None:
        """Nothing to hold: the head's memory is attention only."""

    def reset(self) -> None:
        self.rollback_to(0)

    def close(self) -> None:
        """Free the head's context (a slot lets go of it: the pool frees the shared one, close_shared)."""
        if self._runner is None and self._ctx is not None:
            self._batch.close()
            llama_cpp.llama_free(self._ctx)
        self._ctx = None

    def close_shared(self) -> None:
        """Free the context a pool's slots share (after all of them closed)."""
        if self._runner is not None:
            self._runner.close()
