#!/usr/bin/env python3
"""An MTP benchmark target, step 2 of 2 (step 1: mtp_data.py): train B's MTP block on B's own text, then widen B
with its block 4x (Net2Net, as make_hybrid_bench_pair.py: the same function at about 16x the cost) and quantize to
Q8_0. Needs torch (CPU).

The block is llama.cpp's qwen35 MTP block (src/models/qwen35.cpp, graph_mtp): at position p it reads token x_p's
embedding and B's hidden row at p - 1 (each RMS-normed), projects the pair to the model's width (`nextn.eh_proj`),
runs a full-attention layer and an MLP, norms (`nextn.shared_head_norm`) and scores with B's own output head: a guess
at x_{p+1}. Trained here: the projection, the MLP and the norms; the layer's attention output is zero (it is computed,
so the head costs what a real one does, but it adds nothing: its weights would need llama.cpp's rope reproduced). The
projection starts as "the token's embedding" ([I | 0]; B's picks lean on their last token), the rest at random.
Loss: cross-entropy of B's greedy pick at p + 1 over the whole vocabulary, plus the distance of the block's row to B's
row at p (so that a second guess, which llama.cpp and ggufspec draft from the block's own row, reads a row like the
ones it was trained on), and the same one step further (the chain: x_{p+1} with the block's own row).

    nice -n 19 python scripts/recipes/mtp_train.py OUT_DIR --minutes 13 --batch 96 [--factor 4]
Reads OUT_DIR/mtp-data.npz; writes OUT_DIR/mtp-base-mtp.f32.gguf (B with its block) and OUT_DIR/qwen35-mtp-x4.Q8_0.gguf.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts"), str(REPO / "scripts" / "recipes")]  # research scripts

from make_hybrid_bench_pair import _half, wide_config, widen  # noqa: E402
from mtp_data import base_config  # noqa: E402
from tiny_models import hybrid_weights, read_tokenizer, write_hybrid_gguf  # noqa: E402

EPS = 1e-5


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w


class Block(torch.nn.Module):
    """The MTP block without its attention (see the module's docstring); B's embedding and output head frozen."""

    def __init__(self, emb: np.ndarray, out: np.ndarray, n_ff: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        e = emb.shape[1]
        self.emb = torch.from_numpy(emb)
        self.out = torch.from_numpy(out)
        p = lambda t: torch.nn.Parameter(t)  # noqa: E731
        self.enorm, self.hnorm, self.post, self.head_norm = (p(torch.ones(e)) for _ in range(4))
        self.eh = p(torch.cat([torch.eye(e), torch.zeros(e, e)], 1) + 0.01 * torch.randn(e, 2 * e, generator=g))
        self.gate = p(torch.randn(n_ff, e, generator=g) / e ** 0.5)
        self.up = p(torch.randn(n_ff, e, generator=g) / e ** 0.5)
        self.down = p(0.1 * torch.randn(e, n_ff, generator=g) / n_ff ** 0.5)

    def row(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The block's row (after shared_head_norm) for tokens read with rows h."""
        z = torch.cat([rms(self.emb[tokens], self.enorm), rms(h, self.hnorm)], -1) @ self.eh.T
        y = rms(z, self.post)
        z = z + (F.silu(y @ self.gate.T) * (y @ self.up.T)) @ self.down.T
        return rms(z, self.head_norm)

    def tensors(self, layer: int, n_head: int, n_head_kv: int, seed: int) -> dict[str, np.ndarray]:
        """The block as GGUF tensors of layer `layer` (numpy (out, in)); attention random, its output zero."""
        e = self.eh.shape[0]
        hd = e // n_head
        rng = np.random.default_rng(seed)
        w = lambda *s: rng.normal(0, 1 / np.sqrt(e), size=s).astype(np.float32)  # noqa: E731
        f = lambda t: t.detach().numpy().astype(np.float32).copy()  # noqa: E731
        ones = lambda n: np.ones(n, np.float32)  # noqa: E731
        p = f"blk.{layer}."
        return {p + "attn_norm.weight": ones(e), p + "attn_q.weight": w(2 * n_head * hd, e),
                p + "attn_k.weight": w(n_head_kv * hd, e), p + "attn_v.weight": w(n_head_kv * hd, e),
                p + "attn_output.weight": np.zeros((e, n_head * hd), np.float32),
                p + "attn_q_norm.weight": ones(hd), p + "attn_k_norm.weight": ones(hd),
                p + "post_attention_norm.weight": f(self.post), p + "ffn_gate.weight": f(self.gate),
                p + "ffn_up.weight": f(self.up), p + "ffn_down.weight": f(self.down),
                p + "nextn.eh_proj.weight": f(self.eh), p + "nextn.enorm.weight": f(self.enorm),
                p + "nextn.hnorm.weight": f(self.hnorm), p + "nextn.shared_head_norm.weight": f(self.head_norm)}


def examples(d) -> tuple[np.ndarray, np.ndarray]:
    """Indexes p into the concatenated tokens where the block reads (x_p, B's row at p - 1) and guesses B's own pick
    x_{p+1}, and x_{p+2} after it (the chain's second step): per sequence, from its last prompt token on."""
    pos, seq_of = [], []
    off = 0
    for s, (plen, n) in enumerate(zip(d["plens"], d["lens"])):
        ps = np.arange(off + max(plen - 1, 1), off + n - 2)
        pos.append(ps)
        seq_of.append(np.full(len(ps), s))
        off += n
    return np.concatenate(pos), np.concatenate(seq_of)


def widen_with_block(cfg, weights: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """B and its block widened r times: eh_proj reads two residual-stream vectors side by side, each widened."""
    name = f"blk.{cfg.n_layer}.nextn.eh_proj.weight"
    eh = weights[name]
    out = widen(cfg, {k: v for k, v in weights.items() if k != name}, r)
    e = eh.shape[0]
    part = lambda m: np.tile(np.tile(m, (1, r)) / r, (r, 1))  # noqa: E731
    out[name] = np.concatenate([part(eh[:, :e]), part(eh[:, e:])], 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--row-weight", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    d = np.load(a.out_dir / "mtp-data.npz")
    cfg = base_config(float(d["trunk"]))
    tokenizer = read_tokenizer(a.tokenizer)
    n_vocab = len(next(f for f in tokenizer if f.name == "tokenizer.ggml.tokens").data)
    weights = hybrid_weights(cfg, n_vocab, int(d["seed"]))
    tokens = torch.from_numpy(d["tokens"].astype(np.int64))
    hidden = torch.from_numpy(d["hidden"].astype(np.float32))
    pos, seq_of = examples(d)
    held = seq_of % 10 == 0  # every 10th sequence held out
    train, test = pos[~held], pos[held]
    print(f"{len(train)} training and {len(test)} held-out positions ({time.time() - t0:.0f} s)", flush=True)
    block = Block(weights["token_embd.weight"], weights["output.weight"], cfg.n_ff, 0)
    opt = torch.optim.AdamW([q for q in block.parameters() if q.requires_grad], lr=a.lr, weight_decay=0.0)
    rng = np.random.default_rng(0)

    def losses(p: torch.Tensor):
        r1 = block.row(tokens[p], hidden[p - 1])
        r2 = block.row(tokens[p + 1], r1)
        l1, l2 = r1 @ block.out.T, r2 @ block.out.T
        ce = F.cross_entropy(l1, tokens[p + 1]) + 0.5 * F.cross_entropy(l2, tokens[p + 2])
        dist = ((r1 - hidden[p]) ** 2).mean() + 0.5 * ((r2 - hidden[p + 1]) ** 2).mean()
        return ce + a.row_weight * dist, l1, l2

    def evaluate() -> str:
        with torch.no_grad():
            p = torch.from_numpy(test)
            _, l1, l2 = losses(p)
            one = l1.argmax(1) == tokens[p + 1]
            two = one & (l2.argmax(1) == tokens[p + 2])
        return f"held out: first guess right {one.float().mean():.1%}, first two {two.float().mean():.1%}"

    print("before training, " + evaluate(), flush=True)
    deadline, step = time.time() + 60 * a.minutes, 0
    total = a.minutes * 60
    while time.time() < deadline:
        frac = 1 - (deadline - time.time()) / total
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, 10 * frac) * (1 - frac) ** 0.5
        p = torch.from_numpy(rng.choice(train, a.batch))
        loss, _, _ = losses(p)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 200 == 0:
            print(f"step {step}: loss {loss.item():.3f}, {time.time() - t0:.0f} s", flush=True)
    print(f"{step} steps; " + evaluate(), flush=True)

    tensors = block.tensors(cfg.n_layer, cfg.n_head, cfg.n_head_kv, 1)
    import dataclasses

    from ggufspec.convert.quantize import quantize

    mcfg = dataclasses.replace(cfg, mtp=True)
    base = write_hybrid_gguf(a.out_dir / "mtp-base-mtp.f32.gguf", tokenizer, weights | tensors, mcfg, "mtp-base-mtp")
    wcfg = dataclasses.replace(wide_config(cfg, a.factor), mtp=True)
    wide = write_hybrid_gguf(a.out_dir / f"qwen35-mtp-x{a.factor}.f16.gguf", tokenizer,
                             _half(widen_with_block(cfg, weights | tensors, a.factor)), wcfg, f"qwen35-mtp-x{a.factor}")
    target = a.out_dir / f"qwen35-mtp-x{a.factor}.Q8_0.gguf"
    quantize(wide, target, "q8_0", threads=a.threads)
    wide.unlink()
    print(f"wrote {base} and {target} in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
