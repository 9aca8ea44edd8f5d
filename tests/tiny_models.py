"""Tiny llama-architecture GGUFs with random weights and SmolLM2's real vocabulary, written by gguf-py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class TinyConfig:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 2048
    logit_scale: float = 1.0  # output weights ~ N(0, scale^2): logits spread wide, few near-ties


def read_tokenizer(source: Path) -> list[gguf.ReaderField]:
    """The tokenizer.* fields of a real GGUF (parsed once; GGUFReader is slow on big vocabularies)."""
    reader = gguf.GGUFReader(source)
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def random_weights(cfg: TinyConfig, n_vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Weights by GGUF tensor name, numpy row-major (out, in)."""
    rng = np.random.default_rng(seed)
    hd = cfg.n_embd // cfg.n_head

    def w(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0, std, size=shape).astype(np.float32)

    e = cfg.n_embd
    t = {
        "token_embd.weight": w(n_vocab, e, std=1.0),
        "output_norm.weight": np.ones(e, np.float32),
        "output.weight": w(n_vocab, e, std=cfg.logit_scale),
    }
    for i in range(cfg.n_layer):
        s = 1 / np.sqrt(e)
        t |= {
            f"blk.{i}.attn_norm.weight": np.ones(e, np.float32),
            f"blk.{i}.attn_q.weight": w(e, e, std=s),
            f"blk.{i}.attn_k.weight": w(cfg.n_head_kv * hd, e, std=s),
            f"blk.{i}.attn_v.weight": w(cfg.n_head_kv * hd, e, std=s),
            f"blk.{i}.attn_output.weight": w(e, e, std=s),
            f"blk.{i}.ffn_norm.weight": np.ones(e, np.float32),
            f"blk.{i}.ffn_gate.weight": w(cfg.n_ff, e, std=s),
            f"blk.{i}.ffn_up.weight": w(cfg.n_ff, e, std=s),
            f"blk.{i}.ffn_down.weight": w(e, cfg.n_ff, std=1 / np.sqrt(cfg.n_ff)),
        }
    return t


def noisy_copy(weights: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """The weights plus noise (10% of each matrix's spread; norms kept): a draft that agrees with them often, not
    always."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.1 * v.std() if v.ndim > 1 else 0, v.shape)).astype(np.float32)
            for k, v in weights.items()}


def write_tiny_gguf(
    path: Path, tokenizer: list[gguf.ReaderField], weights: dict[str, np.ndarray], cfg: TinyConfig,
    name: str = "tiny", chat_template: str | None = None,
) -> Path:
    """Write a loadable llama GGUF with these weights and the copied tokenizer fields (`chat_template`: this one
    instead of the copied one)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if chat_template is not None:
        tokenizer = [f for f in tokenizer if f.name != "tokenizer.chat_template"]
        w.add_chat_template(chat_template)
    for f in tokenizer:
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    for tname, arr in weights.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
