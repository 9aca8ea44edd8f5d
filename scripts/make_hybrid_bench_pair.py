#!/usr/bin/env python3
"""A cost-realistic hybrid benchmark pair: a Qwen3.5-architecture (`qwen35`: gated delta nets and attention) target
that behaves like a small model and costs like a large one, and a draft that agrees with it most of the time.

No small hybrid model can be downloaded here, so the pair is made, as ../shared/tools/widen_gguf.py makes the llama
one: a random qwen35 model B with SmolLM2's vocabulary; the target is B widened R times (Net2Net: the residual stream,
the attention and delta-net heads and the FFN units repeated R times, the matrices that read them divided by R: the
same function at about R^2 the cost), quantized to Q8_0; the draft is B plus noise (--noise of each matrix's spread),
Q8_0. B's key and value heads are as many, so repeating heads keeps each value head on its key head. (A random model
is not as robust as a trained one: quantized to Q4_0, the target kept B's own greedy guesses 10% of the time, at Q8_0
63-86%.)

Usage: make_hybrid_bench_pair.py OUT_DIR [--tokenizer SmolLM2.gguf] [--factor 4] [--noise 0.02] [--check]
Writes OUT_DIR/qwen35-bench-x{R}.Q8_0.gguf and OUT_DIR/qwen35-bench-draft.Q8_0.gguf (and B, f32); --check compares
B's logits with the widened (f16) target's before quantizing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model writers (research script: not installed)

from tiny_models import HybridConfig, hybrid_weights, noisy_copy, read_tokenizer, write_hybrid_gguf  # noqa: E402

# B: 12 layers, every 4th attention (as Qwen3.5), 384 wide; delta-net heads of 128 (Qwen3.5's), 3 key and 3 value heads
BASE = HybridConfig("qwen35", n_embd=384, n_layer=12, n_head=6, n_head_kv=2, n_ff=1024, d_state=128, d_conv=4,
                    n_group=3, dt_rank=3, interval=4)
PER_HEAD = ("attn_q_norm", "attn_k_norm", "ssm_norm")  # vectors over one head's dimensions: as they are


def widen(cfg: HybridConfig, weights: dict[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """B's weights widened r times (same function: see the module's docstring)."""
    key_dim = cfg.d_state * cfg.n_group  # attn_qkv's rows: queries and keys (key_dim each), then values
    out = {}
    for name, w in weights.items():
        kind = name.split(".")[-2] if name.count(".") >= 2 else name.split(".")[0]
        if kind in PER_HEAD:
            out[name] = w
        elif kind in ("ssm_dt", "ssm_a"):  # one value per delta-net head
            out[name] = np.tile(w, r)
        elif w.ndim == 1:  # norms over the residual stream
            out[name] = np.tile(w, r)
        elif kind == "token_embd":
            out[name] = np.tile(w, (1, r))
        elif kind in ("attn_qkv", "ssm_conv1d"):  # rows (channels) in three parts, each of heads: each repeated
            parts = np.split(w, [key_dim, 2 * key_dim])
            w = np.concatenate([np.tile(p, (r, 1)) for p in parts])
            out[name] = np.tile(w, (1, r)) / r if kind == "attn_qkv" else w
        elif kind == "output":  # reads the residual stream, writes the vocabulary
            out[name] = np.tile(w, (1, r)) / r
        else:  # reads the residual stream or repeated units (divided by r), writes repeated rows
            out[name] = np.tile(np.tile(w, (1, r)) / r, (r, 1))
    return out


def _half(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Matrices in float16 (the widened target's f32 file would take 2 GB on its way to Q4_0); vectors and the
    convolutions' kernels (which llama.cpp reads as f32) as they are."""
    return {k: w.astype(np.float16) if w.ndim > 1 and "conv1d" not in k else w for k, w in weights.items()}


def wide_config(cfg: HybridConfig, r: int) -> HybridConfig:
    return HybridConfig(cfg.arch, n_embd=cfg.n_embd * r, n_layer=cfg.n_layer, n_head=cfg.n_head * r,
                        n_head_kv=cfg.n_head_kv * r, n_ff=cfg.n_ff * r, d_state=cfg.d_state, d_conv=cfg.d_conv,
                        n_group=cfg.n_group * r, dt_rank=cfg.dt_rank * r, interval=cfg.interval)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--target-type", default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    from ggufspec.convert.quantize import quantize

    a.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = read_tokenizer(a.tokenizer)
    n_vocab = len(next(f for f in tokenizer if f.name == "tokenizer.ggml.tokens").data)
    base = hybrid_weights(BASE, n_vocab, a.seed)
    b_path = write_hybrid_gguf(a.out_dir / "qwen35-bench-base.f32.gguf", tokenizer, base, BASE, "qwen35-bench-base")
    wide_cfg = wide_config(BASE, a.factor)
    wide = write_hybrid_gguf(a.out_dir / f"qwen35-bench-x{a.factor}.f16.gguf", tokenizer,
                             _half(widen(BASE, base, a.factor)), wide_cfg, f"qwen35-bench-x{a.factor}")
    if a.check:
        check(b_path, wide)
    draft = write_hybrid_gguf(a.out_dir / "qwen35-bench-draft.f32.gguf", tokenizer,
                              noisy_copy(base, seed=a.seed + 1, scale=a.noise), BASE, "qwen35-bench-draft")
    target = a.out_dir / f"qwen35-bench-x{a.factor}.{a.target_type.upper()}.gguf"
    quantize(wide, target, a.target_type, threads=2)
    quantize(draft, a.out_dir / "qwen35-bench-draft.Q8_0.gguf", "q8_0", threads=2)
    for p in (wide, draft):
        p.unlink()
    print(target, a.out_dir / "qwen35-bench-draft.Q8_0.gguf")
    return 0


def check(base: Path, wide: Path) -> None:
    """B and its widening give the same logits (f32, up to rounding)."""
    from ggufspec.decoder import DecoderOptions, LlamaCppDecoder

    tokens = list(range(1000, 1040))
    rows = []
    for path in (base, wide):
        with LlamaCppDecoder(path, DecoderOptions(n_ctx=256, kv_type="f16")) as d:
            rows.append(d.feed(tokens))
    off = float(np.abs(rows[0] - rows[1]).max())
    same = float((rows[0].argmax(-1) == rows[1].argmax(-1)).mean())
    print(f"widened vs base: logits off by at most {off:.2e} (spread {rows[0].std():.1f}), argmax equal {same:.0%}")


if __name__ == "__main__":
    sys.exit(main())
