"""Distil the demo target into a small llama-architecture draft and write it as GGUF through our own converter.

Recipe step 2 of 2 (step 1: draft_data.py). Needs torch (`pip install -e '.[torch]'`).

Why this shape: the target (30 layers x 576, vocab 49152, tied embeddings) spends a large share of each step on
its 49152 x 576 output matmul, so a draft is only cheap with a narrow width. 4 layers (`--layers`; the demo
draft has 6) at width 256 (GQA 4/2 heads, FFN 768), tied embeddings initialised from the top-256 principal
directions of the target's own embedding matrix, so the draft starts in the target's token space and only the
layers have to be learned. Loss: cross-entropy against the target's top-16 distribution (renormalised) at every
position, plus its greedy token.

    nice -n 19 python scripts/recipes/draft_train.py TARGET.gguf OUT_DIR DATA.npz [MORE.npz ...] --minutes 25 --seed 0 [--layers 6]
    ggufspec convert hf OUT_DIR/hf models/demo/smollm2-135m-draft.Q8_0.gguf --vocab-from TARGET.gguf --outtype q8_0
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from torch import nn

HIDDEN = 256
ROPE_THETA, EPS = 100000.0, 1e-5


@dataclass(frozen=True)
class Shape:
    """The draft's shape; width 256 whatever the rest, because the 49152-row output dominates a step's cost."""

    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 768


def target_tensors(path: str) -> dict[str, np.ndarray]:
    """The target's tensors, dequantized to float32, rows first (out, in) as in Hugging Face checkpoints."""
    out = {}
    for t in GGUFReader(path).tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 or len(t.shape) > 1 else a
    return out


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows back to Hugging Face's halves layout (inverse of the converter's permute)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half layout; the converter permutes q/k into llama.cpp's."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, sh: Shape) -> None:
        super().__init__()
        self.sh = sh
        self.input_layernorm = nn.RMSNorm(HIDDEN, eps=EPS)
        self.q_proj = nn.Linear(HIDDEN, sh.heads * sh.head_dim, bias=False)
        self.k_proj = nn.Linear(HIDDEN, sh.kv_heads * sh.head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, sh.kv_heads * sh.head_dim, bias=False)
        self.o_proj = nn.Linear(sh.heads * sh.head_dim, HIDDEN, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, eps=EPS)
        self.gate_proj = nn.Linear(HIDDEN, sh.ffn, bias=False)
        self.up_proj = nn.Linear(HIDDEN, sh.ffn, bias=False)
        self.down_proj = nn.Linear(sh.ffn, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        sh = self.sh
        h = self.input_layernorm(x)
        q = rope(self.q_proj(h).view(b, n, sh.heads, sh.head_dim).transpose(1, 2), cos, sin)
        k = rope(self.k_proj(h).view(b, n, sh.kv_heads, sh.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(b, n, sh.kv_heads, sh.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, n, sh.heads * sh.head_dim))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Draft(nn.Module):
    def __init__(self, emb: torch.Tensor, sh: Shape = Shape()) -> None:
        super().__init__()
        self.sh = sh
        self.embed_tokens = nn.Embedding.from_pretrained(emb, freeze=False)
        self.layers = nn.ModuleList(Block(sh) for _ in range(sh.layers))
        self.norm = nn.RMSNorm(HIDDEN, eps=EPS)
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, sh.head_dim, 2).float() / sh.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_from_target(self, t: dict[str, np.ndarray], proj: np.ndarray, layers: list[int], heads: int,
                         kv_heads: int) -> None:
        """Copy target layers `layers`, their residual stream compressed to `proj`'s 256 directions.

        q/k/v/gate/up read the stream through proj (W P), o/down write into it (P^T W); RMSNorm gains become the
        diagonal of P^T diag(g) P, times sqrt(576/256) since an RMS over 256 compressed dims runs that much larger.
        """
        p = proj
        scale = math.sqrt(p.shape[0] / p.shape[1])

        def gain(g: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(((p**2).T @ g) * scale).float()

        with torch.no_grad():
            for mine, i in zip(self.layers, layers):
                b = f"blk.{i}."
                mine.q_proj.weight.copy_(torch.from_numpy(unpermute_rotary(t[b + "attn_q.weight"], heads) @ p))
                mine.k_proj.weight.copy_(torch.from_numpy(unpermute_rotary(t[b + "attn_k.weight"], kv_heads) @ p))
                mine.v_proj.weight.copy_(torch.from_numpy(t[b + "attn_v.weight"] @ p))
                mine.o_proj.weight.copy_(torch.from_numpy(p.T @ t[b + "attn_output.weight"]))
                mine.gate_proj.weight.copy_(torch.from_numpy(t[b + "ffn_gate.weight"] @ p))
                mine.up_proj.weight.copy_(torch.from_numpy(t[b + "ffn_up.weight"] @ p))
                mine.down_proj.weight.copy_(torch.from_numpy(p.T @ t[b + "ffn_down.weight"]))
                mine.input_layernorm.weight.copy_(gain(t[b + "attn_norm.weight"]))
                mine.post_attention_layernorm.weight.copy_(gain(t[b + "ffn_norm.weight"]))
            self.norm.weight.copy_(gain(t["output_norm.weight"]))

    def init_from_draft(self, t: dict[str, np.ndarray]) -> None:
        """Continue from an earlier draft GGUF of this shape (e.g. the shipped one): its tensors, q/k rows
        put back in Hugging Face's layout."""
        names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                 "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
                 "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
        heads = {"q_proj": self.sh.heads, "k_proj": self.sh.kv_heads}
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.from_numpy(t["token_embd.weight"]))
            self.norm.weight.copy_(torch.from_numpy(t["output_norm.weight"]))
            for i, layer in enumerate(self.layers):
                for name, param in layer.named_children():
                    w = t[f"blk.{i}.{names[name]}.weight"]
                    w = unpermute_rotary(w, heads[name]) if name in heads else w
                    param.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)))

    def forward(self, ids: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, or only over the token ids in `vocab` (a sampled softmax)."""
        pos = torch.arange(ids.shape[1]).float()
        f = torch.outer(pos, self.inv_freq)
        f = torch.cat((f, f), dim=-1)
        cos, sin = f.cos(), f.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        w = self.embed_tokens.weight if vocab is None else self.embed_tokens.weight[vocab]
        return self.norm(x) @ w.T

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face LlamaForCausalLM names."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                group = "self_attn" if name.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                if "layernorm" in name:
                    out[f"model.layers.{i}.{name}"] = p
                else:
                    out[f"model.layers.{i}.{group}.{name}"] = p
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_config(n_vocab: int, sh: Shape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": sh.ffn, "num_hidden_layers": sh.layers, "num_attention_heads": sh.heads,
        "num_key_value_heads": sh.kv_heads, "head_dim": sh.head_dim, "vocab_size": n_vocab, "rms_norm_eps": EPS, "rope_theta": ROPE_THETA,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def load_data(path: str) -> list[tuple[np.ndarray, ...]]:
    z = np.load(path)
    d = {k: z[k] for k in ("plens", "lens", "tokens", "idx", "val")}  # an NpzFile re-reads an array at every access
    out, off = [], 0
    for plen, n in zip(d["plens"], d["lens"]):
        out.append((int(plen), d["tokens"][off : off + n], d["idx"][off : off + n], d["val"][off : off + n]))
        off += n
    return out


def batches(seqs, rng: np.random.Generator, max_tokens: int, max_len: int):
    """Random batches of sequences (cut to max_len, windows at random offsets), padded to their longest."""
    order = rng.permutation(len(seqs))
    cur: list = []
    for i in order:
        plen, toks, idx, val = seqs[i]
        if len(toks) > max_len:  # keep the generated part: start the window where it still ends in the answer
            s = int(rng.integers(max(0, min(plen, len(toks) - max_len) - 64), len(toks) - max_len + 1))
            plen, toks, idx, val = max(0, plen - s), toks[s : s + max_len], idx[s : s + max_len], val[s : s + max_len]
        cur.append((plen, toks, idx, val))
        if sum(len(c[1]) for c in cur) >= max_tokens:
            yield collate(cur)
            cur = []
    if cur:
        yield collate(cur)


def collate(cur):
    n = max(len(c[1]) for c in cur)
    ids = np.zeros((len(cur), n), np.int64)
    idx = np.zeros((len(cur), n, 16), np.int64)
    val = np.full((len(cur), n, 16), -1e4, np.float32)
    w = np.zeros((len(cur), n), np.float32)
    for b, (plen, toks, ix, v) in enumerate(cur):
        m = len(toks)
        ids[b, :m], idx[b, :m], val[b, :m] = toks, ix, v
        w[b, :m] = 0.3
        w[b, max(plen - 1, 0) : m] = 1.0  # the answer positions matter most: that is where the draft drafts
    return torch.from_numpy(ids), torch.from_numpy(idx), torch.from_numpy(val), torch.from_numpy(w)


def candidates(idx: torch.Tensor, n_vocab: int, n_neg: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled softmax: the batch's teacher top-k ids plus random negatives; returns (ids, idx remapped into them).

    The full 49152-way output costs most of a training step on CPU; the teacher's top-16 at every position of the
    batch already covers every token that matters for the draft's greedy choice, and the negatives keep the rest low.
    """
    neg = torch.randint(0, n_vocab, (n_neg,), generator=gen)
    vocab = torch.unique(torch.cat([idx.reshape(-1), neg]))
    return vocab, torch.searchsorted(vocab, idx)


def loss_fn(logits: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = torch.softmax(val, dim=-1)
    lq = torch.gather(logq, -1, idx)
    per_tok = -(p * lq).sum(-1) - lq[..., 0]  # soft top-k + the greedy token itself
    return (per_tok * w).sum() / w.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("out_dir")
    ap.add_argument("data", nargs="+", help="npz files from draft_data.py (on-policy and --corpus)")
    ap.add_argument("--minutes", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024, help="Tokens per step (small data: many small steps).")
    ap.add_argument("--layers", type=int, default=4, help="Transformer layers (width stays 256).")
    ap.add_argument("--init-layers", default="", help="Start from these target layers (e.g. 0,1,2,29), compressed to width 256.")
    ap.add_argument("--init-draft", default="", help="Continue from this draft GGUF (same shape; --layers must match).")
    ap.add_argument("--held-out", type=int, default=12, help="Answers held out to pick the best epoch.")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()

    t = target_tensors(args.target)
    e = t["token_embd.weight"]
    _, _, vt = np.linalg.svd(e[::4], full_matrices=False)  # directions from a quarter of the rows: enough, 4x faster
    proj = np.ascontiguousarray(vt[:HIDDEN].T)  # (576, 256), orthonormal columns
    emb = torch.from_numpy(e @ proj).contiguous()  # the target's own scale: its tied output expects it
    if args.init_layers:
        layers = [int(x) for x in args.init_layers.split(",")]
        heads, kv = t["blk.0.attn_q.weight"].shape[0] // 64, t["blk.0.attn_k.weight"].shape[0] // 64
        model = Draft(emb, Shape(len(layers), heads, kv, 64, t["blk.0.ffn_gate.weight"].shape[0]))
        model.init_from_target(t, proj, layers, heads, kv)
    else:
        model = Draft(emb, Shape(layers=args.layers))
        if args.init_draft:
            model.init_from_draft(target_tensors(args.init_draft))
    del t
    seqs = [s for path in args.data for s in load_data(path)]
    random.Random(args.seed).shuffle(seqs)
    # Held out: answers to prompts (on-policy text), the kind of text the draft meets when decoding.
    answers = [i for i, x in enumerate(seqs) if x[0] > 0]
    held_ids = set(answers[: max(1, min(len(answers) // 20, args.held_out))] or [0])
    held = [x for i, x in enumerate(seqs) if i in held_ids]
    tgen = torch.Generator().manual_seed(args.seed)
    train = [x for i, x in enumerate(seqs) if i not in held_ids]
    n_train = sum(len(x[1]) for x in train)
    print(f"{len(train)} train sequences ({n_train} tokens), {len(held)} held out; setup {time.time() - t0:.0f} s", flush=True)

    emb_params = [model.embed_tokens.weight]
    other = [p for n, p in model.named_parameters() if n != "embed_tokens.weight"]
    opt = torch.optim.AdamW([{"params": other, "lr": args.lr}, {"params": emb_params, "lr": args.lr * 0.1}],
                            weight_decay=0.01, betas=(0.9, 0.98))
    budget = args.minutes * 60
    step, epoch, t_train = 0, 0, time.time()

    def held_acc() -> float:
        model.eval()
        hit = tot = 0
        with torch.no_grad():
            for ids, idx, val, w in batches(held, np.random.default_rng(0), 4096, 512):
                pred = model(ids).argmax(-1)
                m = w >= 1.0
                hit += int(((pred == idx[..., 0]) & m).sum())
                tot += int(m.sum())
        model.train()
        return hit / max(tot, 1)

    best, best_state = held_acc(), {k: v.clone() for k, v in model.state_dict().items()}  # --init-draft may already be best
    print(f"held-out greedy agreement at init: {best:.3f}", flush=True)
    done = False
    while not done and time.time() - t_train < budget:
        epoch += 1
        for ids, idx, val, w in batches(train, rng, args.batch_tokens, 512):
            frac = (time.time() - t_train) / budget
            if frac >= 1:
                done = True
                break
            for g, base in zip(opt.param_groups, (args.lr, args.lr * 0.1)):
                g["lr"] = base * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            vocab, local = candidates(idx, emb.shape[0], 2048, tgen)
            loss = loss_fn(model(ids, vocab), local, val, w)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} {time.time() - t0:.0f} s", flush=True)
        acc = held_acc()
        print(f"epoch {epoch} done: held-out greedy agreement {acc:.3f}, {time.time() - t0:.0f} s", flush=True)
        if acc >= best:  # small data overfits: keep the epoch that generalises best
            best, best_state = acc, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)

    hf = Path(args.out_dir) / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    save_file(model.hf_state(), hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps(hf_config(emb.shape[0], model.sh), indent=1))
    print(f"wrote {hf}: {step} steps, {epoch} epochs, training {time.time() - t_train:.0f} s, "
          f"total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
