"""The engine's worker: N threads (one per slot of the EnginePool, `serve --parallel N`) each run a request's whole
job (chat template, tokenizer, generation), taking jobs in arrival order.

Everything a request costs runs here, so the queue bounds it and /slots shows it: a request is admitted (429 past
`N + queue`), waits for a free thread (first come, first served), has its prompt rendered and tokenized under the
bounds of `SpeculativeEngine.encode` (before it takes a slot: a slow template holds no slot), then takes the slot
whose cache shares the longest prefix with it and generates, its decodes batched with the other slots' (continuous
batching, see pool.py and lockstep.py). A job whose client leaves stops at its next token, freeing its slot (or its
rendering stops within 50 ms), or while queued leaves the queue at once, freeing its place; a job the server's
shutdown cuts ends with a last response, so its stream gets a final chunk.

One code path: `--parallel 1` is a pool of one slot, and a bare SpeculativeEngine is wrapped as one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine import GenerationResponse, GenerationResult, GenerationSettings, Prompt, SpeculativeEngine
from ..errors import RPCError
from ..pool import EnginePool, Slot
from .api import APIError

RETRY_AFTER_SECONDS = 1
STALL_SECONDS = 300.0  # a job with no token and no llama.cpp batch for this long: /health reports the engine stuck

Phase = Literal["queued", "prompt", "generating", "done"]


@dataclass
class Admitted:
    """A job's first event when its prompt fits: `prompt_tokens` tokens; its generation's responses follow."""

    prompt_tokens: int


Event = Admitted | GenerationResponse | Exception | None  # None: the job is over


@dataclass(eq=False)
class Job:
    """One request's work; its events cross from its worker thread to the event loop."""

    prompt: Prompt
    settings: GenerationSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)  # its client left, or the server stops
    cut: bool = False  # stopped by the server's shutdown: answered, not dropped
    phase: Phase = "queued"  # queued (admitted, no thread yet) | prompt (template, tokenizer) | generating | done
    slot: Slot | None = None  # while generating
    beat: float = 0.0  # the last sign of progress (time.monotonic())
    batches: int = 0  # the slot's llama.cpp batches run then
    finished: bool = False  # counted, and its place given back (Worker._finish): set by its thread
    released: bool = False  # no longer admitted (Worker._done): set on the event loop

    def put(self, item: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


def as_pool(engine: EnginePool | SpeculativeEngine) -> EnginePool:
    """The pool a worker runs on: a SpeculativeEngine alone is a pool of one slot, on its own scheduler."""
    return engine if isinstance(engine, EnginePool) else EnginePool([Slot(0, engine)], engine.lockstep)


class Worker:
    """Runs jobs on the pool's N slots, up to N at once, starting them in arrival order; admits at most
    N + `queue` at once (running or waiting)."""

    def __init__(self, engine: EnginePool | SpeculativeEngine, queue: int) -> None:
        self.pool = as_pool(engine)
        self.engine = self.pool.engine  # slot 0's: what all slots share (vocabulary, template, n_ctx per slot)
        self.parallel = self.pool.parallel
        self.queue = queue
        self.capacity = self.parallel + queue
        self.active = 0  # admitted and not finished; changed on the event loop only
        self.jobs: set[Job] = set()  # admitted and not finished; changed on the event loop only
        self.n_completed = self.n_cancelled = 0
        self.closing = False
        self._lock = threading.Lock()  # the running jobs and the counts, changed by the worker threads
        self._running: list[Job] = []  # in their order of start
        self._executor = ThreadPoolExecutor(self.parallel, thread_name_prefix="ggufspec-slot")

    # --- admission --------------------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, settings: GenerationSettings) -> Job:
        if self.closing:
            raise APIError(503, "the server is shutting down", code="server_shutting_down", kind="server_error")
        if self.active >= self.capacity:
            raise APIError(429, f"the server is busy: {self.active} requests are running or queued "
                                f"(--parallel {self.parallel}, --queue {self.queue}); retry later",
                           code="rate_limit_exceeded", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        loop = asyncio.get_running_loop()
        job = Job(prompt, settings, loop)
        self.active += 1
        self.jobs.add(job)
        future = loop.run_in_executor(self._executor, self._run, job)  # the executor's queue: first come, first run
        future.add_done_callback(lambda _: self._done(job))
        return job

    def _done(self, job: Job) -> None:
        """The job no longer counts against admission (on the event loop; once)."""
        if not job.released:
            job.released = True
            self.active -= 1
            self.jobs.discard(job)

    def abandon(self, job: Job) -> bool:
        """Its client left (on the event loop): a job still queued leaves the queue at once, its place given back
        and its handler told (None); True then. False when a thread has it already: that thread stops it (at its
        next token, or its rendering within 50 ms) once it sees `job.cancelled`."""
        with self._lock:
            if job.phase != "queued" or job.finished:
                return False
            job.finished, job.phase = True, "done"
            self.n_cancelled += 1
        self._done(job)
        job.events.put_nowait(None)
        return True

    # --- one job, in a worker thread ------------------------------------------------------------------------------

    def _claim(self, job: Job) -> bool:
        """Take a queued job for this thread: True when it is to run. A job that left the queue (`abandon`) is
        dropped; one cancelled while it waited (the server stops) is ended here, a shutdown's with a 503."""
        with self._lock:
            if job.finished:
                return False
            if not job.cancelled.is_set():
                job.phase = "prompt"
                self._running.append(job)
                return True
        self._finish(job, cancelled=True)
        job.put(APIError(503, "the server is shutting down", code="server_shutting_down", kind="server_error")
                if job.cut else None)
        job.put(None)
        return False

    def _run(self, job: Job) -> None:
        if not self._claim(job):
            return
        self._progress(job)
        started = answered = False  # answered: its last response or its error is on its way
        result: GenerationResult | None = None
        try:
            # rendered and tokenized before the job takes a slot, for the slots' context (n_ctx // N each)
            tokens = self.engine.encode(job.prompt, self.engine.n_ctx, job.cancelled.is_set)
            job.put(Admitted(len(tokens)))
            with self.pool.slot(tokens) as slot:
                job.slot, job.phase = slot, "generating"
                self._progress(job)
                started = True
                try:
                    with closing(self.pool.run(slot, tokens, job.settings, job.cancelled.is_set)) as responses:
                        for r in responses:  # the generation runs on the pool's decode thread, whatever this one does
                            self._progress(job)
                            if r.finish_reason is not None:
                                self._finish(job, completed=True)
                                answered = True
                            job.put(r)
                finally:
                    result = slot.engine.last_result  # before another job takes the slot
        except Exception as e:  # GGUFSpecError: the request's fault; anything else is answered as a server error
            if isinstance(e, RPCError):
                self.remote_failure()  # reconnects in the background as soon as the servers answer again
            self._finish(job, cancelled=job.cancelled.is_set())
            answered = True
            job.put(e)
        finally:
            # a no-op when it ended above; else it stopped at its next token because its client left, or because the
            # server's shutdown cut it (it then gets a final response below)
            self._finish(job, cancelled=True)
            job.slot = None
        if job.cut and started and not answered and result is not None:
            job.put(GenerationResponse("", None, False, result.stats, "interrupted", result))
        job.put(None)

    def _finish(self, job: Job, completed: bool = False, cancelled: bool = False) -> None:
        """Once per job, before its client can see its end (its last response, its error): count it, take it off
        /slots, and give its place back to admission. So a client that sends its next request as soon as it has
        its answer finds it counted and its place free, while this thread still closes the generation."""
        with self._lock:
            if job.finished:
                return
            job.finished, job.phase = True, "done"
            self.n_completed += completed
            self.n_cancelled += cancelled and not completed
            if job in self._running:
                self._running.remove(job)
        job.loop.call_soon_threadsafe(self._done, job)

    # --- what /slots and /health read ----------------------------------------------------------------------------

    def running(self) -> list[Job]:
        """The jobs that have a thread (rendering or generating), in their order of start."""
        with self._lock:
            return list(self._running)

    @property
    def n_queued(self) -> int:
        """Admitted jobs waiting for a thread."""
        return max(0, self.active - len(self.running()))

    def slots(self) -> list[dict[str, Any]]:
        """Each slot's state, by id: the job generating in it, else a job still rendering its prompt (shown on a
        free slot until it takes one: it will, as there are as many threads as slots), else idle. The counts are
        those of the slot's current or last generation."""
        running = [(job, job.slot) for job in self.running()]  # each read once: the threads change them
        by_slot = {slot.id: job for job, slot in running if slot is not None}
        rendering = [job for job, slot in running if slot is None and job.phase == "prompt"]
        out = []
        for slot in sorted(self.pool.slots, key=lambda s: s.id):
            job = by_slot.get(slot.id)
            if job is None and not slot.busy and rendering:
                job = rendering.pop(0)
            state = job.phase if job is not None and job.phase in ("prompt", "generating") else "idle"
            out.append({"id": slot.id, "n_ctx": slot.engine.n_ctx, "is_processing": state != "idle", "state": state,
                        "n_prompt_tokens": slot.prompt_tokens, "n_decoded": slot.generated_tokens,
                        "n_drafts_kept": slot.drafts_kept})
        return out

    def _batches_run(self, job: Job) -> int:
        """The llama.cpp batches the job's slot has taken part in (none while it renders its prompt)."""
        slot = job.slot
        if slot is None:
            return 0
        e = slot.engine
        return e.target.n_decodes + (e.draft.n_decodes if e.draft else 0)

    def _progress(self, job: Job) -> None:
        job.beat, job.batches = time.monotonic(), self._batches_run(job)

    def stalled_for(self) -> float:
        """Seconds the most stuck running job has shown no progress (0 when none runs): no event from it, and no
        llama.cpp batch of its slot run since its last event or the last call of this method that saw one."""
        worst = 0.0
        for job in self.running():
            if self._batches_run(job) != job.batches:
                self._progress(job)
            worst = max(worst, time.monotonic() - job.beat)
        return worst

    def remote_failure(self) -> str | None:
        """Why the target's RPC servers cannot serve now, or None. While they cannot, it waits in the background
        for them to answer again, then loads the models on them again (isolated.DecoderProcess.recover)."""
        process = getattr(self.engine.target, "process", None)
        failure = process.failure if process is not None else None
        if failure is None:
            return None
        process.recover_when_back()
        return f"{failure}; reconnecting as soon as they answer again"

    # --- shutdown ------------------------------------------------------------------------------------------------

    def cut_all(self) -> None:
        """The server is stopping: refuse new jobs, end queued ones with 503 and the running ones at their next
        token with their text so far (thread-safe: called from a signal handler)."""
        self.closing = True
        for job in list(self.jobs):
            job.cut = True
            job.cancelled.set()

    def shutdown(self) -> None:
        """Stop every job (the running ones at their next token) and wait for the worker threads."""
        self.cut_all()
        self._executor.shutdown(wait=True)
