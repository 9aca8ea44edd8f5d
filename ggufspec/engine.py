"""`SpeculativeEngine`: prompt in, the target's text out, through any method, with stats."""

from __future__ import annotations

import os
import threading
from types import MappingProxyType
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from dataclasses import replace

import numpy as np

from .chat import Template, chat_tokens
from .costs import CostModel, cached_measure
from . import llama_log
from .decoder import DecoderOptions, LlamaCppDecoder
from .errors import ContextLengthError, GGUFSpecError
from .medusa.candidates import special_ids
from .medusa.heads import Heads
from .mtp import MtpDecoder
from .opening import Opened, open_slots
from .lockstep import Ended, Lockstep, Task
from .loop import generate_steps
from .methods import Method, get_method
from .policy import Policy, TreeSizer
from .policy.auto import AutoPolicy
from .policy.shared import SlotRecords
from .proposers import PROPOSERS, AnswerPool, Proposer, Setup
from .pairing import check_pair
from .stats import Stats
from .submission import Submission
from .textstream import TextStream
from .trees import Tree, build_tree, load_tree
from .verifier import Verifier
from .generation import GenerationResponse, GenerationResult, GenerationSettings, Prompt, StopReason
from .meter import Meter, committed

MEDUSA_DENSE_SIZES = 3  # Medusa's cost model: batches of 1..4 tokens measured, then 16, 32, 64 (interpolated between)


