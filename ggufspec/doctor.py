"""`ggufspec doctor`: what a bug report needs about this install, this CPU and these models."""

from __future__ import annotations

import platform
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import llama_cpp
from gguf import GGMLQuantizationType

from . import cpu_backend, rpc
from .costs import cache_report
from .decoder import DecoderOptions, LlamaCppDecoder, gpu_offload
from .generation import GenerationSettings
from .opening import draft_options, with_snapshots
from .gguf_check import GGUFHeader
from .isolated import open_target
from .machine_cache import costs_path, cpu_info
from .memory import recurrent_state_bytes
from .mtp import library_lacks, mtp_layers, unavailable
from .recurrent import rollback_in_use


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> list[str]:
    """Versions, CPU, llama.cpp's features and the CPU weight layouts in use."""
    backend = cpu_backend.prepare()
    lines = [
        f"ggufspec {_version('ggufspec')}, Python {platform.python_version()}, {platform.system()} {platform.machine()}",
        f"llama-cpp-python {llama_cpp.__version__}, gguf {_version('gguf')}, numpy {_version('numpy')}",
        f"CPU: {cpu_info().get('model name') or platform.processor() or 'unknown'}",
        f"llama.cpp system info: {llama_cpp.llama_print_system_info().decode(errors='replace').strip()}",
        f"GPU offload: {'available' if gpu_offload() else 'not in this build (CPU only)'}",
        f"RPC (--rpc, rpc-server): {'available' if rpc.available() else 'not in this build: ' + rpc.BUILD_HINT}",
        f"CPU weight layouts offered: {', '.join(backend.offered) or 'none'}; in use: {', '.join(backend.in_use) or 'plain only'}",
    ]
    for name, why in backend.dropped.items():
        lines.append(f"  turned off: {name}: {why}. Avoided by removing it from the CPU device's layouts before "
                     f"loading; {cpu_backend.ALLOW_ENV.format(name)}=1 keeps it.")
        lines.append(f"  faster: a build without {name} decoded single Q4_0 tokens 1.68x faster on such a Xeon "
                     f"(docs/cpu-kernels.md): {cpu_backend.REBUILD}")
    for name in backend.kept_broken:
        lines.append(f"  WARNING: {name} is known to crash this build and was kept ({cpu_backend.ALLOW_ENV.format(name)}=1).")
    lines += cache_report(costs_path())
    return lines


def model_lines(role: str, path: str | Path, options: DecoderOptions) -> list[str]:
    """Where one model's weights live and what its KV cache holds, from a real load (on options.rpc's servers
    from a child process, as generation loads it)."""
    with (open_target(path, options)[0] if options.remote else LlamaCppDecoder(path, options)) as d:
        buffers = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in d.weight_buffers.items()) or "unknown"
        types = sorted({t.type for t in d.header.tensors})
        state = recurrent_state_bytes(d.header)
        return [
            f"{role}: {d.path} ({d.path.stat().st_size / 1e6:.1f} MB; tensor types "
            f"{', '.join(GGMLQuantizationType(t).name for t in types)})",
            f"  weights: {buffers}",
            f"  KV cache: {d.kv_cache}, {d.n_ctx} tokens; micro-batch {d.n_ubatch}; threads "
            f"{options.n_threads or 'all'}; GPU layers {options.n_gpu_layers}",
            f"  memory: {rollback_in_use(d.memory, d.n_rs_seq, options.n_rs_seq)}"
            + (f"; recurrent state {state / 2**20:.2f} MiB a sequence" if state else ""),
            *([mtp_line(d.path, d.header)] if role == "target" else []),
        ]


def mtp_line(path: Path, header: GGUFHeader) -> str:
    """Whether the model has MTP layers (its own drafter, mtp.py) and whether this llama-cpp-python runs them."""
    n = mtp_layers(header)
    if not n:
        lacks = library_lacks()
        return "  MTP head: none in this model" + (f" (nor could this llama-cpp-python run one: {lacks})" * bool(lacks))
    why = unavailable(header, path.name)
    if why is not None:
        return f"  MTP head: {n} block{'s' * (n > 1)}, not used: {why}"
    return ("  MTP head: 1 block, and this llama-cpp-python runs it: auto drafts from it where that pays (--method "
            "mtp: from it alone)")


def report(target: str | None, draft: str | None, options: DecoderOptions) -> str:
    lines = environment()
    if options.remote:
        for ep, seconds in rpc.check(rpc.parse_endpoints(options.rpc)).items():
            lines.append(f"RPC server {ep}: answers, handshake round trip {seconds * 1000:.2f} ms")
    for role, path in (("target", target), ("draft", draft)):
        if path is not None:
            on_rpc = role == "target" or options.rpc_draft
            # as generation loads them: the target with snapshots for --draft-max's chains, the draft without
            loaded = (with_snapshots(options, GenerationSettings()) if role == "target"
                      else draft_options(options))
            lines += model_lines(role, path, loaded if on_rpc else replace(loaded, rpc=()))
    if target is None:
        lines.append("(give -m MODEL.gguf [-d DRAFT.gguf] to see where their weights go)")
    return "\n".join(lines)
