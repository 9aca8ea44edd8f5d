"""`SpeculativeEngine`: prompt in, the target's text out, through any method, with stats."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from .adaptive import AutoDrafter, CostModel, FixedLength, cached_measure
from .chat import Message, chat_tokens
from .decoder import DecoderOptions, LlamaCppDecoder
from .drafters import LookupDrafter, ModelDrafter
from .errors import ContextLengthError, GGUFSpecError
from .gguf_check import read_header
from .memory import check_memory
from .methods import METHODS, Step
from .medusa.candidates import special_ids
from .medusa.heads import Heads, heads_memory, medusa_decoder_options
from .trees import build_tree, load_tree
from .methods.autoregressive import autoregressive
from .methods.medusa import medusa
from .methods.speculative import speculative
from .pairing import check_pair
from .sampling import SamplingParams
from .stats import Stats
from .textstream import TextStream

Method = Literal["autoregressive", "vanilla", "lookup", "auto", "medusa"]
StopReason = Literal["stop", "max_tokens", "length", "interrupted"]
DRAFT_TREE_SEQUENCES = 8  # a target paired with a draft holds `auto`'s greedy draft trees of up to 7 leaves


@dataclass
class GenerationSettings:
    """What to generate and how; `method` None picks vanilla when a draft is loaded."""

    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: Method | None = None
    draft_max: int = 4
    draft_p_min: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    truncate_prompt: bool = False
    context_shift: bool = False  # when the context is full, drop older tokens instead of stopping
    medusa_tree: str | None = None  # method medusa: a tree name or JSON choices file (default: the heads' own, else mc_sim_7b_63)
    typical: bool = False  # method medusa at temperature > 0: typical acceptance, faster but NOT exact

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.draft_max < 1:
            raise ValueError(f"draft_max must be >= 1, got {self.draft_max}")
        if not 0 <= self.draft_p_min <= 1:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stop_reason: StopReason
    stats: Stats


Prompt = str | list[Message] | list[int]  # plain text, chat messages (rendered with the GGUF's template), or token ids


@dataclass
class GenerationResponse:
    """What `stream` yields: one committed token (the last response: none, with the finish reason and result).

    `text` is the text that became safe to show with this token (UTF-8 complete, no stop string), possibly
    empty; `from_draft` says the token was proposed by a draft (model, lookup or Medusa) and kept by the target.
    """

    text: str
    token: int | None
    from_draft: bool
    stats: Stats
    finish_reason: StopReason | None = None
    result: GenerationResult | None = None


class SpeculativeEngine:
    """A target decoder and an optional draft decoder that share a vocabulary."""

    def __init__(
        self, target: LlamaCppDecoder, draft: LlamaCppDecoder | None = None,
        settings: GenerationSettings | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.settings = settings or GenerationSettings()
        if draft is not None:
            check_pair(target, draft)
        self.last_result: GenerationResult | None = None
        self.medusa: Heads | None = None  # set by load(medusa_path=...)
        self._costs: CostModel | None = None
        self._policies: dict[bool, AutoDrafter] = {}  # auto's, kept across generations: what they learned
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def load(
        cls, target_path: str | os.PathLike, draft_path: str | os.PathLike | None = None,
        options: DecoderOptions | None = None, settings: GenerationSettings | None = None,
        medusa_path: str | os.PathLike | None = None,
        medusa_vocab: int | str | os.PathLike | None = None,  # Medusa candidates: the N lowest ids or a file of ids
    ) -> SpeculativeEngine:
        """Open the GGUF files (checked first, and their RAM needs together) and pair them; Medusa heads if given."""
        options = options or DecoderOptions()
        if medusa_path is not None:
            options = medusa_decoder_options(options)
        paths = [Path(p).expanduser() for p in (target_path, draft_path) if p is not None]
        headers = [read_header(p) for p in paths]
        if options.memory_check and options.n_gpu_layers == 0:
            extra = heads_memory(medusa_path, headers[0], medusa_vocab) if medusa_path is not None else []
            check_memory(list(zip(paths, headers)), options.n_ctx, options.cache_type, extra)
        target_options = options
        if draft_path is not None:  # room for `auto`'s draft trees (a unified cache: same size, same speed here)
            target_options = replace(options, n_seq_max=max(options.n_seq_max, DRAFT_TREE_SEQUENCES))
        target = LlamaCppDecoder(target_path, target_options)
        draft = None
        try:
            if draft_path is not None:
                draft = LlamaCppDecoder(draft_path, options)
            engine = cls(target, draft, settings)
            if medusa_path is not None:
                engine.medusa = Heads.load(medusa_path, target.path, target.n_embd, target.n_vocab,
                                           medusa_vocab, special_ids(target.vocab) if medusa_vocab is not None else ())
            return engine
        except BaseException:
            target.close()
            if draft is not None:
                draft.close()
            raise

    # --- prompts --------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """The context both models share: the longest prompt plus answer."""
        return min(self.target.n_ctx, self.draft.n_ctx) if self.draft is not None else self.target.n_ctx

    @property
    def has_chat_template(self) -> bool:
        return bool(self.target.metadata("tokenizer.chat_template"))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a plain prompt, or of chat messages rendered with the GGUF's chat template."""
        vocab = self.target.vocab
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.n_vocab]
            if bad:
                raise GGUFSpecError(f"token id {bad[0]} is outside this model's vocabulary of {self.target.n_vocab}.")
            return list(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise GGUFSpecError("the prompt is empty.")
            return vocab.tokenize(prompt, add_special=True, parse_special=True)
        if not prompt:
            raise GGUFSpecError("no chat messages given.")
        return chat_tokens(vocab, self.target.metadata("tokenizer.chat_template"), prompt)

    # --- generation -----------------------------------------------------------------------

    def generate(self, prompt: Prompt, settings: GenerationSettings | None = None) -> GenerationResult:
        for _ in self.stream(prompt, settings):
            pass
        assert self.last_result is not None
        return self.last_result

    def stream(self, prompt: Prompt, settings: GenerationSettings | None = None) -> Iterator[GenerationResponse]:
        """Yield a response per committed token, then one with the finish reason and the whole result (also left
        in `last_result`, even when the caller stops early)."""
        if self._closed:
            raise GGUFSpecError("this engine is closed.")
        if not self._lock.acquire(blocking=False):
            raise GGUFSpecError("this engine is already generating (in another thread or stream); use one engine per thread.")
        try:
            yield from self._run(prompt, settings or self.settings)
        finally:
            self._lock.release()

    def method_for(self, s: GenerationSettings) -> str:
        """The method `s` runs on this engine; GGUFSpecError when it needs a model this engine lacks."""
        method = s.method or ("vanilla" if self.draft is not None else "medusa" if self.medusa else "autoregressive")
        if method == "vanilla" and self.draft is None:
            raise GGUFSpecError("method 'vanilla' needs a draft model (-d DRAFT.gguf).")
        if method == "medusa" and self.medusa is None:
            raise GGUFSpecError("method 'medusa' needs Medusa heads (--medusa HEADS.gguf).")
        return method

    def _run(self, prompt: Prompt, s: GenerationSettings) -> Iterator[GenerationResponse]:
        target, draft = self.target, self.draft
        method = self.method_for(s)
        tree = None
        if method == "medusa":  # the heads' own fitted tree unless another is asked for
            own = self.medusa.choices if s.medusa_tree is None else None
            tree = build_tree(own) if own else load_tree(s.medusa_tree)
        if method not in ("vanilla", "auto"):
            draft = None  # this method does not use it: leave its context as it is
        n_ctx = min(target.n_ctx, draft.n_ctx) if draft is not None else target.n_ctx
        tokens = self.encode(prompt)
        if len(tokens) >= n_ctx:
            if not s.truncate_prompt:
                raise ContextLengthError(
                    f"the prompt has {len(tokens)} tokens and the context holds {n_ctx}: "
                    "raise --n-ctx, shorten the prompt, or allow --truncate-prompt."
                )
            tokens = tokens[len(tokens) - (n_ctx - min(s.max_tokens, n_ctx // 2)):]
        stats = Stats(prompt_tokens=len(tokens), method=method)
        limit = s.max_tokens if s.context_shift else min(s.max_tokens, n_ctx - len(tokens))
        for d in (target, draft) if draft is not None else (target,):
            d.shift_keep = min(len(tokens), n_ctx // 4) if s.context_shift else None
        rng = np.random.default_rng(s.seed)
        stop_ids = set(s.stop_tokens)
        out: list[int] = []
        text = TextStream(s.stop)
        reason: StopReason = "interrupted"
        # before the prefill: measuring the cost model (first `auto` run only) resets the contexts
        drafting = self._drafting(method, draft, s) if method not in ("autoregressive", "medusa") else None
        t0 = time.perf_counter()
        decoded_before, base_t, base_d = target.n_decoded_tokens, 0.0, 0.0
        finished = False
        try:
            # The last prompt token is decoded by the first step, so every position is decoded once. `auto`
            # prefills the draft only where it expects to draft with it; elsewhere the draft catches up when
            # first used (often never: on many CPUs the draft model does not pay).
            uses_draft = draft is not None and (
                method == "vanilla" or method == "auto" and drafting[0].uses_model(len(tokens))
            )
            for d in (target, draft) if uses_draft else (target,):
                if len(tokens) > 1:
                    d.sync(tokens[:-1])
                else:
                    d.rollback_to(0)
            t1 = time.perf_counter()
            stats.prefill_seconds = t1 - t0
            stats.prefill_tokens = target.n_decoded_tokens - decoded_before
            stats.cached_tokens = max(0, len(tokens) - 1 - stats.prefill_tokens)
            base_t, base_d = target.decode_seconds, draft.decode_seconds if draft else 0.0
            if tree is not None:
                steps: Iterator[Step] = medusa(target, self.medusa, tree, tokens[-1], limit, s.sampling, rng, s.typical)
            elif drafting is None:
                steps = autoregressive(target, tokens[-1], limit, s.sampling, rng)
            else:
                steps = speculative(target, *drafting, tokens[-1], limit, s.sampling, rng)
            reason = "length" if limit < s.max_tokens else "max_tokens"
            for step in steps:
                stats.record(step.drafted, len(step.tokens) - 1)
                for i, tok in enumerate(step.tokens):
                    if target.vocab.is_eog(tok) or tok in stop_ids:
                        reason = "stop"
                        break
                    out.append(tok)
                    stats.generated_tokens = len(out)
                    piece = text.push(target.vocab.piece(tok))
                    yield GenerationResponse(piece, tok, i < len(step.tokens) - 1, stats)
                    if text.stopped:
                        reason = "stop"
                        break
                if reason == "stop":
                    steps.close()
                    break
            tail = text.flush()
            self._finish(stats, out, text, reason, t0, base_t, base_d, draft)
            finished = True
            yield GenerationResponse(tail, None, False, stats, reason, self.last_result)
        finally:
            if not finished:  # stopped early: by the caller, Ctrl-C or an error
                self._finish(stats, out, text, "interrupted", t0, base_t, base_d, draft)

    def _finish(self, stats: Stats, out: list[int], text: TextStream, reason: StopReason, t0: float, base_t: float,
                base_d: float, draft: LlamaCppDecoder | None) -> None:
        stats.generated_tokens = len(out)
        if stats.prefill_seconds:
            stats.generation_seconds = time.perf_counter() - t0 - stats.prefill_seconds
            stats.target_seconds = self.target.decode_seconds - base_t
            stats.draft_seconds = (draft.decode_seconds - base_d) if draft else 0.0
        self.last_result = GenerationResult(text.text, out, reason, stats)

    def _drafting(self, method: str, draft: LlamaCppDecoder | None, s: GenerationSettings):
        """The drafter and draft-length policy of a speculative method."""
        n_vocab = self.target.n_vocab
        if method == "vanilla":  # the textbook method: chains of fixed length
            return ModelDrafter(draft, n_vocab, s.draft_p_min), FixedLength(s.draft_max)
        tree_leaves = self.target.options.n_seq_max - 1
        model = ModelDrafter(draft, n_vocab, s.draft_p_min, tree_leaves) if draft is not None else None
        lookup = LookupDrafter(n_vocab)
        if method == "lookup":
            return lookup, FixedLength(s.draft_max)
        if self._costs is None or len(self._costs.verify) < s.draft_max + 1:
            self._costs = cached_measure(self.target, draft, s.draft_max)
        key = model is not None
        auto = self._policies.get(key)
        if auto is None or auto.k_max != s.draft_max or auto.costs is not self._costs:
            auto = self._policies[key] = AutoDrafter(lookup, model, self._costs, s.draft_max, self.target, draft)
        auto.lookup, auto.model = lookup, model  # this generation's settings (draft_p_min)
        return auto, auto.restart()

    def reset(self) -> None:
        """Empty both KV caches: the next generation prefills from scratch (no prefix reuse)."""
        for d in (self.target, self.draft):
            if d is not None:
                d.reset()

    def close(self) -> None:
        """Free both llama.cpp contexts."""
        self._closed = True
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
