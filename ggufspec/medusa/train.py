"""Training Medusa heads for a GGUF target: collect (hidden state, token) pairs with llama.cpp, fit in numpy.

Data: the target's own greedy answers to a prompt set (self-distillation, what the heads see at run
time), and/or plain text. Row i of a sequence holds the final-norm hidden state after token i and
token i; head k learns token i + k + 2 from hidden state i. `medusa train` writes the trained heads to GGUF
through `format.write_heads` (and, when asked, also as a FasterDecoding checkpoint: `checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..chat import chat_tokens as _chat_tokens
from ..decoder import DecoderOptions, LlamaCppDecoder
from ..errors import GGUFSpecError
from .checkpoint import save_checkpoint  # noqa: F401  (its old home: callers import it from here)
from .heads import ResBlocks

Progress = Callable[[str], None]


@dataclass
class Corpus:
    """Sequences of tokens and the hidden state after each token (float16); optionally the target's top
    logits after each token (`top_ids`, `top_logits`: soft labels for the heads)."""

    tokens: list[np.ndarray]
    hidden: list[np.ndarray]
    top_ids: list[np.ndarray] | None = None
    top_logits: list[np.ndarray] | None = None

    def save(self, path: Path) -> None:
        """Write the corpus to `path` (.npz content) atomically: no file, or a complete one, even on SIGTERM."""
        from ..outputs import temp_output

        lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        soft = {}
        if self.top_ids is not None and self.top_logits is not None:
            soft = {"top_ids": np.concatenate(self.top_ids), "top_logits": np.concatenate(self.top_logits)}
        # through a temp file: an interrupted or failed save must not leave a cache that the next run reuses; and
        # through a file object, so that numpy writes exactly `path` (given a name, it appends ".npz")
        with temp_output(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, lengths=lengths, tokens=np.concatenate(self.tokens), hidden=np.concatenate(self.hidden), **soft)

    @classmethod
    def load(cls, path: Path) -> Corpus:
        z = np.load(path)
        cuts = np.cumsum(z["lengths"])[:-1]
        soft = [np.split(z[k], cuts) if k in z.files else None for k in ("top_ids", "top_logits")]
        return cls(np.split(z["tokens"], cuts), np.split(z["hidden"], cuts), *soft)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def read_prompts(path: Path) -> list[str]:
    """Prompts from JSONL (`turns[0]`, `prompt` or `text`) or plain text, one a line."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            obj = json.loads(line)
            text = obj["turns"][0] if "turns" in obj else obj.get("prompt") or obj.get("text")
            if not text:
                raise GGUFSpecError(f"{path}: a JSON line has no turns, prompt or text field")
            out.append(text)
        else:
            out.append(line)
    return out


def chat_tokens(target: LlamaCppDecoder, prompt: str) -> list[int]:
    """The prompt as one user message, tokenized exactly as the engine does at inference (BOS included)."""
    return _chat_tokens(target.vocab, target.metadata("tokenizer.chat_template"), [{"role": "user", "content": prompt}])


