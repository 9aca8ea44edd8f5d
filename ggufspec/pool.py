"""`EnginePool`: N slots, each a `SpeculativeEngine` over its own sequences of shared target and draft contexts,
generating side by side (continuous batching with speculation; see lockstep.py).

Each generation runs the ordinary engine loop as a task of the lockstep's one decode thread, which runs every slot's
step on until it waits on a decode, then one target batch (or one draft batch) for all of them: a scheduler step
over every slot, as llama-server's `update_slots`. Each prompt's text is what it gets alone on one engine: each slot
has a KV stream of its own (docs/exactness.md)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace

from .costs import LONG_BATCHES, CostModel, cached_measure, measure_together
from .decoder import DecoderOptions, LlamaCppDecoder
from .history import common_prefix
from .engine import GenerationResponse, GenerationSettings, Prompt, SpeculativeEngine
from .errors import GGUFSpecError
from .lockstep import Ended, Lockstep
from .opening import Opened, open_slots
from .policy.shared import SlotRecords
from .proposers import AnswerPool

MAX_SLOTS = 256  # llama.cpp's LLAMA_MAX_SEQ: a slot is a KV sequence
SLOT_WIDTHS = (1, 2, 3)  # a plain step of every slot, and every slot verifying 1 or 2 drafts (follow pricing)


@dataclass
class Slot:
    """One slot: its engine and what it is doing, for /slots."""

    id: int
    engine: SpeculativeEngine
    busy: bool = False
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafts_kept: int = 0


def _measure(lockstep: Lockstep, targets: list[LlamaCppDecoder], drafts: list, mtps: list, draft_max: int) -> CostModel:
    """The cost model of a pool of len(targets) slots: one slot's batches (cached_measure), and where there are
    several, the batches the slots run together."""
    parallel = len(targets)
    # also the batches of every slot's token and of two each (a plain step and one draft each), the sizes a pool's
    # steps run: interpolated between measured sizes their price is off (the curve is not smooth), and what their
    # batches taught would bend a neighbouring size's price
    sizes = sorted({*LONG_BATCHES, parallel, 2 * parallel})
    costs = cached_measure(targets[0], drafts[0], draft_max, sizes, mtp=mtps[0])
    if parallel > 1:  # and as the slots run them: 1 to 3 tokens of every slot, and the draft model's batch of every
        # slot's draft token (SharedBatch prices following slots so)
        costs = replace(costs, slots=parallel, slot_verify=measure_together(lockstep, targets, SLOT_WIDTHS))
        if drafts[0] is not None:
            costs.draft_sizes, costs.draft_batches = [parallel], measure_together(lockstep, drafts, (1,))
        if mtps[0] is not None:  # every slot's MTP step in one batch
            costs.mtp_sizes, costs.mtp_batches = [parallel], measure_together(lockstep, mtps, (1,))
    return costs


class EnginePool:
    """`parallel` slots over one target context (and one draft context): up to `parallel` generations at once."""

    def __init__(self, slots: list[Slot], lockstep: Lockstep, opened: Opened | None = None) -> None:
        """`slots`' engines generate on `lockstep`; `opened`: their shared contexts, freed by close."""
        self.slots, self.lockstep, self._opened = slots, lockstep, opened
        self._free = threading.Condition()
        self._closed = False

    @classmethod
    def load(cls, target_path: str | os.PathLike, draft_path: str | os.PathLike | None = None,
             options: DecoderOptions | None = None, settings: GenerationSettings | None = None,
             medusa_path: str | os.PathLike | None = None, medusa_vocab: int | str | os.PathLike | None = None,
             costs: CostModel | None = None, parallel: int = 4) -> EnginePool:
        """Open the models (checked as SpeculativeEngine.load checks them) as `parallel` slots sharing one context
        each; options.n_ctx is the whole cache (as llama-server's -c), each slot holds n_ctx // parallel tokens.
        The cost model `auto` prices steps with is measured (or read from the cache) here, before any slot runs."""
        if not 1 <= parallel <= MAX_SLOTS:
            raise GGUFSpecError(f"--parallel must be between 1 and {MAX_SLOTS}, got {parallel}")
        if parallel > 1 and medusa_path is not None:
            raise GGUFSpecError("Medusa's trees need KV sequences of their own, which slots of a shared context do not "
                                "have: serve Medusa heads with --parallel 1.")
        if parallel > 1 and options is not None and options.remote:
            raise GGUFSpecError("a target on RPC servers (--rpc) serves one request at a time for now: use "
                                "--parallel 1.")
        settings = settings or GenerationSettings()
        opened = open_slots(target_path, draft_path, options, settings, parallel, medusa_path, medusa_vocab)
        opened.lockstep.start()  # every decode on its decode thread, the measurements' too (see lockstep.Lockstep)
        try:
            targets, drafts, mtps = opened.targets, opened.drafts, opened.mtps
            if costs is None:  # measured by one slot alone, now: later, the other slots' batches would ride along
                costs = _measure(opened.lockstep, targets, drafts, mtps, settings.draft_max)
            answers = AnswerPool()  # one for every slot: an answer in one slot drafts for the next request in any
            records = SlotRecords()  # every slot's drafters' records by lane: following slots price all
            engines = [SpeculativeEngine(t, d, settings, costs, m, answers, records, opened.lockstep)
                       for t, d, m in zip(targets, drafts, mtps)]
            for e in engines:
                e.load_heads(medusa_path, medusa_vocab)
        except BaseException:
            opened.close()
            raise
        if parallel > 1:  # the target's uneven chains are padded to one length where that costs less
            targets[0].pad_chains(costs.micro_seconds, settings.draft_max + 1)
        return cls([Slot(i, e) for i, e in enumerate(engines)], opened.lockstep, opened)

    @property
    def parallel(self) -> int:
        return len(self.slots)

    @property
    def engine(self) -> SpeculativeEngine:
        """Slot 0's engine: for what all slots share (vocabulary, metadata, encode, n_ctx)."""
        return self.slots[0].engine

    @contextmanager
    def slot(self, tokens: list[int] | None = None, timeout: float | None = None) -> Iterator[Slot]:
        """A free slot, held inside: the one whose cache holds at least half of `tokens` as a prefix, the most of
        them (llama-server's slot similarity: a conversation's next turn), else the lowest-numbered. Low numbers
        first keep the busy slots' KV streams consecutive, which llama.cpp batches together (it splits a batch
        into micro-batches of consecutive sequence ids). Waits for one (TimeoutError past `timeout`)."""
        tokens = tokens or []
        with self._free:
            if not self._free.wait_for(lambda: self._closed or any(not s.busy for s in self.slots), timeout):
                raise TimeoutError("no slot came free")
            if self._closed:
                raise GGUFSpecError("this engine pool is closed.")
            free = [s for s in self.slots if not s.busy]  # by id
            shared = {s.id: common_prefix(s.engine.target.history, tokens) for s in free}
            best = max(free, key=lambda s: shared[s.id])
            slot = best if tokens and 2 * shared[best.id] >= len(tokens) else free[0]
            slot.busy = True
            self.lockstep.held += 1
        try:
            yield slot
        finally:
            with self._free:
                slot.busy = False
                self.lockstep.held -= 1
                self._free.notify()

    def run(self, slot: Slot, tokens: list[int], settings: GenerationSettings | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> Iterator[GenerationResponse]:
        """Generate in `slot`: the generation runs on the pool's decode thread beside the other slots' (a task of the
        lockstep), its responses come here as they are made. Stops at the next token once `cancelled()` is true, or
        once the caller closes this iterator."""
        slot.prompt_tokens, slot.generated_tokens, slot.drafts_kept = len(tokens), 0, 0
        with closing(slot.engine.stream(tokens, settings, ahead=True)) as responses:
            for r in responses:
                slot.generated_tokens += r.token is not None
                slot.drafts_kept += r.from_draft
                yield r
                if r.finish_reason is not None or cancelled():
                    break

    def stream_many(self, prompts: Iterable[Prompt], settings: GenerationSettings | None = None,
                    ) -> Iterator[tuple[int, GenerationResponse | Exception]]:
        """Generate every prompt, up to `parallel` at once; yield (its index, a response) as each token comes,
        and each generation's last response (finish_reason set) once; a prompt that fails yields (index, the
        error) and the others go on. Closing the iterator stops them all at their next token."""
        events: queue.Queue = queue.Queue()  # unbounded: a slot never waits for the consumer
        stop = threading.Event()
        todo = queue.Queue()
        for item in enumerate(prompts):
            todo.put(item)
        n = todo.qsize()

        def worker() -> None:
            while not stop.is_set():
                try:
                    i, prompt = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    tokens = self.engine.encode(prompt, self.engine.n_ctx)
                    with self.slot(tokens) as slot:  # its responses go to `events` straight from the decode thread
                        task = slot.engine.spawn(tokens, settings, lambda item, i=i: events.put((i, item)))
                        while not task.ended.wait(0.05):
                            if stop.is_set():
                                task.close()
                except Exception as e:  # this prompt's failure: reported, the others go on
                    events.put((i, e))

        threads = [threading.Thread(target=worker, name=f"ggufspec-slot-{k}", daemon=True)
                   for k in range(min(self.parallel, n))]
        for t in threads:
            t.start()
        done = 0
        try:
            while done < n:
                i, r = events.get()
                if isinstance(r, Ended):  # after its last response; or its error
                    if r.error is None:
                        continue
                    if not isinstance(r.error, Exception):
                        raise r.error
                    r = r.error
                done += isinstance(r, Exception) or r.finish_reason is not None
                yield i, r
        finally:
            stop.set()
            for t in threads:
                t.join()

    def close(self) -> None:
        """Free the shared contexts (after the generations end)."""
        with self._free:
            self._closed = True
            self._free.notify_all()
        self.lockstep.close()  # every generation stops first
        for s in self.slots:
            s.engine.close()
        if self._opened is not None:
            self._opened.close()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
