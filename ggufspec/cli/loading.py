"""From the command line's options to loaded models: llama.cpp's context options (decoder_options), a preset's
files, the method and its combination with the models checked, and the engine (or pool of slots) generate, chat and
serve run. Every check here fails with a usage error (exit code 2) before any model is fetched or loaded."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import GGUFSpecError
from ..methods import METHODS, get_method

if TYPE_CHECKING:
    from ..decoder import DecoderOptions
    from ..engine import GenerationSettings, SpeculativeEngine
    from ..hub import Preset, Resolved
    from ..pool import EnginePool


def decoder_options(n_ctx: int, n_batch: int, n_ubatch: int | None, threads: int | None, threads_batch: int | None,
                    n_gpu_layers: int, rpc: str | None, tensor_split: str | None, rpc_draft: bool, rpc_timeout: float,
                    no_mmap: bool, mlock: bool, no_repack: bool, flash_attn: bool | None, fa: str | None,
                    kv_type: str | None, kv_type_k: str | None, kv_type_v: str | None, verbose: bool,
                    log_disable: bool, no_memory_check: bool) -> DecoderOptions:
    """DecoderOptions of the options in LOADS (their parameter names are these arguments'): the RPC servers and the
    tensor split parsed, -fa and --flash-attn reconciled, -ngl dropped with a warning by a build without a GPU."""
    from ..decoder import DecoderOptions, gpu_offload

    endpoints = _rpc_endpoints(rpc, rpc_draft)
    split = _tensor_split(tensor_split)
    flash_attn = _flash_attn(flash_attn, fa)
    if n_gpu_layers != 0 and not gpu_offload() and not endpoints:  # as llama.cpp: a warning, the CPU's defaults stay
        click.echo(f"warning: -ngl {n_gpu_layers} is ignored: this llama.cpp build has no GPU backend (reinstall "
                   "llama-cpp-python with CMAKE_ARGS for CUDA or Metal, see README); running on the CPU", err=True)
        n_gpu_layers = 0
    try:
        return DecoderOptions(
            n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads, n_threads_batch=threads_batch,
            n_gpu_layers=n_gpu_layers, rpc=endpoints, tensor_split=split, rpc_draft=rpc_draft, rpc_timeout=rpc_timeout,
            use_mmap=not no_mmap, use_mlock=mlock, repack=not no_repack, flash_attn=flash_attn,
            kv_type=kv_type, kv_type_k=kv_type_k, kv_type_v=kv_type_v,
            verbose=verbose and not log_disable,  # as llama.cpp, where --log-disable pauses the log whatever -v says
            memory_check=not no_memory_check,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _rpc_endpoints(rpc: str | None, rpc_draft: bool) -> tuple[str, ...]:
    """--rpc's servers, checked (and this build's RPC support) before anything loads; () without --rpc."""
    from ..rpc import parse_endpoints, require

    if rpc is not None:
        require()  # one error line naming the build flags, before anything loads
        return tuple(map(str, parse_endpoints(rpc)))
    if rpc_draft:
        raise click.UsageError("--rpc-draft needs --rpc.")
    return ()


def _tensor_split(tensor_split: str | None) -> tuple[float, ...]:
    """--tensor-split's weights (3,1 or 3/1); () without it."""
    if tensor_split is None:
        return ()
    try:
        return tuple(float(w) for w in tensor_split.replace("/", ",").split(","))
    except ValueError:
        raise click.UsageError(f"--tensor-split takes weights like 3,1; got {tensor_split!r}.") from None


def _flash_attn(flash_attn: bool | None, fa: str | None) -> bool | None:
    """--flash-attn/--no-flash-attn and llama.cpp's -fa on|off|auto as one setting (None: llama.cpp decides); a usage
    error where they contradict each other."""
    if fa is None:
        return flash_attn
    if flash_attn is not None and flash_attn != (fa == "on"):
        raise click.UsageError(f"-fa {fa} contradicts --{'' if flash_attn else 'no-'}flash-attn.")
    return {"on": True, "off": False, "auto": None}[fa]


_GENERATION_KEYS = ("target", "draft", "preset", "method", "max_tokens", "temp", "top_k", "top_p", "min_p", "seed",
                    "draft_max", "draft_p_min", "medusa_path", "medusa_tree", "medusa_vocab", "typical", "stop")
_MODEL_KEYS = tuple(inspect.signature(decoder_options).parameters)