def collect_generations(
    target: LlamaCppDecoder, prompts: list[list[int]], max_new: int, n_parallel: int, progress: Progress | None = None,
) -> Corpus:
    """The target's greedy answers, `n_parallel` sequences per llama.cpp batch (one slot per sequence id).

    Needs a decoder opened with embeddings=True, n_seq_max >= n_parallel, n_batch >= the longest prompt
    and room in n_ctx for n_parallel whole sequences; its history must be empty, and is again after.
    """
    queue = list(enumerate(prompts))
    slots: dict[int, tuple[list[int], list[np.ndarray], int, int, int]] = {}  # seq -> tokens, hidden, pos, new, prompt
    done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    eog = target.vocab.eog_ids
    t0, done_tokens = time.perf_counter(), 0

    def decode(tokens: list[int], positions: list[int], seqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        best = target.decode_sequences(tokens, positions, seqs, view=True).argmax(-1)
        return best, target.hidden_states().astype(np.float16)

    try:
        while queue or slots:
            for s in range(n_parallel):
                if s not in slots and queue:
                    i, p = queue.pop(0)
                    target.clear_sequence(s)
                    best, hid = decode(p, list(range(len(p))), [s] * len(p))
                    slots[s] = ([p[-1], int(best[-1])], [hid[-1]], len(p), 1, i)
            seqs = sorted(slots)
            best, hid = decode([slots[s][0][-1] for s in seqs], [slots[s][2] for s in seqs], seqs)
            for row, s in enumerate(seqs):
                toks, hs, pos, new, i = slots[s]
                hs.append(hid[row])
                if toks[-1] in eog or new >= max_new:
                    done[i] = (np.array(toks, dtype=np.int32), np.stack(hs))
                    done_tokens += len(toks)
                    del slots[s]
                    if progress:
                        rate = done_tokens / (time.perf_counter() - t0)
                        progress(f"collect: {len(done)}/{len(prompts)} answers, {done_tokens} tokens, {rate:.0f} tok/s")
                else:
                    toks.append(int(best[row]))
                    slots[s] = (toks, hs, pos + 1, new + 1, i)
    finally:
        target.reset()
    return Corpus([done[i][0] for i in sorted(done)], [done[i][1] for i in sorted(done)])


def collect_text(target: LlamaCppDecoder, texts: Iterable[str], chunk: int, progress: Progress | None = None) -> Corpus:
    """Hidden states over plain text, `chunk` tokens per sequence."""
    out = Corpus([], [])
    for text in texts:
        ids = target.vocab.tokenize(text, add_special=True, parse_special=False)
        for start in range(0, len(ids) - 8, chunk):
            piece = ids[start : start + chunk]
            target.rollback_to(0)
            target.feed(piece)
            out.tokens.append(np.array(piece, dtype=np.int32))
            out.hidden.append(target.hidden_states().astype(np.float16))
            if progress:
                progress(f"collect text: {out.n_tokens} tokens")
    target.rollback_to(0)
    return out


def open_for_collection(path: Path, n_parallel: int, max_len: int, threads: int | None = None) -> LlamaCppDecoder:
    """A target context with hidden states on and room for n_parallel sequences of max_len tokens."""
    return LlamaCppDecoder(path, DecoderOptions(
        n_ctx=n_parallel * max_len, n_batch=max(512, max_len), embeddings=True, n_seq_max=n_parallel, n_threads=threads,
    ))


@dataclass
class TrainConfig:
    """Head count, optimiser and split; ResBlocks start at zero, so an untrained head predicts the next token."""

    heads: int = 4
    epochs: int = 10
    batch: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    valid_samples: int = 512  # held-out positions the per-epoch top-1 is measured on
    held_out: float = 0.05  # share of positions (whole sequences) kept out of training, for validation and the tree
    negatives: int = 4096
    seed: int = 0
    soft_weight: float = 0.5  # share of the loss on the target's top-K distribution, when the data has it


@dataclass
class Pairs:
    """Training positions: hidden states of every position, and per sample its row, sequence and labels."""

    hidden: np.ndarray  # [P, H] float16, all positions of all sequences
    rows: np.ndarray  # [N] row of the sample's own hidden state
    labels: np.ndarray  # [N, heads] token i + k + 2, -1 past the end
    seqs: np.ndarray | None = None  # [N] which sequence: validation holds out whole sequences
    soft_ids: np.ndarray | None = None  # [N, heads, K] the target's top-K for token i + k + 2
    soft_logits: np.ndarray | None = None  # [N, heads, K]


def training_pairs(corpus: Corpus, heads: int) -> Pairs:
    """Every position i with at least token i + 2 known is a sample; head k learns token i + k + 2
    (and, with the corpus's top logits, the target's distribution after token i + k + 1)."""
    rows, labels, seqs, soft_i, soft_v = [], [], [], [], []
    base = 0
    for j, toks in enumerate(corpus.tokens):
        n = len(toks) - 2
        if n >= 1:
            y = np.full((n, heads), -1, dtype=np.int64)
            for k in range(heads):
                m = max(0, n - k)
                y[:m, k] = toks[k + 2 :]
            if corpus.top_ids is not None:
                ids, val = corpus.top_ids[j], corpus.top_logits[j]
                si = np.zeros((n, heads, ids.shape[1]), dtype=np.int32)
                sv = np.full((n, heads, ids.shape[1]), -1e4, dtype=np.float16)
                for k in range(heads):
                    m = max(0, n - k)
                    si[:m, k], sv[:m, k] = ids[k + 1 : k + 1 + m], val[k + 1 : k + 1 + m]
                soft_i.append(si)
                soft_v.append(sv)
            rows.append(base + np.arange(n))
            labels.append(y)
            seqs.append(np.full(n, j))
        base += len(toks)
    if not rows:
        raise GGUFSpecError("the training data holds no sequence of 3 tokens or more")
    soft = (np.concatenate(soft_i), np.concatenate(soft_v)) if soft_i else (None, None)
    return Pairs(np.concatenate(corpus.hidden), np.concatenate(rows), np.concatenate(labels), np.concatenate(seqs),
                 *soft)


class _Adam:
    def __init__(self, params: list[np.ndarray], lr: float, weight_decay: float) -> None:
        self.params, self.lr, self.wd, self.t = params, lr, weight_decay, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, grads: list[np.ndarray]) -> None:
        self.t += 1
        c1, c2 = 1 - 0.9**self.t, 1 - 0.999**self.t
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= self.lr * ((m / c1) / (np.sqrt(v / c2) + 1e-8) + self.wd * p)


