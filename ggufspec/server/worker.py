"""The engine's worker: one thread runs each request's whole job (chat template, tokenizer, generation) in turn.

Everything a request costs runs here, so the queue bounds it and /slots shows it: a request is admitted (429 past
`1 + queue`), waits its turn, has its prompt rendered and tokenized under the bounds of `SpeculativeEngine.encode`,
then generates. A job whose client leaves stops at its next token (or its rendering stops within 50 ms); a job the
server's shutdown cuts ends with a last response, so its stream gets a final chunk.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..engine import GenerationResponse, GenerationSettings, Prompt, SpeculativeEngine
from .api import APIError

RETRY_AFTER_SECONDS = 1
STALL_SECONDS = 300.0  # a job with no token and no llama.cpp batch for this long: /health reports the engine stuck


@dataclass
class Admitted:
    """A job's first event when its prompt fits: `prompt_tokens` tokens; its generation's responses follow."""

    prompt_tokens: int


Event = Admitted | GenerationResponse | Exception | None  # None: the job is over


@dataclass(eq=False)
class Job:
    """One request's work; its events cross from the worker thread to the event loop."""

    prompt: Prompt
    settings: GenerationSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)  # its client left, or the server stops
    cut: bool = False  # stopped by the server's shutdown: answered, not dropped

    def put(self, item: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    """Runs jobs on the engine one at a time, in arrival order; admits at most 1 + `queue` at once."""

    def __init__(self, engine: SpeculativeEngine, queue: int) -> None:
        self.engine = engine
        self.capacity = 1 + queue
        self.active = 0  # admitted and not finished; changed on the event loop only
        self.jobs: set[Job] = set()
        self.running: Job | None = None
        self.phase = "idle"  # idle | prompt (template and tokenizer) | generating
        self.n_decoded = 0  # tokens the running (or last) job committed
        self.n_completed = self.n_cancelled = 0
        self.closing = False
        self._beat, self._batches = time.monotonic(), 0  # the last sign of progress, and the batches run then
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ggufspec-engine")

    def submit(self, prompt: Prompt, settings: GenerationSettings) -> Job:
        if self.closing:
            raise APIError(503, "the server is shutting down", code="server_shutting_down", kind="server_error")
        if self.active >= self.capacity:
            raise APIError(429, f"the server is busy: {self.active} requests are running or queued "
                                f"(--queue {self.capacity - 1}); retry later", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        loop = asyncio.get_running_loop()
        job = Job(prompt, settings, loop)
        self.active += 1
        self.jobs.add(job)
        future = loop.run_in_executor(self._executor, self._run, job)
        future.add_done_callback(lambda _: self._done(job))
        return job

    def _done(self, job: Job) -> None:
        self.active -= 1
        self.jobs.discard(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left, or the server stops, while it waited
            self.n_cancelled += 1
            job.put(APIError(503, "the server is shutting down", code="server_shutting_down", kind="server_error")
                    if job.cut else None)
            job.put(None)
            return
        self.running, self.phase, self.n_decoded = job, "prompt", 0
        self._progress()
        stream, finished = None, False
        try:
            tokens = self.engine.encode(job.prompt, self.engine.n_ctx, job.cancelled.is_set)
            job.put(Admitted(len(tokens)))
            self.phase = "generating"
            stream = self.engine.stream(tokens, job.settings)
            for r in stream:
                self._progress()
                job.put(r)
                self.n_decoded += r.token is not None
                if r.finish_reason is not None:
                    finished = True
                    break
                if job.cancelled.is_set():
                    break
        except Exception as e:  # GGUFSpecError: the request's fault; anything else is answered as a server error
            job.put(e)
        finally:
            if stream is not None:
                stream.close()  # leaves the partial result in engine.last_result
            self.running, self.phase = None, "idle"
            self._progress()
        if finished:
            self.n_completed += 1
        elif job.cancelled.is_set():
            self.n_cancelled += 1
            result = self.engine.last_result
            if job.cut and stream is not None and result is not None:
                job.put(GenerationResponse("", None, False, result.stats, "interrupted", result))
        job.put(None)

    def _batches_run(self) -> int:
        return self.engine.target.n_decodes + (self.engine.draft.n_decodes if self.engine.draft else 0)

    def _progress(self) -> None:
        self._beat, self._batches = time.monotonic(), self._batches_run()

    def stalled_for(self) -> float:
        """Seconds the running job has shown no progress (0 when idle): no event from it, and no llama.cpp batch
        run since the last event or the last call of this method that saw one."""
        if self.running is None:
            return 0.0
        if self._batches_run() != self._batches:
            self._progress()
        return time.monotonic() - self._beat

    def cut_all(self) -> None:
        """The server is stopping: refuse new jobs, end queued ones with 503 and the running one at its next token
        with its text so far (thread-safe: called from a signal handler)."""
        self.closing = True
        for job in list(self.jobs):
            job.cut = True
            job.cancelled.set()

    def shutdown(self) -> None:
        """Stop every job (the running one at its next token) and wait for the worker thread."""
        self.cut_all()
        self._executor.shutdown(wait=True)
