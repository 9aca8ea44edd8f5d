"""Opening a target (and a draft, Medusa heads, the target's MTP head) as the decoders of N slots: what
`SpeculativeEngine.load` (one slot) and `EnginePool.load` (N) share, so that a generation, a chat, `serve -np 1` and
`serve -np N` decode the same way: on slots of shared contexts, driven by one scheduler (lockstep.Lockstep)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from .decoder import DecoderOptions, LlamaCppDecoder
from .errors import GGUFSpecError, ModelFileError
from .gguf_check import headers_kept, read_header
from .generation import GenerationSettings
from .isolated import open_target
from .lockstep import Lockstep
from .machine_cache import notice
from .medusa.heads import ARCH as MEDUSA_ARCH, heads_memory, medusa_decoder_options
from .memory import check_memory, snapshots_that_fit
from .mtp import MtpDecoder, mtp_layers, unavailable as mtp_unavailable
from .chat import prestart
from .pairing import check_pair
from .recurrent import SNAPSHOTS_MAX

T = TypeVar("T")
DRAFT_TREE_SEQUENCES = 8  # a target paired with a draft holds `auto`'s greedy draft trees of up to 7 leaves


@dataclass
class Opened:
    """N slots' decoders (a draft, an MTP head: None each where there is none) and the scheduler that drives them."""

    lockstep: Lockstep
    targets: list[LlamaCppDecoder]
    drafts: list[LlamaCppDecoder | None]
    mtps: list[MtpDecoder | None]
    options: DecoderOptions  # as checked and resolved

    def __post_init__(self) -> None:
        # the target's and the draft's shared contexts (None: a context of its own), freed by close after the slots
        self.shared = [getattr(d, "shared_context", None) for d in (self.targets[0], self.drafts[0])]

    def close(self) -> None:
        """Free the contexts (the MTP head's before the target's weights it runs) and stop the scheduler; the slots'
        decoders may have been closed before."""
        self.lockstep.close()  # first: no generation decodes any more
        for m in self.mtps:
            if m is not None:
                m.close()
        if self.mtps[0] is not None:
            self.mtps[0].close_shared()
        for d in (*self.targets, *self.drafts):
            if d is not None:
                d.close()
        for context in self.shared:  # the last slot's reference would free it: now rather than at collection
            if context is not None:
                context.close()


@headers_kept()  # each file's header is read at several steps: parsed once
def open_slots(target_path: str | os.PathLike, draft_path: str | os.PathLike | None, options: DecoderOptions | None,
               settings: GenerationSettings, parallel: int, medusa_path: str | os.PathLike | None = None,
               medusa_vocab: int | str | os.PathLike | None = None) -> Opened:
    """Check the files (check_files), then open `parallel` slots of one context per model (LlamaCppDecoder.slots;
    a target on RPC servers: one slot of its own, in a child process) and the target's MTP head where it runs."""
    options = off_this_thread((options or DecoderOptions()).resolved)  # a first use probes: see off_this_thread
    options = with_snapshots(options, settings, parallel)
    options = check_files(target_path, draft_path, options, medusa_path, medusa_vocab, parallel)
    options = with_mtp(target_path, options, settings)
    if parallel > 1:  # a slot is one KV sequence (LlamaCppDecoder.slots): the draft model proposes chains
        options = replace(options, n_seq_max=1)
    lockstep = Lockstep()
    if options.remote:  # the target in a child process (isolated.py): one slot, decoded by the scheduler's thread
        target, draft = open_models(target_path, draft_path, options)
        targets, drafts = [target], [draft]
    else:
        target_opts = target_options(options, draft_path) if parallel == 1 else options
        targets = LlamaCppDecoder.slots(target_path, target_opts, parallel, lockstep)
        try:
            drafts = (LlamaCppDecoder.slots(draft_path, draft_options(options), parallel, lockstep, leads=True)
                      if draft_path else [None] * parallel)
        except BaseException:
            targets[0].shared_context.close()
            raise
    opened = Opened(lockstep, targets, drafts, [None] * parallel, options)
    try:
        # the target's MTP head: every slot's in one shared context, whose batches lead as the draft model's
        if options.mtp and not options.remote and targets[0].hidden_rows is not None:
            try:
                opened.mtps = MtpDecoder.slots(targets, lockstep)
            except GGUFSpecError as e:  # llama.cpp refused the head's context
                notice(f"{e}: auto drafts without an MTP head")
        if drafts[0] is not None:  # a pair that cannot draft is refused before anything is measured
            check_pair(targets[0], drafts[0])
    except BaseException:
        opened.close()
        raise
    return opened


