"""HF checkpoint folder (Llama, Mistral, Qwen2, Qwen3) -> GGUF that llama.cpp runs, streamed tensor by tensor."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, GGUFWriter, RopeScalingType, get_tensor_name_map

from ggufspec.convert.checkpoint import TensorRef, checkpoint_files, load_checkpoint
from ggufspec.convert.vocab import VocabData, load_gguf_vocab, load_hf_vocab
from ggufspec.outputs import refuse_overwriting_inputs
from ggufspec.gguf_write import OUT_TYPES, PlannedTensor, storage_type, write_gguf
from ggufspec.errors import ConversionError, ModelFileError

# HF architecture -> (GGUF architecture, whether Q/K rows must be permuted from HF's rotate-half layout
# to the interleaved pairs llama.cpp's "llama" rope expects; qwen2/qwen3 use NEOX rope, i.e. HF's layout)
ARCHITECTURES: dict[str, tuple[MODEL_ARCH, bool]] = {
    "LlamaForCausalLM": (MODEL_ARCH.LLAMA, True),
    "MistralForCausalLM": (MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": (MODEL_ARCH.QWEN2, False),
    "Qwen3ForCausalLM": (MODEL_ARCH.QWEN3, False),
}

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Files of an HF folder besides the weights that the conversion (or gguf.SpecialVocab, for special tokens, merges
# and the chat template) may read: none of them may be the output.
SIDE_FILES = (
    "config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer.json",
    "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "generation_config.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja",
)


@dataclass
class HParams:
    """The config.json values the conversion needs."""

    arch_hf: str
    arch: MODEL_ARCH
    permute_qk: bool
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    explicit_head_dim: bool
    ctx: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None
    tied: bool
    raw: dict = field(repr=False, default_factory=dict)


@dataclass
class ConversionReport:
    """What a conversion did: output, sizes, time, and tensors stored in another type than asked."""

    out: Path
    n_tensors: int
    source_bytes: int
    out_bytes: int
    seconds: float
    fallbacks: list[str]


def read_config(model_dir: Path) -> HParams:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{path}: missing; an HF model folder needs its config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from e
    archs = cfg.get("architectures") or []
    arch_hf = next((a for a in archs if a in ARCHITECTURES), None)
    if arch_hf is None:
        raise ConversionError(
            f"{path}: architecture {archs or '(none given)'} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    arch, permute = ARCHITECTURES[arch_hf]
    try:
        n_head = int(cfg["num_attention_heads"])
        n_embd = int(cfg["hidden_size"])
        hp = HParams(
            arch_hf=arch_hf, arch=arch, permute_qk=permute,
            n_vocab=int(cfg["vocab_size"]), n_embd=n_embd, n_layer=int(cfg["num_hidden_layers"]),
            n_ff=int(cfg["intermediate_size"]), n_head=n_head,
            n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or n_embd // n_head), explicit_head_dim=bool(cfg.get("head_dim")),
            ctx=int(cfg.get("max_position_embeddings", 4096)),
            eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"), tied=bool(cfg.get("tie_word_embeddings", False)), raw=cfg,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: missing or invalid hyperparameter {e}") from e
    if hp.n_head % hp.n_head_kv:
        raise ModelFileError(f"{path}: num_attention_heads {hp.n_head} is not a multiple of num_key_value_heads {hp.n_head_kv}")
    return hp


def llama3_rope_factors(hp: HParams) -> np.ndarray:
    """Per-frequency divisors llama.cpp applies (tensor rope_freqs) to reproduce Llama 3.x rope scaling."""
    rs = hp.rope_scaling or {}
    factor = float(rs["factor"])
    lo, hi = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    inv = 1.0 / hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    wavelen = 2 * math.pi / inv
    out = np.ones_like(inv)
    out[wavelen > old_ctx / lo] = factor
    mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    smooth = (old_ctx / wavelen[mid] - lo) / (hi - lo)
    out[mid] = 1.0 / ((1 - smooth) / factor + smooth)
    return out.astype(np.float32)


def _rope_kind(hp: HParams) -> str | None:
    rs = hp.rope_scaling
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3" and hp.arch != MODEL_ARCH.LLAMA:
        raise ConversionError(f"rope_scaling type llama3 is only supported for Llama-architecture models, not {hp.arch_hf}")
    if kind not in ("llama3", "linear", "yarn"):
        raise ConversionError(f"config.json: rope_scaling type {kind!r} is not supported (supported: llama3, linear, yarn)")
    return kind


def add_hparams(w: GGUFWriter, hp: HParams, name: str, file_type: int) -> None:
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(2)
    w.add_vocab_size(hp.n_vocab)
    w.add_context_length(hp.ctx)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_layer_norm_rms_eps(hp.eps)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_rope_dimension_count(hp.head_dim)
    if hp.explicit_head_dim or hp.head_dim * hp.n_head != hp.n_embd:
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
    kind = _rope_kind(hp)
    rs = hp.rope_scaling or {}
    if kind == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rs.get("original_max_position_embeddings", hp.ctx)))


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from HF's halves layout (x0..x_{d/2-1}, y0..) to interleaved pairs (x0, y0, x1, y1, ...)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(hp: HParams) -> dict[MODEL_TENSOR, tuple[int, ...]]:
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    return {
        MODEL_TENSOR.TOKEN_EMBD: (hp.n_vocab, hp.n_embd),
        MODEL_TENSOR.OUTPUT: (hp.n_vocab, hp.n_embd),
        MODEL_TENSOR.OUTPUT_NORM: (hp.n_embd,),
        MODEL_TENSOR.ATTN_NORM: (hp.n_embd,),
        MODEL_TENSOR.ATTN_Q: (q, hp.n_embd),
        MODEL_TENSOR.ATTN_K: (kv, hp.n_embd),
        MODEL_TENSOR.ATTN_V: (kv, hp.n_embd),
        MODEL_TENSOR.ATTN_OUT: (hp.n_embd, q),
        MODEL_TENSOR.ATTN_Q_NORM: (hp.head_dim,),
        MODEL_TENSOR.ATTN_K_NORM: (hp.head_dim,),
        MODEL_TENSOR.FFN_NORM: (hp.n_embd,),
        MODEL_TENSOR.FFN_GATE: (hp.n_ff, hp.n_embd),
        MODEL_TENSOR.FFN_UP: (hp.n_ff, hp.n_embd),
        MODEL_TENSOR.FFN_DOWN: (hp.n_embd, hp.n_ff),
    }


def _required(hp: HParams) -> list[MODEL_TENSOR]:
    per_layer = [MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V,
                 MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP,
                 MODEL_TENSOR.FFN_DOWN]
    if hp.arch == MODEL_ARCH.QWEN3:
        per_layer += [MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM]
    return per_layer


def plan_tensors(hp: HParams, refs: dict[str, TensorRef], outtype: str, model_dir: Path) -> list[PlannedTensor]:
    """Map, check and order every checkpoint tensor; nothing is read yet."""
    names = get_tensor_name_map(hp.arch, hp.n_layer)
    shapes = expected_shapes(hp)
    plan: list[PlannedTensor] = []
    seen: set[str] = set()
    for hf_name, ref in refs.items():
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and hp.tied:
            continue  # HF ties it to the embedding when the config says so; llama.cpp does the same without output.weight
        found = names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise ConversionError(
                f"{ref.file}: tensor {hf_name!r} is not part of a {hp.arch_hf} model this converter knows; "
                "the checkpoint may be a different architecture or carry extra modules"
            )
        kind, gguf_name = found
        want = shapes.get(kind)
        if gguf_name.endswith(".bias"):
            want = want[:1] if want else None
        if want is not None and tuple(ref.shape) != want:
            raise ConversionError(
                f"{ref.file}: tensor {hf_name!r} has shape {list(ref.shape)} but config.json implies {list(want)}; "
                "the weights and config.json do not belong together"
            )
        transform: Callable[[np.ndarray], np.ndarray] | None = None
        if hp.permute_qk and kind in (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K):
            heads = hp.n_head if kind == MODEL_TENSOR.ATTN_Q else hp.n_head_kv
            transform = lambda a, h=heads: permute_rotary(a, h)  # noqa: E731
        qtype, note = storage_type(tuple(ref.shape), outtype)
        load = (lambda r=ref, f=transform: f(r.load()) if f else r.load())
        plan.append(PlannedTensor(gguf_name, tuple(ref.shape), qtype, load, ref.nbytes, note and f"{gguf_name}: {note}"))
        seen.add(gguf_name)

    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in seen]
    for bid in range(hp.n_layer):
        for kind in _required(hp):
            n = names.get_name(_hf_stub(kind, bid) + ".weight", try_suffixes=(".weight",)) or ""
            if n and n not in seen:
                missing.append(n)
    if "output.weight" not in seen and not hp.tied:
        raise ConversionError(
            f"{model_dir}: lm_head.weight is missing and config.json does not set tie_word_embeddings: true; "
            "the checkpoint is incomplete"
        )
    if missing:
        raise ConversionError(f"{model_dir}: checkpoint lacks tensors {', '.join(missing[:8])}"
                              f"{' ...' if len(missing) > 8 else ''}; the download is incomplete or the config wrong")

    if _rope_kind(hp) == "llama3":
        factors = llama3_rope_factors(hp)
        plan.append(PlannedTensor("rope_freqs.weight", factors.shape, storage_type(factors.shape, "f32")[0], lambda: factors))

    def order(t: PlannedTensor) -> tuple[int, int, str]:
        parts = t.name.split(".")
        return (1, int(parts[1]), t.name) if parts[0] == "blk" else (0 if t.name.startswith("token_embd") else 2, 0, t.name)

    return sorted(plan, key=order)


_HF_STUBS = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm", MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj", MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj", MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "mlp.gate_proj", MODEL_TENSOR.FFN_UP: "mlp.up_proj", MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
    MODEL_TENSOR.ATTN_Q_NORM: "self_attn.q_norm", MODEL_TENSOR.ATTN_K_NORM: "self_attn.k_norm",
}


def _hf_stub(kind: MODEL_TENSOR, bid: int) -> str:
    return f"model.layers.{bid}.{_HF_STUBS[kind]}"


def input_files(model_dir: Path, vocab_from: Path | None = None) -> list[Path]:
    """Every file `convert_hf` may read: the weight files, the folder's config and tokenizer files, `vocab_from`.

    The weights are listed as `checkpoint_files` finds them; when it cannot (no weights), every file that looks
    like weights is listed instead, so the check still covers them and the conversion reports the real problem.
    """
    model_dir = Path(model_dir)
    try:
        weights = checkpoint_files(model_dir)
    except ModelFileError:
        weights = [*model_dir.glob("*.safetensors"), *model_dir.glob("*.bin"), *model_dir.glob("*.pt")]
    extra = [vocab_from] if vocab_from is not None else []
    return [*weights, *(model_dir / n for n in SIDE_FILES), *extra]


def convert_hf(
    model_dir: Path,
    out: Path,
    outtype: str = "f16",
    vocab_from: Path | None = None,
    tokenizer_pre: str | None = None,
    name: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> ConversionReport:
    """Convert the HF model folder `model_dir` to the GGUF file `out`.

    `out` must not be, or link to, any file the conversion reads (`input_files`): that is refused before anything
    is read or written. The output is written atomically (`write_gguf`).
    """
    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise ModelFileError(f"{model_dir}: not a folder; give the folder holding config.json and the weights")
    refuse_overwriting_inputs(out, input_files(model_dir, vocab_from))
    if outtype not in OUT_TYPES:
        raise ConversionError(f"unknown output type {outtype!r}; choose one of {', '.join(OUT_TYPES)}")
    hp = read_config(model_dir)
    refs = load_checkpoint(model_dir)
    plan = plan_tensors(hp, refs, outtype, model_dir)
    vocab: VocabData = load_gguf_vocab(vocab_from) if vocab_from else load_hf_vocab(model_dir, tokenizer_pre)
    if vocab.size > hp.n_vocab:
        raise ConversionError(
            f"{vocab.source}: tokenizer has {vocab.size} tokens but the model's embedding has only {hp.n_vocab} rows"
        )
    vocab.pad_to(hp.n_vocab)

    file_type = int(OUT_TYPES[outtype][1])
    model_name = name or model_dir.resolve().name

    def metadata(w: GGUFWriter) -> None:
        add_hparams(w, hp, model_name, file_type)
        vocab.write(w)

    start = time.perf_counter()
    write_gguf(out, MODEL_ARCH_NAMES[hp.arch], metadata, plan, progress)
    return ConversionReport(
        out=out, n_tensors=len(plan), source_bytes=sum(t.source_bytes for t in plan), out_bytes=out.stat().st_size,
        seconds=time.perf_counter() - start, fallbacks=[t.note for t in plan if t.note],
    )
