"""Tiny llama-architecture GGUFs with random weights and SmolLM2's real vocabulary, written by gguf-py."""

from __future__ import annotations

from collections.abc import Callable
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


def noisy_copy(weights: dict[str, np.ndarray], seed: int = 1, scale: float = 0.1) -> dict[str, np.ndarray]:
    """The weights plus noise (`scale` of each matrix's spread; vectors kept): a draft that agrees with them often,
    not always."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, scale * v.std() if v.ndim > 1 else 0, v.shape)).astype(np.float32)
            for k, v in weights.items()}


def write_tiny_gguf(
    path: Path, tokenizer: list[gguf.ReaderField], weights: dict[str, np.ndarray], cfg: TinyConfig,
    name: str = "tiny", chat_template: str | None = None, add_bos: bool | None = None,
) -> Path:
    """Write a loadable llama GGUF with these weights and the copied tokenizer fields (`chat_template`: this one
    instead of the copied one; `add_bos`: whether the tokenizer asks for a BOS, instead of the copied answer)."""
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
    if add_bos is not None:
        tokenizer = [f for f in tokenizer if f.name != "tokenizer.ggml.add_bos_token"]
        w.add_add_bos_token(add_bos)
    return _finish(w, path, tokenizer, weights)


def _finish(w: gguf.GGUFWriter, path: Path, tokenizer: list[gguf.ReaderField], weights: dict[str, np.ndarray]) -> Path:
    """Add the tokenizer fields and the tensors to `w`, write it to `path` and close it."""
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


# --- hybrid and recurrent architectures -----------------------------------------------------------------------

QWEN35 = ("qwen35", "qwen35moe")  # Qwen3.5/3.6: dense, and mixture of experts


@dataclass(frozen=True)
class HybridConfig:
    """A tiny hybrid (lfm2: short convolutions; qwen35: gated delta nets; qwen35moe: the same with experts) or
    recurrent (mamba2) model: every `interval`-th layer attention, the others recurrent (mamba2: all recurrent). Head
    size 32, so llama.cpp's default q8_0 cache fits."""

    arch: str
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 2
    n_head_kv: int = 1
    n_ff: int = 128
    d_state: int = 16  # qwen35, mamba2
    d_conv: int = 4  # qwen35, mamba2 (lfm2: its l_cache is 3)
    n_group: int = 2  # qwen35's key heads, mamba2's groups
    dt_rank: int = 4  # qwen35's value heads, mamba2's heads
    interval: int = 2
    # qwen35: one MTP block (nextn) after the layers, as Qwen3.5 carries; `trunk` scales what each layer adds to the
    # residual stream (small: the target's pick is mostly a function of its last token, which the block then guesses
    # from its token's embedding), `mtp_mix` is how much of the target's hidden row the block reads beside it
    mtp: bool = False
    trunk: float = 1.0
    mtp_mix: float = 0.1
    # qwen35moe: each layer's MLP (the MTP block's too) n_expert routed experts of n_ff_exp, n_expert_used a token, and
    # a gated shared expert of n_ff, instead of the dense one (src/models/qwen35moe.cpp)
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 64

    @property
    def recurrent_layers(self) -> list[bool]:
        return [self.arch == "mamba2" or (i + 1) % self.interval != 0 for i in range(self.n_layer)]