class SpeculativeEngine:
    """A target decoder and an optional draft decoder that share a vocabulary, and the target's MTP head where it has
    one (`mtp`: the target loaded with DecoderOptions.mtp)."""

    def __init__(
        self, target: LlamaCppDecoder, draft: LlamaCppDecoder | None = None,
        settings: GenerationSettings | None = None, costs: CostModel | None = None, mtp: MtpDecoder | None = None,
        answers: AnswerPool | None = None, slot_records: SlotRecords | None = None, lockstep: Lockstep | None = None,
    ) -> None:
        """`answers`: what earlier generations answered, for `auto`'s lookup (EnginePool: one for every slot; a new one
        when None); `slot_records`: the pool's slots' drafter records, which `auto` prices a shared batch with;
        `lockstep`: the scheduler of the shared contexts the decoders are slots of (LlamaCppDecoder.slots), which
        runs each generation as a task (`spawn`); None: decoders of contexts of their own, run by a scheduler of the
        engine's own."""
        self.target = target
        self.draft = draft
        self.mtp = mtp
        self.settings = settings or GenerationSettings()
        if draft is not None:
            check_pair(target, draft)
        self.last_result: GenerationResult | None = None
        # what chat messages are rendered with: the GGUF's Jinja template, or what --chat-template names instead
        self.chat_template: Template | None = target.metadata("tokenizer.chat_template")
        self.medusa: Heads | None = None  # set by load(medusa_path=...)
        self.costs = costs  # the cost model `auto` prices steps with: measured at its first run when None
        self._auto: dict[tuple[bool, bool], AutoPolicy] = {}  # with and without a draft model, an MTP head: kept
        self._sizers: dict[tuple, TreeSizer] = {}  # Medusa's, per tree
        self.answers: AnswerPool | None = answers if answers is not None else AnswerPool()
        self.slot_records = slot_records
        self.lockstep = lockstep or Lockstep()
        self._own_lockstep = lockstep is None  # stopped by close (a pool's stops with the pool)
        self._opened: Opened | None = None  # what load opened: closed with the engine
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def load(
        cls, target_path: str | os.PathLike, draft_path: str | os.PathLike | None = None,
        options: DecoderOptions | None = None, settings: GenerationSettings | None = None,
        medusa_path: str | os.PathLike | None = None,
        medusa_vocab: int | str | os.PathLike | None = None,  # Medusa candidates: the N lowest ids or a file of ids
        costs: CostModel | None = None,
    ) -> SpeculativeEngine:
        """Open the GGUF files (checked first, and their RAM needs together) and pair them; Medusa heads if given.
        The engine is a pool's slot alone (opening.open_slots): its generations are tasks of its scheduler, as
        `serve`'s are, which the thread reading a stream turns (no decode thread: see stream)."""
        opened = open_slots(target_path, draft_path, options, settings or GenerationSettings(), 1, medusa_path,
                            medusa_vocab)
        try:
            engine = cls(opened.targets[0], opened.drafts[0], settings, costs, opened.mtps[0], lockstep=opened.lockstep)
            engine.load_heads(medusa_path, medusa_vocab)
        except BaseException:
            opened.close()
            raise
        engine._opened = opened
        return engine

    def load_heads(self, medusa_path: str | os.PathLike | None, medusa_vocab: int | str | os.PathLike | None) -> None:
        """Medusa heads for this engine's target, when a path is given."""
        if medusa_path is not None:
            t = self.target
            self.medusa = Heads.load(medusa_path, t.path, t.n_embd, t.n_vocab, medusa_vocab,
                                     special_ids(t.vocab) if medusa_vocab is not None else ())

    # --- prompts --------------------------------------------------------------------------

    @property
    def auto_policies(self) -> Mapping[tuple[bool, bool], AutoPolicy]:
        """The `auto` policies this engine keeps across generations (read-only), by (with a draft model, with an MTP
        head): each appears when auto_policy() first makes it, before the prefill of the generation that uses it,
        and is replaced when the cost model, draft_max or Medusa's tree (its sizer) changes."""
        return MappingProxyType(self._auto)

    @property
    def n_ctx(self) -> int:
        """The context both models share: the longest prompt plus answer."""
        return min(self.target.n_ctx, self.draft.n_ctx) if self.draft is not None else self.target.n_ctx

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, prompt: Prompt, n_ctx: int | None = None, cancelled: Callable[[], bool] | None = None) -> list[int]:
        """Token ids of a plain prompt, or of chat messages rendered with the GGUF's chat template.

        With `n_ctx`, a prompt that cannot leave room for one token in that context raises ContextLengthError before
        the expensive steps where its size proves it (too many messages, too many bytes), else after tokenizing. A
        chat rendering polls `cancelled` and raises errors.Cancelled when it turns true."""
        if self._closed:  # the vocabulary lives in the freed model
            raise GGUFSpecError("this engine is closed.")
        vocab = self.target.vocab
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.n_vocab]
            if bad:
                raise GGUFSpecError(f"token id {bad[0]} is outside this model's vocabulary of {self.target.n_vocab}.")
            if n_ctx is not None and len(prompt) >= n_ctx:
                raise ContextLengthError.prompt(len(prompt), n_ctx)
            return list(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise GGUFSpecError("the prompt is empty.")
            return vocab.encode(prompt, add_special=True, n_ctx=n_ctx)
        if not prompt:
            raise GGUFSpecError("no chat messages given.")
        return chat_tokens(vocab, self.chat_template, prompt, n_ctx, cancelled)

    # --- generation -----------------------------------------------------------------------

    def generate(self, prompt: Prompt, settings: GenerationSettings | None = None) -> GenerationResult:
        for _ in self.stream(prompt, settings):
            pass
        assert self.last_result is not None
        return self.last_result

    def stream(self, prompt: Prompt, settings: GenerationSettings | None = None, *,
               ahead: bool = False) -> Iterator[GenerationResponse]:
        """Yield a response per committed token, then one with the finish reason and the whole result (also left
        in `last_result`, even when the caller stops early: then with the tokens and text it was given). The
        generation is a task of the scheduler (`spawn`) whose next step runs once the next response is asked for:
        on this thread, turning the scheduler, where no decode thread runs it (a loaded engine's); `ahead`: on the
        decode thread without waiting for this reader (a server's slot, which must not hold the others up; it may
        have run further than a reader that stops early was given). Ctrl-C on the main thread stops the generation,
        a long prefill's batch midway, and is raised here."""
        task = self.spawn(prompt, settings, lazy=not ahead)
        seen: list[GenerationResponse] = []
        try:
            while True:
                with llama_log.interruptible():  # the abort check reads what it holds (on whichever thread decodes)
                    r = task.get(llama_log.interrupt_held)
                if isinstance(r, Ended):
                    if r.error is not None:
                        raise r.error
                    return
                seen.append(r)
                yield r
        finally:
            task.close()
            if not (seen and seen[-1].finish_reason is not None) and self.last_result is not None:
                self.last_result = given(self.last_result, seen)

    def spawn(self, prompt: Prompt, settings: GenerationSettings | None = None,
              put: Callable[[object], None] | None = None, lazy: bool = False) -> Task:
        """The generation of `prompt`, started as a task of the scheduler (Lockstep.spawn: its responses, then an
        Ended, go to `put`, else to the Task; `lazy`: each waits to be asked for, else the decode thread runs it on).
        What it measures first (prepare) is measured now, by the calling thread, on slots of shared contexts, whose
        decodes the scheduler runs; decoders of their own (a target on RPC servers) measure in the task: every decode
        on the thread that runs the tasks (see lockstep.Lockstep)."""
        if self._closed:
            raise GGUFSpecError("this engine is closed.")
        if self.lockstep.on_thread():  # it would wait for itself
            raise GGUFSpecError("a generation cannot start another from the task it runs in.")
        if getattr(self.target, "shared_context", None) is not None:
            self.prepare(settings or self.settings)
        return self.lockstep.spawn(self.steps(prompt, settings), put, lazy)

    def steps(self, prompt: Prompt, settings: GenerationSettings | None = None,
              ) -> Iterator[GenerationResponse | Submission]:
        """stream's responses, and on a pool's slot the submissions its decodes wait on (submission.Steps: the pool's
        decode thread runs it as a task)."""
        if self._closed:
            raise GGUFSpecError("this engine is closed.")
        if not self._lock.acquire(blocking=False):
            raise GGUFSpecError("this engine is already generating (in another thread or stream); use one engine per thread.")
        try:
            yield from self._run(prompt, settings or self.settings)
        finally:
            self._lock.release()

    def describe(self, s: GenerationSettings) -> str:
        """The models and the method, as banners print them: "target.gguf + draft.gguf, method auto"."""
        models = [self.target.path.name, *([self.draft.path.name] if self.draft else []),
                  *(["Medusa heads"] if self.medusa else []), *(["its MTP head"] if self.mtp else [])]
        return f"{' + '.join(models)}, method {self.method_for(s).name}"

    def method_for(self, s: GenerationSettings) -> Method:
        """The method `s` runs on this engine; GGUFSpecError when it needs a model this engine lacks. `mtp` without an
        MTP head runs as `auto` (the load said why: with_mtp)."""
        drafts = self.draft is not None or self.medusa is not None or self.mtp is not None
        name = s.method or ("auto" if drafts else "autoregressive")
        if name == "mtp" and self.mtp is None:
            name = "auto"
        return get_method(name, self.draft is not None, self.medusa is not None)

    def _run(self, prompt: Prompt, s: GenerationSettings) -> Iterator[GenerationResponse | Submission]:
        method = self.method_for(s)
        sources = self._sources(method)
        draft = self.draft if "draft" in sources else None  # other methods leave its context as it is
        mtp = self.mtp if "mtp" in sources else None
        n_ctx = None if s.truncate_prompt else self._n_ctx(draft)
        try:
            tokens = self.encode(prompt, n_ctx)
        except ContextLengthError as e:
            raise ContextLengthError(f"{e} (or allow --truncate-prompt)") from None
        tokens, limit = self._fit(tokens, s, draft)
        verifier, proposers, policy = self._prepare(method, sources, s, draft, mtp)  # before the prefill: auto_policy
        meter = Meter(self.target, (draft, mtp), Stats(prompt_tokens=len(tokens), method=method.name), policy)
        out: list[int] = []
        text = TextStream(s.stop)
        reason: StopReason = "interrupted"
        finished = False
        try:
            reason = "length" if limit < s.max_tokens else "max_tokens"
            stop_ids = set(s.stop_tokens)
            is_stop = lambda tok: self.target.vocab.is_eog(tok) or tok in stop_ids  # noqa: E731
            steps = generate_steps(tokens, verifier, proposers, policy, limit, meter.prefilled)
            with closing(committed(steps, meter.stats, is_stop)) as step_tokens:
                for item in step_tokens:
                    if isinstance(item, Submission):  # a pool slot's decode: the pool's decode thread runs it
                        yield item
                        continue
                    tok, from_draft = item
                    if tok is None:
                        reason = "stop"
                        break
                    out.append(tok)
                    meter.stats.generated_tokens = len(out)
                    yield GenerationResponse(text.push(self.target.vocab.piece(tok)), tok, from_draft, meter.stats)
                    if text.stopped:
                        reason = "stop"
                        break
            tail = text.flush()
            self.last_result = GenerationResult(text.text, out, reason, meter.finish(len(out)))
            finished = True
            yield GenerationResponse(tail, None, False, meter.stats, reason, self.last_result)
        finally:
            if not finished:  # stopped early: by the caller, Ctrl-C or an error
                self.last_result = GenerationResult(text.text, out, "interrupted", meter.finish(len(out)))
            if self.answers is not None:
                self.answers.add(out)

    def prepare(self, s: GenerationSettings) -> Policy:
        """The policy a generation with settings `s` runs, measured now where it needs measuring (`auto`'s costs for a
        longer draft_max than measured, Medusa's tree sizer): a pool's slot calls it on the request's thread before its
        generation starts on the pool's decode thread, which must not wait on ticks of its own."""
        method = self.method_for(s)
        sources = self._sources(method)
        return method.policy(self, s, sources, self.medusa_tree(s) if "medusa" in sources else None)

    def _sources(self, method: Method) -> tuple[str, ...]:
        """The proposers `method` drafts from here: not Medusa's trees on recurrent memory (their tokens would sit in
        several sequences at once), which `auto` then leaves out and `medusa` cannot run without."""
        sources = method.sources(self.draft is not None, self.medusa is not None, self.mtp is not None)
        if "medusa" in sources and self.target.memory.recurrent:
            if method.name == "medusa":
                raise GGUFSpecError(f"Medusa heads propose token trees, which {self.target.path.name}'s "
                                    f"{self.target.memory.value} memory cannot hold: use --method auto, vanilla or "
                                    "lookup.")
            sources = tuple(p for p in sources if p != "medusa")
        return sources

    def _n_ctx(self, draft: LlamaCppDecoder | None) -> int:
        return min(self.target.n_ctx, draft.n_ctx) if draft is not None else self.target.n_ctx

    def _fit(self, tokens: list[int], s: GenerationSettings, draft: LlamaCppDecoder | None) -> tuple[list[int], int]:
        """The prompt cut to the context (a prompt that does not fit gets here only with truncate_prompt: encode
        refuses it otherwise) and the most tokens to generate after it."""
        n_ctx = self._n_ctx(draft)
        if len(tokens) >= n_ctx:
            tokens = tokens[len(tokens) - (n_ctx - min(s.max_tokens, n_ctx // 2)):]
        for d in (self.target, draft) if draft is not None else (self.target,):
            d.shift_keep = min(len(tokens), n_ctx // 4) if s.context_shift else None
        return tokens, s.max_tokens if s.context_shift else min(s.max_tokens, n_ctx - len(tokens))

    def _prepare(self, method: Method, sources: tuple[str, ...], s: GenerationSettings, draft: LlamaCppDecoder | None,
                 mtp: MtpDecoder | None = None) -> tuple[Verifier, dict[str, Proposer], Policy]:
        """This generation's verifier, proposers and policy (one random generator for all: a seed repeats a run)."""
        rng = np.random.default_rng(s.seed)
        tree = self.medusa_tree(s) if "medusa" in sources else None
        leaves = self.target.options.n_seq_max - 1 if method.draft_trees else 0
        # earlier answers only at temperature 0: guesses drawn from them would change which random numbers a sampled
        # run uses, and a seed must repeat a run (its text stays the target's either way)
        answers = self.answers if method.answers and s.sampling.greedy else None
        suppressed = np.array(sorted(self.target.vocab.eog_ids), dtype=np.int64) if s.ignore_eos else None
        setup = Setup(self.target, s.sampling, rng, draft, s.draft_p_min, leaves, self.medusa, tree, answers,
                      suppressed, mtp)
        proposers = {name: PROPOSERS[name].build(setup) for name in sources}
        policy = method.policy(self, s, sources, tree)
        verifier = Verifier(self.target, s.sampling, rng, tree is not None, s.typical, suppressed)
        return verifier, proposers, policy

    def medusa_tree(self, s: GenerationSettings) -> Tree:
        """The tree a Medusa run with settings `s` draws its nodes from: the one named, else the heads' own fitted
        tree, else the default; cut to the heads' depth."""
        own = self.medusa.choices if s.medusa_tree is None else None
        tree = build_tree(own) if own else load_tree(s.medusa_tree)
        return tree.truncated(self.medusa.n_heads) if tree.n_heads > self.medusa.n_heads else tree

    def tree_sizer(self, tree: Tree) -> TreeSizer:
        """Medusa's tree sizer for `tree`, kept across generations; the cost model (this engine's when it has no
        draft, else one measured for the target alone) is measured at first use: call it before the prefill."""
        sizer = self._sizers.get(tree.choices)
        if sizer is None:
            if self.costs is None or self.draft is not None:
                costs = cached_measure(self.target, None, MEDUSA_DENSE_SIZES)
                if self.draft is None:
                    self.costs = costs
            else:
                costs = self.costs
            sizer = self._sizers[tree.choices] = TreeSizer(tree, costs)
        return sizer

    def auto_policy(self, s: GenerationSettings, model: bool, tree: Tree | None, mtp: bool = False) -> AutoPolicy:
        """`auto`'s policy, which keeps what it learned across generations; its first run measures the cost model
        (unless one was given), which resets the contexts: call it before the prefill. With Medusa's `tree` (no
        draft model), the tree's sizer joins it; with `mtp`, the target's MTP head drafts too."""
        sizer = self.tree_sizer(tree) if tree is not None else None  # first: with no draft, it measures self.costs
        if self.costs is None or len(self.costs.verify) < s.draft_max + 1 or (mtp and not self.costs.mtp):
            self.costs = cached_measure(self.target, self.draft if model else None, s.draft_max,
                                        mtp=self.mtp if mtp else None)
        auto = self._auto.get((model, mtp))
        if auto is None or auto.k_max != s.draft_max or auto.costs is not self.costs or auto.sizer is not sizer:
            target = self.target
            auto = self._auto[model, mtp] = AutoPolicy(self.costs, s.draft_max, model, sizer, mtp, self.slot_records,
                                                       peers=lambda: target.peers,
                                                       last_tick=lambda: target.last_tick)
        return auto

    def reset(self) -> None:
        """Empty every KV cache: the next generation prefills from scratch (no prefix reuse)."""
        for d in (self.target, self.draft, self.mtp):
            if d is not None:
                d.reset()

    def close(self) -> None:
        """Free the llama.cpp contexts (the MTP head's before the target's weights it runs)."""
        self._closed = True
        if self._opened is not None:  # the shared contexts too, and the scheduler
            self._opened.close()
            return
        if self._own_lockstep:  # first: no generation decodes any more
            self.lockstep.close()
        if self.mtp is not None:
            self.mtp.close()
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def given(result: GenerationResult, seen: list[GenerationResponse]) -> GenerationResult:
    """`result`, of a generation its reader stopped early, as far as the reader was given it (the generation may
    have run further: its stats count what ran)."""
    tokens = [r.token for r in seen if r.token is not None]
    if tokens == result.tokens[: len(tokens)] and len(tokens) < len(result.tokens):
        return replace(result, text="".join(r.text for r in seen), tokens=tokens, stop_reason="interrupted")
    return result
