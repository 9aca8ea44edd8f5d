"""Helpers that write tiny but real HF checkpoints (config.json, safetensors, tokenizer files) for converter tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we're testing tokenizers!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Héllo wörld — naïve café, Ελληνικά, русский текст, 日本語のテキスト, 中文文本, emoji 🙂🚀.",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * 3.14159); }",
    "Numbers: 1234567890, 3.5, 42, 1e-9, 0x1F; tabs\tand    spaces\n\n\nnew lines.",
    "I'll say you've seen they'd done it; we'll see. SHOUTING and CamelCaseWords snake_case_words.",
] * 3

# The mixed corpus tokenization is checked on: code, Unicode, whitespace runs, digits, special tokens.
TOKENIZER_CORPUS = [
    "Hello world",
    " leading space and trailing space ",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass",
    "if (x != 0 && y >= 12) { z = x << 3; } // comment",
    "    four spaces, then\t\ttwo tabs, then\n\n\n three newlines",
    "Digits 1234567890 and 3.14159 and 1,000,000 and 007",
    "Unicode: naïve café, Ελληνικά, русский, 日本語, 中文, العربية, हिन्दी, 한국어",
    "Emoji 🙂🚀👍🏽 and symbols ©®™ ∑∫√ ≠ ≤ ≥ « » “quotes” ‘single’",
    "Contractions: I'm, you're, he's, they'd, we'll, I've, DON'T, It'S",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "mixed<|endoftext|>special tokens <|im_end|>inside text",
    "   ",
    "\n",
    "a",
    "ZWJ: 👨‍👩‍👧 and combining é",
    "https://example.com/path?query=1&b=2#frag user@example.org",
    "\u00a0non-breaking\u2003em space\u3000ideographic space",
]


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(a: np.ndarray) -> np.ndarray:
    return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    """Minimal safetensors writer (the safetensors package cannot write bfloat16 from numpy)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    off = 0
    for name, arr in tensors.items():
        if dtype == "BF16" and arr.dtype.kind == "f":
            raw, dt = bf16_bits(arr).tobytes(), "BF16"
        elif dtype == "F16" and arr.dtype.kind == "f":
            raw, dt = arr.astype("<f2").tobytes(), "F16"
        else:
            raw, dt = arr.astype("<f4").tobytes(), "F32"
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def stored_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a reader gets back after writing `arr` as `dtype`."""
    if dtype == "BF16":
        return bf16_round(arr)
    if dtype == "F16":
        return arr.astype(np.float16).astype(np.float32)
    return arr.astype(np.float32)


def train_bpe_tokenizer(folder: Path, pre: str = "smollm", vocab_size: int = 400) -> int:
    """Train a byte-level BPE tokenizer.json with the given pre-tokenizer style; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=(pre == "llama3")))
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    elif pre in ("llama3", "qwen2"):
        regex = LLAMA3_REGEX if pre == "llama3" else QWEN2_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        raise ValueError(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False}
            for i, s in enumerate(SPECIALS)
        },
    }))
    return tok.get_vocab_size()


def bpe_from_gguf(folder: Path, gguf_path: Path, pre: str = "smollm") -> int:
    """Write a tokenizer.json with the real vocabulary and merges of an existing byte-level BPE GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    m = r.fields["tokenizer.ggml.merges"]
    merges = [bytes(m.parts[i]).decode("utf-8").split(" ", 1) for i in m.data]
    t = r.fields["tokenizer.ggml.token_type"]
    types = [int(t.parts[i][0]) for i in t.data]
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, (tok, ty) in enumerate(zip(tokens, types)) if ty == 3
    ]
    if pre == "smollm":
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    else:
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)}, "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))
    return len(tokens)


def train_spm_tokenizer(folder: Path, vocab_size: int = 400) -> int:
    """Train a Llama-style SentencePiece BPE tokenizer.model (byte fallback, identity normalization)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT * 5), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, hard_vocab_limit=False,
    )
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
    }))
    return spm.SentencePieceProcessor(model_proto=buf.getvalue()).vocab_size()


ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_tiny_model(
    folder: Path, arch: str, vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
    ffn: int = 96, head_dim: int | None = None, tied: bool = False, rope_scaling: dict | None = None,
    dtype: str = "F32", shards: int = 1, seed: int = 0, rope_theta: float = 10000.0,
) -> dict:
    """Random-weight checkpoint of `arch` (llama|mistral|qwen2|qwen3) in `folder`; returns its config."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = head_dim or hidden // heads

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, hidden)).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = mat(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = mat(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = mat(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, heads * hd)
        if arch == "qwen2":
            for n, rows in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
                t[p + f"self_attn.{n}_proj.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "mlp.gate_proj.weight"] = mat(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = mat(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = mat(hidden, ffn)
    t["model.norm.weight"] = norm(hidden)
    if not tied:
        t["lm_head.weight"] = mat(vocab_size, hidden)

    cfg = {
        "architectures": [ARCH_NAMES[arch]], "model_type": arch, "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta, "tie_word_embeddings": tied, "hidden_act": "silu",
        "torch_dtype": {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype],
    }
    if head_dim:
        cfg["head_dim"] = head_dim
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))

    names = list(t)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", t, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t[n] for n in names[s::shards]}
            write_safetensors(folder / fname, part, dtype)
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return cfg


def spm_tokenizer_json(folder: Path) -> None:
    """Write the tokenizer.json HF ships beside a Llama-style tokenizer.model (BPE with byte fallback).

    Merges are every split of every piece into two pieces, ranked by the merged piece's score, which is the
    order SentencePiece's BPE merges in.
    """
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    ranked = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                ranked.append((-sp.get_score(pid), pid, vocab[a], vocab[b], a, b))
    merges = [[a, b] for *_, a, b in sorted(ranked)]
    specials = [{"id": i, "content": sp.id_to_piece(i), "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for i in range(sp.vocab_size()) if sp.is_control(i) or sp.is_unknown(i)]
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": specials,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))


def write_medusa(folder: Path, *, heads: int, layers: int, hidden: int, vocab: int, version: int = 1,
                 config_heads: int | None = None, seed: int = 0, fmt: str = "safetensors") -> dict[str, np.ndarray]:
    """A FasterDecoding-format Medusa head set; returns its tensors. config_heads can misstate the head count."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}
    for i in range(heads):
        for j in range(layers):
            t[f"{i}.{j}.linear.weight"] = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
            t[f"{i}.{j}.linear.bias"] = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
        if version == 1:
            t[f"{i}.{layers}.weight"] = (rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)).astype(np.float32)
    if fmt == "safetensors":
        write_safetensors(folder / "medusa_lm_head.safetensors", t)
    else:
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in t.items()}, folder / "medusa_lm_head.pt")
    cfg = {"medusa_num_heads": config_heads or heads, "medusa_num_layers": layers,
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "hidden_size": hidden, "vocab_size": vocab}
    if version == 2:
        cfg["version"] = "2"
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


def medusa_reference(t: dict[str, np.ndarray], h: np.ndarray, heads: int, layers: int,
                     base_lm_head: np.ndarray | None = None) -> list[np.ndarray]:
    """Each head's logits straight from the source tensors, in float64."""
    outs = []
    for i in range(heads):
        x = h.astype(np.float64)
        for j in range(layers):
            z = x @ t[f"{i}.{j}.linear.weight"].astype(np.float64).T + t[f"{i}.{j}.linear.bias"]
            x = x + z / (1 + np.exp(-z))
        lm = t.get(f"{i}.{layers}.weight", base_lm_head)
        outs.append(x @ lm.astype(np.float64).T)
    return outs
