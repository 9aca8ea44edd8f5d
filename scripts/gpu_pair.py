#!/usr/bin/env python3
"""The GPU check's benchmark pair, made where it runs from a small llama-architecture GGUF carried along.

    python scripts/gpu_pair.py SRC.gguf OUT.gguf --widen 8 --deepen 5 --tools DIR [--draft-out D.gguf --noise 0.1]

The target computes SRC's function at a large model's cost: every weight matrix widened `--widen` times as
../shared/tools/widen_gguf.py does (its `widen`, imported from --tools), and each layer followed by `--deepen - 1`
copies of itself whose output projections (attn_output, ffn_down) are zero, so they add nothing to the residual
stream but cost a real layer's reads and kernels. The draft is SRC itself, or with --draft-out a copy of SRC with
Gaussian noise of --noise times each matrix's spread added (as scripts/make_hybrid_bench_pair.py makes its draft),
Q8_0: SRC alone agrees with its widened copy on nearly every greedy token, which no real draft does.

Why not the bench pair's SmolLM2 (widened x4)? Its 98 MB file does not fit the 64 MiB a device call carries; the
shipped demo draft (20 MB, tracked, so it travels anyway) does. The demo draft is 6 layers of width 256; x8 wide and
x5 deep it has 30 layers of width 2048 (FFN 6144, 32 query heads of 64), about 1.7B weights, 1.0 GB at Q4_0: the
shape and cost of the bench pair's target (30 layers of width 2304, 2.1B weights, 1.09 GB). As in that pair, the
draft is the unwidened model and the target a widened, requantized copy of it.

Two processes: this one writes the F16 file with gguf and numpy; a child (`--quantize`) imports ggufspec first
(llama.cpp must start its backends before gguf loads, docs/benchmarks.md, "On a GPU") and quantizes it with
llama.cpp's quantizer on all cores.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

QUANT = {"q4_0": (2, 2), "q8_0": (7, 8), "f16": (1, 1)}  # name: (LLAMA_FTYPE_MOSTLY_*, GGML_TYPE_*)
ZEROED = ("attn_output", "ffn_down")  # a copy layer's writes to the residual stream


def write_f16(src: str, dst: str, r: int, k: int, tools: str, noise: float = 0.0, seed: int = 1) -> None:
    sys.path.insert(0, tools)
    import gguf
    import numpy as np
    from widen_gguf import widen  # ../shared/tools: read-only for the project, carried as a copy

    rng = np.random.default_rng(seed)
    rd = gguf.GGUFReader(src)
    arch = rd.fields["general.architecture"].contents()
    if arch != "llama":
        sys.exit(f"{src}: only llama-architecture models are supported, got {arch!r}")
    scaled = {f"{arch}.embedding_length", f"{arch}.feed_forward_length",
              f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"}
    wr = gguf.GGUFWriter(dst, arch)
    for key, field in rd.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val, vtype = field.contents(), field.types[0]
        if key in scaled:
            val = int(val) * r
        elif key == f"{arch}.block_count":
            val = int(val) * k
        elif key == "general.file_type":
            val = int(gguf.LlamaFileType.MOSTLY_F16)
        elif key == "general.name":
            val = f"{val} (x{r} wide, x{k} deep: GPU check target)"
        if vtype == gguf.GGUFValueType.ARRAY:
            wr.add_key_value(key, val, vtype, sub_type=field.types[1])
        else:
            wr.add_key_value(key, val, vtype)
    names = {t.name for t in rd.tensors}
    for t in rd.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        if noise and w.ndim > 1:
            w = w + rng.normal(0, noise * w.std(), w.shape).astype(np.float32)
        out = widen(t.name, w, r)
        out = out if out.ndim == 1 else out.astype(np.float16)
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            for j in range(k):
                copy = np.zeros_like(out) if j and rest.split(".")[0] in ZEROED else out
                wr.add_tensor(f"blk.{int(layer) * k + j}.{rest}", copy)
        else:
            wr.add_tensor(t.name, out)
        if t.name == "token_embd.weight" and "output.weight" not in names:  # tied: the head reads the stream / r
            wr.add_tensor("output.weight", (np.tile(w, (1, r)) / r).astype(np.float16))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def quantize(src: str, dst: str, kind: str) -> None:
    import ggufspec  # noqa: F401  (starts llama.cpp's backends first)
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, tensor_type = QUANT[kind]
    p.output_tensor_type = p.token_embedding_type = tensor_type
    p.nthread = os.cpu_count() or 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) != 0:
        sys.exit(f"quantizing {src} failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--widen", type=int, default=8)
    ap.add_argument("--deepen", type=int, default=5)
    ap.add_argument("--type", choices=sorted(QUANT), default="q4_0")
    ap.add_argument("--tools", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools"),
                    help="the folder with widen_gguf.py")
    ap.add_argument("--draft-out", help="also write SRC plus --noise here, Q8_0: the draft")
    ap.add_argument("--noise", type=float, default=0.1, help="the draft's noise, of each matrix's spread")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quantize", action="store_true", help="(child) quantize SRC, an F16 file, to DST")
    a = ap.parse_args()
    if a.quantize:
        return quantize(a.src, a.dst, a.type)
    make(a.src, a.dst, a.type, lambda f16: write_f16(a.src, f16, a.widen, a.deepen, a.tools))
    if a.draft_out:
        make(a.src, a.draft_out, "q8_0", lambda f16: write_f16(a.src, f16, 1, 1, a.tools, a.noise, a.seed))


def make(src: str, dst: str, kind: str, write) -> None:
    f16 = dst + ".f16.part"
    t0 = time.perf_counter()
    write(f16)
    t1 = time.perf_counter()
    subprocess.run([sys.executable, __file__, f16, dst + ".part", "--type", kind, "--quantize"], check=True)
    os.remove(f16)
    os.replace(dst + ".part", dst)
    print(f"{dst}: {os.path.getsize(dst) / 1e9:.2f} GB; F16 written in {t1 - t0:.1f} s, quantized to {kind} "
          f"in {time.perf_counter() - t1:.1f} s", flush=True)


if __name__ == "__main__":
    main()