def hybrid_weights(cfg: HybridConfig, n_vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random weights of a HybridConfig model, by GGUF tensor name (numpy row-major: (out, in))."""
    rng = np.random.default_rng(seed)
    e, hd, ff = cfg.n_embd, cfg.n_embd // cfg.n_head, cfg.n_ff
    s = 1 / np.sqrt(e)

    def w(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0, std, size=shape).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    t = {"token_embd.weight": w(n_vocab, e, std=1.0), "output.weight": w(n_vocab, e, std=1.0),
         "token_embd_norm.weight" if cfg.arch == "lfm2" else "output_norm.weight": ones(e)}
    key_dim, value_dim = cfg.d_state * cfg.n_group, cfg.d_state * cfg.dt_rank
    for i, recurrent in enumerate(cfg.recurrent_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ones(e)
        if cfg.arch != "mamba2":
            t |= mlp(cfg, p, w, 1 / np.sqrt(ff)) | {
                p + ("ffn_norm.weight" if cfg.arch == "lfm2" else "post_attention_norm.weight"): ones(e)}
        if not recurrent:
            q_rows = 2 * cfg.n_head * hd if cfg.arch != "lfm2" else e  # qwen35's query carries its gate
            t |= {p + "attn_q.weight": w(q_rows, e, std=s), p + "attn_k.weight": w(cfg.n_head_kv * hd, e, std=s),
                  p + "attn_v.weight": w(cfg.n_head_kv * hd, e, std=s), p + "attn_output.weight": w(e, e, std=s),
                  p + "attn_q_norm.weight": ones(hd), p + "attn_k_norm.weight": ones(hd)}
        elif cfg.arch == "lfm2":
            t |= {p + "shortconv.conv.weight": w(e, 3, std=0.5), p + "shortconv.in_proj.weight": w(3 * e, e, std=s),
                  p + "shortconv.out_proj.weight": w(e, e, std=s)}
        elif cfg.arch in QWEN35:
            conv = 2 * key_dim + value_dim
            t |= {p + "attn_qkv.weight": w(conv, e, std=s), p + "attn_gate.weight": w(value_dim, e, std=s),
                  p + "ssm_conv1d.weight": w(conv, cfg.d_conv, std=0.5), p + "ssm_dt.bias": w(cfg.dt_rank, std=0.5),
                  p + "ssm_a": -np.abs(w(cfg.dt_rank, std=1.0)), p + "ssm_beta.weight": w(cfg.dt_rank, e, std=s),
                  p + "ssm_alpha.weight": w(cfg.dt_rank, e, std=s), p + "ssm_norm.weight": ones(cfg.d_state),
                  p + "ssm_out.weight": w(e, value_dim, std=s)}
        else:  # mamba2: d_inner = 2 * n_embd, in heads of d_inner / dt_rank
            d_inner = 2 * e
            conv = d_inner + 2 * cfg.n_group * cfg.d_state
            t |= {p + "ssm_in.weight": w(d_inner + conv + cfg.dt_rank, e, std=s),
                  p + "ssm_conv1d.weight": w(conv, cfg.d_conv, std=0.5), p + "ssm_conv1d.bias": w(conv, std=0.1),
                  p + "ssm_dt.bias": w(cfg.dt_rank, std=0.5), p + "ssm_a": -np.abs(w(cfg.dt_rank, 1, std=1.0)),
                  p + "ssm_d": w(cfg.dt_rank, 1, std=1.0),
                  p + "ssm_norm.weight": np.ones((cfg.n_group, d_inner // cfg.n_group), np.float32),
                  p + "ssm_out.weight": w(e, d_inner, std=1 / np.sqrt(d_inner))}
    for name in t if cfg.trunk != 1.0 else ():
        if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                          "ssm_out.weight")):
            t[name] = t[name] * np.float32(cfg.trunk)
    return t | (mtp_block(cfg, rng) if cfg.mtp else {})


def mlp(cfg: HybridConfig, p: str, w: Callable[..., np.ndarray], down: float) -> dict[str, np.ndarray]:
    """Layer `p`'s MLP: dense (gate, up, down), or qwen35moe's routed experts and gated shared expert; `down`: the
    down projection's scale."""
    e, ff = cfg.n_embd, cfg.n_ff
    s = 1 / np.sqrt(e)
    if cfg.arch != "qwen35moe":
        return {p + "ffn_gate.weight": w(ff, e, std=s), p + "ffn_up.weight": w(ff, e, std=s),
                p + "ffn_down.weight": w(e, ff, std=down)}
    n, fe = cfg.n_expert, cfg.n_ff_exp
    return {p + "ffn_gate_inp.weight": w(n, e, std=s), p + "ffn_gate_exps.weight": w(n, fe, e, std=s),
            p + "ffn_up_exps.weight": w(n, fe, e, std=s), p + "ffn_down_exps.weight": w(n, e, fe, std=down),
            p + "ffn_gate_inp_shexp.weight": w(e, std=s), p + "ffn_gate_shexp.weight": w(ff, e, std=s),
            p + "ffn_up_shexp.weight": w(ff, e, std=s), p + "ffn_down_shexp.weight": w(e, ff, std=down)}


def mtp_block(cfg: HybridConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """qwen35's MTP block (llama.cpp's load_block_mtp: a full-attention layer and the nextn tensors) as layer n_layer:
    its projection reads the token's embedding (1 - mtp_mix) and the target's hidden row (mtp_mix), and its attention
    and MLP add little, so its logits are mostly the target's output head on its token's embedding."""
    e, hd, ff, mix = cfg.n_embd, cfg.n_embd // cfg.n_head, cfg.n_ff, cfg.mtp_mix
    s, p = 1 / np.sqrt(e), f"blk.{cfg.n_layer}."

    def w(*shape: int, std: float) -> np.ndarray:
        return rng.normal(0, std, size=shape).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    eye = np.eye(e, dtype=np.float32)
    return {p + "attn_norm.weight": ones(e), p + "post_attention_norm.weight": ones(e),
            p + "attn_q.weight": w(2 * cfg.n_head * hd, e, std=s), p + "attn_k.weight": w(cfg.n_head_kv * hd, e, std=s),
            p + "attn_v.weight": w(cfg.n_head_kv * hd, e, std=s), p + "attn_output.weight": w(e, e, std=0.1 * s),
            p + "attn_q_norm.weight": ones(hd), p + "attn_k_norm.weight": ones(hd),
            **mlp(cfg, p, w, 0.1 / np.sqrt(ff)),
            p + "nextn.eh_proj.weight": np.concatenate([(1 - mix) * eye, mix * eye], 1) + w(e, 2 * e, std=0.002),
            p + "nextn.enorm.weight": ones(e), p + "nextn.hnorm.weight": ones(e),
            p + "nextn.shared_head_norm.weight": ones(e)}


def write_hybrid_gguf(path: Path, tokenizer: list[gguf.ReaderField], weights: dict[str, np.ndarray],
                      cfg: HybridConfig, name: str = "tiny") -> Path:
    """Write a loadable GGUF of a HybridConfig model with these weights and the copied tokenizer fields."""
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name(name)
    w.add_context_length(2048)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer + cfg.mtp)
    w.add_layer_norm_rms_eps(1e-5)
    if cfg.mtp:
        w.add_uint32(f"{cfg.arch}.nextn_predict_layers", 1)
    hd = cfg.n_embd // cfg.n_head
    if cfg.arch == "lfm2":  # a layer with no KV heads is a convolution
        w.add_feed_forward_length(cfg.n_ff)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv([0 if r else cfg.n_head_kv for r in cfg.recurrent_layers])
        w.add_uint32("lfm2.shortconv.l_cache", 3)
        w.add_key_length(hd)
        w.add_value_length(hd)
    else:
        ssm = {"conv_kernel": cfg.d_conv, "state_size": cfg.d_state, "group_count": cfg.n_group,
               "time_step_rank": cfg.dt_rank}
        if cfg.arch in QWEN35:
            w.add_feed_forward_length(cfg.n_ff)
            w.add_head_count(cfg.n_head)
            w.add_head_count_kv(cfg.n_head_kv)
            w.add_uint32(f"{cfg.arch}.full_attention_interval", cfg.interval)
            w.add_array(f"{cfg.arch}.rope.dimension_sections", [hd // 8] * 4)
            ssm["inner_size"] = cfg.d_state * cfg.dt_rank
            if cfg.arch == "qwen35moe":
                w.add_expert_count(cfg.n_expert)
                w.add_expert_used_count(cfg.n_expert_used)
                w.add_expert_feed_forward_length(cfg.n_ff_exp)
                w.add_expert_shared_feed_forward_length(cfg.n_ff)
        else:
            ssm["inner_size"] = 2 * cfg.n_embd
        for key, value in ssm.items():
            w.add_uint32(f"{cfg.arch}.ssm.{key}", value)
    w.add_rope_dimension_count(hd)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return _finish(w, path, tokenizer, weights)