def _split(data: Pairs, n_valid: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(validation, training) sample indices; whole sequences are held out, so neighbouring positions
    of one answer never sit on both sides (they would make validation look better than new text)."""
    if data.seqs is None:
        order = rng.permutation(len(data.rows))
        return order[:n_valid], order[n_valid:]
    sizes = np.bincount(data.seqs)
    order = rng.permutation(len(sizes))
    n_held = int(np.searchsorted(np.cumsum(sizes[order]), n_valid)) + 1
    if n_held >= len(sizes):  # too few sequences to hold any out: split positions
        order = rng.permutation(len(data.rows))
        return order[:n_valid], order[n_valid:]
    held = np.isin(data.seqs, order[:n_held])
    return rng.permutation(np.flatnonzero(held)), rng.permutation(np.flatnonzero(~held))


def held_out_size(n: int, cfg: TrainConfig) -> int:
    return min(max(cfg.valid_samples, int(cfg.held_out * n)), max(1, n // 10))


def held_out(data: Pairs, cfg: TrainConfig) -> np.ndarray:
    """The samples train_heads kept out of training with this config (the same split, from the same seed)."""
    return _split(data, held_out_size(len(data.rows), cfg), np.random.default_rng(cfg.seed))[0]


def train_heads(
    data: Pairs, lm_head: np.ndarray, cfg: TrainConfig, progress: Progress | None = None,
) -> tuple[list[list[tuple[np.ndarray, np.ndarray]]], dict[str, list[float]]]:
    """Fit one ResBlock per head; returns the blocks and the validation top-1 accuracy per head and epoch.

    Loss: cross-entropy through the frozen LM head, with the softmax over the `negatives` most frequent
    label tokens plus the batch's labels: a step costs [H, C] products per sample instead of [H, V] ones,
    minutes instead of hours on a CPU. Accuracy is measured through the full LM head.
    """
    rng = np.random.default_rng(cfg.seed)
    n, hidden, k = len(data.rows), data.hidden.shape[1], data.labels.shape[1]
    valid, train = _split(data, held_out_size(n, cfg), rng)
    valid = valid[: cfg.valid_samples]
    w = np.zeros((k * hidden, hidden), dtype=np.float32)  # all heads' ResBlocks stacked: one matmul
    b = np.zeros(k * hidden, dtype=np.float32)
    # views of w and b, which the optimiser updates in place
    stacked = ResBlocks(k, hidden, [w.reshape(k, hidden, hidden)], [b.reshape(k, hidden)], w.T)
    opt = _Adam([w, b], cfg.lr, cfg.weight_decay)
    history: dict[str, list[float]] = {"loss": [], **{f"top1_head{i}": [] for i in range(k)}}
    t0 = time.perf_counter()
    counts = np.bincount(data.labels[data.labels >= 0], minlength=lm_head.shape[0])
    frequent = np.argsort(-counts)[: cfg.negatives]
    steps_per_epoch = max(1, len(train) // cfg.batch)
    for epoch in range(cfg.epochs):
        rng.shuffle(train)
        running = []
        for step in range(steps_per_epoch):
            idx = train[step * cfg.batch : (step + 1) * cfg.batch]
            loss, grads = _loss_and_grads(stacked, data, idx, lm_head, frequent, cfg)
            opt.step(grads)
            running.append(loss)
            if progress:
                rate = (epoch * steps_per_epoch + step + 1) * cfg.batch / (time.perf_counter() - t0)
                progress(f"epoch {epoch + 1}/{cfg.epochs} step {step + 1}/{steps_per_epoch} "
                         f"loss {np.mean(running[-20:]):.4f} ({rate:.0f} samples/s)")
        acc = _accuracy(stacked, data, lm_head, valid)
        history["loss"].append(float(np.mean(running)))
        for i, a in enumerate(acc):
            history[f"top1_head{i}"].append(a)
        if progress:
            progress(f"epoch {epoch + 1}: train loss {np.mean(running):.4f}, validation top-1 per head "
                     + " ".join(f"{a:.1%}" for a in acc))
    blocks = [[(w[i * hidden : (i + 1) * hidden].copy(), b[i * hidden : (i + 1) * hidden].copy())] for i in range(k)]
    return blocks, history


def _accuracy(stacked: ResBlocks, data: Pairs, lm_head: np.ndarray, idx: np.ndarray) -> list[float]:
    """Top-1 accuracy of each head on the samples `idx`, through the full LM head."""
    k = data.labels.shape[1]
    out = stacked(data.hidden[data.rows[idx]].astype(np.float32))
    y = data.labels[idx]
    pred = np.stack([(out[:, i] @ lm_head.T).argmax(-1) for i in range(k)], axis=1)
    return (((pred == y) & (y >= 0)).sum(0) / np.maximum((y >= 0).sum(0), 1)).tolist()


def _loss_and_grads(stacked: ResBlocks, data: Pairs, idx: np.ndarray, lm_head: np.ndarray, frequent: np.ndarray,
                    cfg: TrainConfig) -> tuple[float, list[np.ndarray]]:
    """One batch's loss and the gradients of the stacked ResBlocks' weights and biases: cross-entropy through the
    frozen LM head over the batch's labels, soft-label tokens and the `frequent` ones (train_heads)."""
    hidden, k = data.hidden.shape[1], data.labels.shape[1]
    xb = data.hidden[data.rows[idx]].astype(np.float32)
    yb = data.labels[idx]
    mask = yb >= 0
    soft = data.soft_ids[idx] if data.soft_ids is not None else np.zeros((*yb.shape, 0), np.int32)
    labels = np.where(mask, yb, yb[mask][0]).ravel()
    vocab, inverse = np.unique(np.concatenate([labels, soft.ravel(), frequent]), return_inverse=True)
    y_sub = inverse[: yb.size].reshape(yb.shape)
    lm_c = lm_head[vocab]  # [C, H]
    pre: list[np.ndarray] = []
    out = stacked(xb, pre)  # the heads' outputs [B, k, H]; pre: their pre-activations z, for the backward pass
    z = pre[0]
    s = 1.0 / (1.0 + np.exp(-z))
    logits = (out.reshape(-1, hidden) @ lm_c.T).reshape(len(xb), k, -1)  # [B, k, C], one 2-D product
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    r, c = np.nonzero(mask)
    count = max(1, int(mask.sum()))
    # what to predict: the label; with soft labels, the label at 1 - soft_weight and the
    # target's top-K distribution at soft_weight
    top_k = soft.shape[-1]
    want = np.zeros_like(p)
    want[r, c, y_sub[r, c]] = 1.0 - cfg.soft_weight if top_k else 1.0
    if top_k:
        t = data.soft_logits[idx].astype(np.float32)
        t = np.exp(t - t.max(-1, keepdims=True))
        t /= t.sum(-1, keepdims=True)
        s_sub = inverse[yb.size : yb.size + soft.size].reshape(soft.shape)
        np.add.at(want, (np.repeat(r, top_k), np.repeat(c, top_k), s_sub[r, c].ravel()),
                  cfg.soft_weight * t[r, c].ravel())
    loss = float(-(want * np.log(p + 1e-12)).sum() / count)
    p -= want
    p *= (mask / count)[:, :, None]
    dz = (p.reshape(-1, p.shape[-1]) @ lm_c).reshape(z.shape) * (s * (1.0 + z * (1.0 - s)))  # d/dz of z*sigmoid(z)
    dz = dz.reshape(len(xb), k * hidden)
    return loss, [dz.T @ xb, dz.sum(0)]
