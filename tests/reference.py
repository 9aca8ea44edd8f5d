"""Numpy reference forward pass of an HF Llama/Mistral/Qwen2/Qwen3 checkpoint (float64), for checking conversions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ggufspec.convert.checkpoint import load_checkpoint


def rope_inv_freq(config: dict, head_dim: int) -> np.ndarray:
    """Rotary inverse frequencies as HF computes them, including Llama 3 and linear rope scaling."""
    base = float(config.get("rope_theta", 10000.0))
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = config.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    return inv


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def forward(model_dir: Path, tokens: list[int], config: dict | None = None) -> np.ndarray:
    """Logits [len(tokens), vocab] of the checkpoint in `model_dir` for one causal sequence (config: override)."""
    model_dir = Path(model_dir)
    cfg = config if config is not None else json.loads((model_dir / "config.json").read_text())
    refs = load_checkpoint(model_dir)

    def W(name: str) -> np.ndarray:
        return refs[name].load().astype(np.float64)

    def has(name: str) -> bool:
        return name in refs

    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    eps = cfg.get("rms_norm_eps", 1e-6)
    T = len(tokens)
    inv = rope_inv_freq(cfg, head_dim)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], axis=-1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], axis=-1))[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), k=1)

    x = W("model.embed_tokens.weight")[tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, W(p + "input_layernorm.weight"), eps)
        q, k, v = (h @ W(p + f"self_attn.{n}_proj.weight").T for n in "qkv")
        for n, t in (("q", q), ("k", k), ("v", v)):
            if has(p + f"self_attn.{n}_proj.bias"):
                t += W(p + f"self_attn.{n}_proj.bias")
        q = q.reshape(T, n_head, head_dim)
        k = k.reshape(T, n_kv, head_dim)
        v = v.reshape(T, n_kv, head_dim)
        if has(p + "self_attn.q_norm.weight"):
            q = _rms(q, W(p + "self_attn.q_norm.weight"), eps)
            k = _rms(k, W(p + "self_attn.k_norm.weight"), eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = n_head // n_kv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", scores, v).reshape(T, n_head * head_dim)
        x = x + attn @ W(p + "self_attn.o_proj.weight").T
        h = _rms(x, W(p + "post_attention_layernorm.weight"), eps)
        g = h @ W(p + "mlp.gate_proj.weight").T
        u = h @ W(p + "mlp.up_proj.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ W(p + "mlp.down_proj.weight").T
    x = _rms(x, W("model.norm.weight"), eps)
    tied = cfg.get("tie_word_embeddings", False) or not has("lm_head.weight")
    head = W("model.embed_tokens.weight") if tied else W("lm_head.weight")
    return x @ head.T