def load_engine(params: dict[str, Any], default_method: str | None = None, parallel: int | None = None,
                **settings_extra: Any) -> tuple[SpeculativeEngine | EnginePool, GenerationSettings]:
    """The engine and settings of generate's, chat's and serve's shared options (taken out of `params`): a preset
    resolved and fetched, the combination checked, the models loaded; default_method when none is given (None: the
    engine's). With `parallel`, an EnginePool of that many slots instead of one engine (-c is then the whole cache,
    as llama-server's: each slot holds n_ctx // parallel tokens)."""
    from ..engine import GenerationSettings, SpeculativeEngine
    from ..sampling import SamplingParams

    g = {k: params.pop(k) for k in _GENERATION_KEYS}
    ignore_eos = params.pop("ignore_eos", False)  # generate's and serve's (a chat turn would never end)
    template = params.pop("chat_template")
    options = decoder_options(**{k: params.pop(k) for k in _MODEL_KEYS})
    method = _spec_method(g["method"], params.pop("spec_type"))
    target, draft, medusa_path, draft_max = g["target"], g["draft"], g["medusa_path"], g["draft_max"]
    if target is None:
        target, draft, medusa_path, method, draft_max = _from_preset(g["preset"] or "demo", draft, medusa_path, method,
                                                                     draft_max, gpu=options.offloads)
    elif g["preset"] is not None:
        raise click.UsageError("give either --preset NAME or -m TARGET.gguf, not both.")
    method = method or default_method
    if method is not None:
        check_method(method, draft, medusa_path)
    medusa_vocab = resolve_medusa_vocab(g["medusa_vocab"], medusa_path)
    settings = GenerationSettings(
        max_tokens=g["max_tokens"] or options.n_ctx, sampling=SamplingParams(g["temp"], g["top_k"], g["top_p"], g["min_p"]),
        method=method, draft_max=draft_max, draft_p_min=g["draft_p_min"], seed=g["seed"], stop=tuple(g["stop"]),
        medusa_tree=g["medusa_tree"], typical=g["typical"], ignore_eos=ignore_eos, **settings_extra,
    )
    if parallel is not None:
        from ..pool import EnginePool

        pool = EnginePool.load(target, draft, options, settings, medusa_path, medusa_vocab, parallel=parallel)
        for slot in pool.slots:
            slot.engine.chat_template = template or slot.engine.chat_template
        return pool, settings
    engine = SpeculativeEngine.load(target, draft, options, settings, medusa_path=medusa_path, medusa_vocab=medusa_vocab)
    engine.chat_template = template or engine.chat_template  # --chat-template over the GGUF's
    return engine, settings


def _spec_method(method: str | None, spec_method: str | None) -> str | None:
    """--method, or the method --spec-type (llama.cpp's spelling, SpecType) asks for; both must agree."""
    if spec_method is not None and method is not None and spec_method != method:
        raise click.UsageError(f"--spec-type asks for --method {spec_method} here, which contradicts --method "
                               f"{method}: give one of them.")
    return spec_method or method


def resolve_medusa_vocab(value: str | None, medusa_path: str | None) -> int | str | None:
    """--medusa-vocab as SpeculativeEngine.load takes it: a number of ids, or a file of ids; a usage error without
    Medusa heads to restrict."""
    if value is not None and medusa_path is None:
        raise click.UsageError("--medusa-vocab restricts Medusa heads: give them with --medusa HEADS.gguf (or a Medusa --preset)")
    return int(value) if value is not None and value.strip().lstrip("+-").isdigit() else value


def has_mtp(target: str) -> bool:
    """Whether the target's MTP head can draft here (mtp.py)."""
    from ..gguf_check import read_header
    from ..mtp import unavailable

    path = Path(target).expanduser()
    return unavailable(read_header(path), path.name) is None


def check_method(method: str, draft: str | None, medusa_path: str | None) -> None:
    """A usage error where `method` needs a model that was not given (a draft, Medusa heads)."""
    try:
        get_method(method, draft is not None, medusa_path is not None)
    except GGUFSpecError as e:
        raise click.UsageError(str(e)) from None


def preset_files(name: str, draft_max: int, gpu: bool) -> tuple[Preset, Resolved, int]:
    """A preset, its files resolved (fetched as needed) for a GPU/Metal or CPU run, and its draft length unless the
    user gave --draft-max."""
    from ..hub import get_preset, resolve

    p = get_preset(name)
    if p.method not in METHODS:
        raise GGUFSpecError(f"preset {name!r} uses method {p.method!r}, which this build's generate does not offer.")
    r = resolve(p, gpu=gpu)
    if click.get_current_context().get_parameter_source("draft_max") == click.core.ParameterSource.DEFAULT:
        draft_max = p.draft_max
    return p, r, draft_max


def _from_preset(name: str, draft: str | None, medusa: str | None, method: str | None, draft_max: int, gpu: bool
                 ) -> tuple[str, str | None, str | None, str, int]:
    """Target (the preset's GPU/Metal or CPU file), draft, heads, method and draft length of a preset (fetched as
    needed); what the user gave wins."""
    p, r, draft_max = preset_files(name, draft_max, gpu)
    method = method or p.method
    m = METHODS[method]
    if draft is None and "draft" in m.proposers and r.draft is not None:
        draft = str(r.draft)
    if medusa is None and m.needs == "heads" and r.medusa is not None:
        medusa = str(r.medusa)
    return str(r.target), draft, medusa, method, draft_max