def off_this_thread(work: Callable[[], T]) -> T:
    """work() on a thread of its own. With llama.cpp's OpenMP build, once a thread has decoded, decodes from other
    threads (the scheduler's decode thread) ran at half speed (lockstep.Lockstep): a probe that decodes (choosing the V
    cache type on first use) must not run on the caller's thread, which may be the main one."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, work()))
        except BaseException as e:  # raised again on the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def check_files(target_path: str | os.PathLike, draft_path: str | os.PathLike | None, options: DecoderOptions | None,
                medusa_path: str | os.PathLike | None = None, medusa_vocab: int | str | os.PathLike | None = None,
                sequences: int = 1) -> DecoderOptions:
    """What a load checks before any model loads (the files, their RAM needs together with a cache of options.n_ctx
    tokens, and `sequences` recurrent states of a hybrid or recurrent model's); the options to load them with
    (Medusa's need hidden states and tree sequences)."""
    options = options or DecoderOptions()
    if medusa_path is not None:
        options = medusa_decoder_options(options)
    paths = [Path(p).expanduser() for p in (target_path, draft_path) if p is not None]
    headers = [read_header(p) for p in paths]
    for path, header in zip(paths, headers):
        if header.metadata.get("general.architecture") == MEDUSA_ARCH:
            raise ModelFileError(f"{path} holds Medusa heads (ggufspec's own format), not a model: give it with "
                                 "--medusa (medusa_path=), next to the target it was trained for.")
    if headers[0].metadata.get("tokenizer.chat_template"):
        prestart()  # the template's renderer process starts while the models load
    local = list(zip(paths, headers))
    if options.remote:  # its endpoints are checked as it opens (isolated.open_target), before anything loads
        local = local[1:] if not options.rpc_draft else []  # the weights on RPC servers are theirs to hold
    if options.memory_check and not options.offloads and local:
        extra = heads_memory(medusa_path, headers[0], medusa_vocab) if medusa_path is not None else []
        kv = options.resolved()  # this machine's default V cache type, chosen before the check sizes the cache
        fit = snapshots_that_fit(local, options.n_ctx, kv.cache_type, kv.cache_type_v, extra, options.n_rs_seq,
                                 sequences)
        if fit < options.n_rs_seq:  # longer chains then go back from a checkpoint
            notice(f"keeping {fit} recurrent-state snapshots instead of {options.n_rs_seq}: more do not fit the RAM")
            options = replace(options, n_rs_seq=fit)
        check_memory(local, options.n_ctx, kv.cache_type, kv.cache_type_v, extra, options.n_rs_seq, sequences)
    return options


def open_models(target_path: str | os.PathLike, draft_path: str | os.PathLike | None,
                options: DecoderOptions) -> tuple[LlamaCppDecoder, LlamaCppDecoder | None]:
    """The target (with target_options) and the draft on contexts of their own. With options.rpc, the target's layers
    go to those RPC servers, from a child process (isolated.py: ggml-rpc aborts the process whose server fails), and
    the draft stays on this machine unless options.rpc_draft."""
    target_opts = target_options(options, draft_path)
    if options.remote:
        on_rpc = options.rpc_draft and draft_path is not None
        target, draft = open_target(target_path, target_opts, draft_path, options if on_rpc else None)
        options = replace(options, rpc=(), tensor_split=())  # a draft not opened there: on this machine
    else:
        target, draft = LlamaCppDecoder(target_path, target_opts), None
    if draft_path is None or draft is not None:
        return target, draft  # type: ignore[return-value]
    try:
        return target, LlamaCppDecoder(draft_path, draft_options(options))
    except BaseException:
        target.close()
        raise


def draft_options(options: DecoderOptions) -> DecoderOptions:
    """A draft model's options: no snapshots, which undo part of a verification batch, while a draft model's rollbacks
    undo its single-token guesses (a checkpoint does, on recurrent memory: DraftModelProposer); nor its MTP layers."""
    return replace(options, n_rs_seq=0, mtp=False)


def target_options(options: DecoderOptions, draft_path: str | os.PathLike | None) -> DecoderOptions:
    """With a draft model, room for `auto`'s draft trees (a unified cache: same size, same speed here)."""
    if draft_path is None:
        return options
    return replace(options, n_seq_max=max(options.n_seq_max, DRAFT_TREE_SEQUENCES))


def with_snapshots(options: DecoderOptions, settings: GenerationSettings, parallel: int = 1) -> DecoderOptions:
    """`options` with recurrent-state snapshots for the target's chains of up to settings.draft_max drafts (at most
    recurrent.SNAPSHOTS_MAX: longer ones, lookup's copies, are undone from checkpoints); attention models ignore it.
    None where no chain is expected to need them, since every batch of every slot writes them (their cost to a pool's
    plain steps: docs/hybrid.md): plain decoding, and `auto` in a pool of several slots (the few chains it drafts
    there are undone from checkpoints, whose cost it prices)."""
    method = settings.method or "auto"
    if method == "autoregressive" or (parallel > 1 and method == "auto"):
        return options
    return replace(options, n_rs_seq=max(options.n_rs_seq, min(settings.draft_max, SNAPSHOTS_MAX)))


def with_mtp(target_path: str | os.PathLike, options: DecoderOptions, settings: GenerationSettings) -> DecoderOptions:
    """`options` with the target's MTP head loaded (DecoderOptions.mtp) where the model has one, this llama-cpp-python
    runs it and the method may draft from it (auto, mtp); else without, and one notice line where the model has MTP
    layers or --method mtp asked for them: what is missing, and what runs instead (`mtp` runs as `auto`; no method
    is then the default of a model without a head: autoregressive, or auto with a draft model or Medusa heads)."""
    if settings.method not in (None, "auto", "mtp"):
        return replace(options, mtp=False)
    path = Path(target_path).expanduser()
    header = read_header(path)
    if options.remote and mtp_layers(header):
        why: str | None = f"{path.name} has MTP layers, which ggufspec does not run on RPC servers yet"
    else:
        why = mtp_unavailable(header, path.name)
    if why is None:
        return replace(options, mtp=True)
    if mtp_layers(header) or settings.method == "mtp":
        then = {"mtp": "--method mtp runs as auto, without", "auto": "auto drafts without"}.get(settings.method or "",
                                                                                                "running without")
        notice(f"{why}: {then} an MTP head")
    return replace(options, mtp=False)
