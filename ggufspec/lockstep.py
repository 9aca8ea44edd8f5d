"""`Lockstep`: generations that share llama.cpp contexts decode together, one batch per context per tick.

Each sequence (a slot: one request's generation) runs the ordinary engine loop on decoders that are views of shared
contexts (LlamaCppDecoder.slots; a single stream's engine is one such slot). A view's decode is a `Submission`.
Generations are tasks (`spawn`) of the lockstep's one decode thread, which scheduler-like runs each until it yields
the submission it waits on (the decode coroutines: `Steps`), then every context's pending submissions as ONE
llama_decode per context, then each task on: the target verifies every slot's proposal in one batch, the draft model
decodes every slot's draft position in one batch, a joining prompt's chunk rides along with the others' steps, and
the loop, the verifier and the proposers do not know that they share (continuous batching, as llama-server's
`update_slots`, with no second code path). A thread may also take part as a member (`member()`, `submit`: cost
measurements, tests), its decodes waiting for the tick that runs them.

Rules: every use of a shared context (decodes, KV sequence edits) holds `lock`; a submission's rows are views of its
batch's outputs, read (or copied: Decoder.feed's view=False) before its slot decodes again, as on a context of its
own: no other slot's batch in that context runs before then.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .submission import BatchShape, Runner, Steps, Submission


class LockstepSlot:
    """A sequence of a context that several slots may share through a Lockstep (the target's decoder, the MTP head):
    `_seq`, its sequence id, and `_lockstep`, None on a context of its own, are set by the subclass."""

    _seq: int
    _lockstep: Lockstep | None

    @property
    def lane(self) -> int:
        """This sequence's id in its context (a slot's: its index in `lanes`)."""
        return self._seq

    @property
    def peers(self) -> int:
        """Other slots generating in this shared context now (0 on a context of its own)."""
        return self._lockstep.others() if self._lockstep is not None else 0

    @property
    def last_tick(self) -> int:
        """The number of the last batch run in this shared context (BatchShape.tick; -1 on a context of its own)."""
        return self._lockstep.n_ticks - 1 if self._lockstep is not None else -1


class DecodeSteps:
    """Default decode coroutines for a decoder whose decodes never wait on a tick (a context of its own, a child
    process's): each runs the plain call. A slot of a shared context defines its own (sequence.KvSequence)."""

    def feed_steps(self, tokens: Sequence[int], all_logits: bool = True, view: bool = False,
                   picks: bool = False) -> Steps[np.ndarray]:
        return self.feed(tokens, all_logits, view)
        yield  # never reached: a generator that waits on nothing

    def picks(self, n_rows: int) -> np.ndarray | None:
        return None  # never worked out with the batch: the reader takes each row's argmax

    def sync_steps(self, tokens: Sequence[int], view: bool = False) -> Steps[np.ndarray]:
        return self.sync(tokens, view)
        yield

    def rollback_steps(self, n: int) -> Steps[None]:
        self.rollback_to(n)
        return
        yield

    def tree_logits_steps(self, tokens: Sequence[int], parents: Sequence[int]) -> Steps[np.ndarray]:
        return self.tree_logits(tokens, parents)
        yield


class Ended:
    """A task's last output: how it ended (an exception for its reader to raise, or None)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Task:
    """A generation the scheduler runs (Lockstep.spawn): `get` reads what its coroutine yields besides submissions,
    in order, then an Ended (with its exception, if any); close() stops it at its next item.

    An eager task runs on without waiting for its reader (a pool's slot never holds the others up); a `lazy` one
    makes its next output only once its reader asks for it (`get`), as a Python generator would: a reader that stops
    after k outputs has what the generation made, and no more ran. Paused so, it takes no part in the ticks."""

    def __init__(self, steps: Iterator[Any], lockstep: Lockstep, put: Callable[[Any], None] | None = None,
                 lazy: bool = False) -> None:
        """`put`: where its outputs go (its own queue, which `get` reads, when None)."""
        self.steps, self.lockstep, self.lazy = steps, lockstep, lazy
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # unbounded: the decode thread never waits for a reader
        self.put = put or self.out.put
        self.waiting: Submission | None = None  # the submission its coroutine waits on
        self.paused = lazy  # lazy: before its first output is asked for, and after each until the next is
        self.wanted = False  # lazy: its reader asked for the next output
        self.closing = False
        self.ended = threading.Event()

    def get(self, stop: Callable[[], bool], poll: float = 0.1) -> Any:
        """Its next output (an Ended last); once `stop()` turns true while waiting (checked every `poll` seconds: Ctrl-C
        held for the main thread, llama_log.interrupt_held), it is closed and an Ended comes back."""
        lockstep = self.lockstep
        if self.lazy:
            self.wanted = True  # (before `threaded` is read: a decode thread started since turns it at once)
            if lockstep._runner is not None:
                lockstep._wake()
        while True:
            if lockstep._runner is not None:
                try:
                    return self.out.get(timeout=poll)
                except queue.Empty:
                    pass
            elif not self.out.empty():  # else this thread turns the scheduler
                return self.out.get_nowait()
            if stop():
                self.close()
                return Ended()
            if lockstep._runner is None and not lockstep.turn_alone(self):
                lockstep._turn_or_sleep(poll, lambda: not self.out.empty())

    def close(self) -> None:
        """Stop the generation at its next item (its coroutine closed on the decode thread: its cleanup runs there,
        between decodes) and wait until it has stopped."""
        if not self.ended.is_set():
            self.closing = True
            self.lockstep._wake()
            while not self.lockstep.threaded and not self.ended.is_set():  # this thread turns the scheduler
                self.lockstep._turn_or_sleep(0.01, self.ended.is_set)
            self.ended.wait()


@dataclass
class _Tick:
    """The submissions waiting for the next run, per context."""

    pending: dict[int, tuple[Runner, list[Submission]]] = field(default_factory=dict)

    @property
    def waiting(self) -> int:
        """Members waiting on this tick: one submission each."""
        return sum(len(subs) for _, subs in self.pending.values())


class Lockstep:
    """The scheduler of a set of shared contexts: the one thread that decodes for them, runs its tasks (a pool's
    generations) between ticks, and meets the member threads' submissions.

    Drafts first: while any task or member waits on a `leads` runner (the draft model's context), a tick runs only
    those, and the others' submissions wait for the next. So every slot's verification meets the others' in one
    target batch however many tokens each drafted, as llama-server's loop drafts for every slot and then decodes one
    batch. Otherwise a slot drafting k tokens verifies out of step with the others, alone in a batch of its own.

    Every tick runs on that thread: with llama.cpp's OpenMP build, a decode from another thread than the one that
    decoded before runs at about half speed, so no decode may run on a member's own thread. The tasks' Python runs
    there too, one after another: no slot waits for another's thread to be scheduled, nor for the interpreter.

    The decode thread starts with the first eager task (a pool's slot, which no reader drives) or `start()` (a pool,
    before it measures: every decode on that one thread). Until then the threads that wait on the scheduler turn it
    themselves (`threaded` False: a single stream's reader, which waits for each response anyway, and its cost
    measurements): the same tasks and ticks, with no hand-over between threads. A task that is all the scheduler runs
    (a single stream's) has each submission run at once, as a tick of its own (no member or other task could join
    it), and its reader turns it without a turn's bookkeeping (`turn_alone`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # members wait here for their tick to run (a submission wakes the decode thread only when it completes a tick)
        self._ticked = threading.Condition(self.lock)
        # the decode thread sleeps here when no tick is complete; wakers set the flag (a wake-up is never lost). Not
        # on `lock`, which the decode thread takes again at once each turn: a thread waiting for it would starve
        self._woken = threading.Condition(threading.Lock())
        self._wake_flag = False
        self._inbox: list[Task] = []  # tasks spawned, not yet running (appended under _woken's lock)
        self._members = 0
        self.held = 0  # slots held by a generation (EnginePool.slot), members or about to be
        self._tick = _Tick()
        self._local = threading.local()
        self._runner: threading.Thread | None = None
        self._tasks: list[Task] = []
        self._current: Task | None = None  # the task the decode thread is running on
        self._closed = False  # the decode thread ends once its tasks have
        self.n_ticks = 0  # ticks run
        self.decode_seconds = 0.0  # every tick's batches, all contexts: the rest of a busy pool's time is the slots'

    @property
    def threaded(self) -> bool:
        """Whether the decode thread runs the ticks (else the waiting threads turn the scheduler themselves)."""
        return self._runner is not None

    def start(self) -> None:
        """Run the ticks on the decode thread from now on."""
        with self.lock:
            self._start()

    def on_thread(self) -> bool:
        """Whether the calling thread runs a task now (the decode thread, or one turning the scheduler)."""
        return threading.current_thread() is self._runner or getattr(self._local, "turning", False)

    def close(self) -> None:
        """Stop: every task closes at its next output (a paused one at once), then the decode thread ends; returns
        once it has, so that its contexts may be freed. Nothing may be spawned or submitted after."""
        self._closed = True
        for task in [*self._tasks, *self._inbox]:
            task.closing = True
        self._wake()
        if self.on_thread():
            return
        if self._runner is not None:
            self._runner.join()
        while self._tasks or self._inbox:  # no decode thread: their cleanup runs here
            self._turn_or_sleep(0.01, lambda: not (self._tasks or self._inbox))

    def others(self) -> int:
        """Generations taking part now (tasks and member threads), the calling one aside; or, where more, the other
        slots held (EnginePool.slot): requests that arrive together begin before the others take part."""
        tasks = len(self._tasks) + len(self._inbox) - (self._current is not None)
        return max(tasks + self._members - (getattr(self._local, "depth", 0) > 0), self.held - 1)

    @contextmanager
    def member(self) -> Iterator[None]:
        """The calling thread takes part while inside: ticks wait for its submissions (re-entrant)."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self.lock:
                self._members += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self.lock:
                    self._members -= 1
                self._wake()  # the decode thread may have waited for this member only

    def submit(self, runner: Runner, sub: Submission) -> Submission:
        """Queue `sub` for `runner`'s next batch and wait until it has run; `sub` comes back with its results."""
        if self.on_thread():  # it would wait for itself
            raise RuntimeError("a task's decode is yielded (a submission.Steps coroutine), not submitted")
        if self._closed:  # no decode thread would run it
            raise RuntimeError("this lockstep is closed")
        with self.member():
            with self.lock:
                self._queue(runner, sub)
                if self.threaded:
                    if self._complete():
                        self._wake()
                    while not sub.done:
                        self._ticked.wait()
            while not sub.done:  # no decode thread: this thread turns the scheduler
                self._turn_or_sleep(0.01, lambda: sub.done)
        return sub

    def spawn(self, steps: Iterator[Any], put: Callable[[Any], None] | None = None, lazy: bool = False) -> Task:
        """Run `steps` (a generation: it yields the submissions it waits on, and its outputs) on the decode thread,
        every tick beside the other tasks and members; its outputs, then an Ended, go to `put` (else read them from
        the Task). `lazy`: each output waits until its reader asks for it (Task.get)."""
        if self._closed:
            raise RuntimeError("this lockstep is closed")
        task = Task(steps, self, put, lazy)
        with self._woken:
            self._inbox.append(task)
        self._wake()
        if not lazy and self._runner is None:  # no reader turns the scheduler for it (once running, the decode
            with self.lock:  # thread holds `lock` nearly always: no wait for it)
                self._start()
        return task

    def _wake(self) -> None:
        """Wake the decode thread (or keep it from sleeping): something changed."""
        with self._woken:
            self._wake_flag = True
            self._woken.notify()

    def _advance(self) -> None:
        """Run each task whose submission has run (or that has not started) until it waits on its next one; a task
        that ends, fails or is closing (at its next output) leaves."""
        for task in list(self._tasks):
            if task.waiting is not None:
                if not task.waiting.done:
                    continue
                task.waiting = None
            elif task.paused:
                if not (task.wanted or task.closing):
                    continue
                task.paused = task.wanted = False
            self._step(task)

    def _step(self, task: Task) -> None:
        """Run `task` until it waits on a submission, gives an output (and pauses there, lazy), or ends."""
        self._current = task
        try:
            if task.closing and task.waiting is None:  # (a lazy task, paused at an output)
                task.steps.close()
                self._end(task, None)
                return
            for item in task.steps:
                if isinstance(item, Submission):
                    if self._runner is None and self._alone(task):
                        self._run_alone(item)  # nothing could join its tick (a single stream's): it runs now
                        continue
                    task.waiting = item
                    self._queue(item.runner, item)
                    return
                if task.closing:
                    task.steps.close()
                    self._end(task, None)
                    return
                task.put(item)
                if task.lazy:
                    task.paused = True
                    return
            self._end(task, None)
        except BaseException as e:  # the reader raises it
            self._end(task, e)
        finally:
            self._current = None

    def _alone(self, task: Task) -> bool:
        """Whether `task` is all this scheduler runs: no decode thread, member, other task or waiting submission (a
        single stream's)."""
        return (self._runner is None and not self._members and not self._inbox and not self._tick.pending
                and len(self._tasks) == 1 and self._tasks[0] is task)

    def turn_alone(self, task: Task) -> bool:
        """A lone lazy task's turn (_alone), on the thread that reads it: on to its next output, without a turn's
        bookkeeping; False (nothing run) where it is not alone, or not paused at an output."""
        with self.lock:
            if not (task.paused and task.waiting is None and self._alone(task)):
                return False
            task.paused = task.wanted = False
            self._local.turning = True
            try:
                self._step(task)
            finally:
                self._local.turning = False
        return True

    def _end(self, task: Task, error: BaseException | None) -> None:
        self._tasks.remove(task)
        task.put(Ended(error))
        task.ended.set()

    def _queue(self, runner: Runner, sub: Submission) -> None:
        entry = self._tick.pending.setdefault(id(runner), (runner, []))
        entry[1].append(sub)

    def _start(self) -> None:
        if self._runner is None:
            self._runner = threading.Thread(target=self._run_ticks, name="ggufspec-decode", daemon=True)
            self._runner.start()

    def _run_ticks(self) -> None:
        """The decode thread: turn the scheduler; sleep until woken where no tick was complete."""
        while True:
            ready = self._turn()
            if self._closed and not self._tasks:  # (close: every task closes at its next output)
                return
            if not ready:
                with self._woken:
                    while not self._wake_flag:
                        self._woken.wait()

    def _turn(self) -> bool:
        """Run the tasks on, then the tick where every task and every member waits on it (holding the lock
        meanwhile); whether it ran."""
        with self._woken:
            self._wake_flag = False
            self._tasks += self._inbox
            self._inbox.clear()
        with self.lock:
            self._local.turning = True
            try:
                self._advance()  # every task left waits on one submission of this tick
                ready = self._tick.waiting > 0 and self._complete()
                if ready:
                    self._run_tick(self._tick)
                    self._advance()  # on to their next submissions (or outputs) at once
            finally:
                self._local.turning = False
        return ready

    def _turn_or_sleep(self, timeout: float, done: Callable[[], bool]) -> None:
        """A waiting thread's turn of the scheduler (no decode thread runs it); where no tick was complete and what
        it waits for is not `done()`, a sleep until something changes (or `timeout` seconds)."""
        if not self._turn() and not done():
            with self._woken:
                if not self._wake_flag:
                    self._woken.wait(timeout)

    def _complete(self) -> bool:
        """Whether every member waits on the next tick (under `lock`): its submissions but the tasks' are theirs
        (after _advance, every task but a paused one waits on one)."""
        return self._tick.waiting - sum(not t.paused for t in self._tasks) >= self._members

    def _run_tick(self, tick: _Tick) -> None:
        """Run the tick's batches, one per context (drafts first), and mark their submissions done."""
        leading = {k: e for k, e in tick.pending.items() if e[0].leads}
        running = leading or tick.pending  # drafts first: the rest wait for a tick with no drafts
        self._tick = _Tick({k: e for k, e in tick.pending.items() if k not in running})
        try:
            for runner, subs in running.values():
                self._run_batch(runner, subs)
            self.n_ticks += 1
        finally:
            for _, subs in running.values():
                for s in subs:
                    s.done = True
            self._ticked.notify_all()

    def _run_alone(self, sub: Submission) -> None:
        """A lone task's submission, as a tick of its own (_alone: no member waits on it)."""
        try:
            self._run_batch(sub.runner, [sub])
            self.n_ticks += 1
        finally:
            sub.done = True

    def _run_batch(self, runner: Runner, subs: list[Submission]) -> None:
        """One context's batch of this tick: its submissions' shape and seconds (rc -1 where it failed)."""
        t0 = time.perf_counter()
        shape: tuple[int, ...] = ()  # the whole batch as it ran: per sequence, pads included
        try:
            shape = tuple(runner.run(subs))
        except Exception:  # the submissions keep rc -1: each member raises its decode's error
            pass
        seconds = time.perf_counter() - t0
        self.decode_seconds += seconds
        batch = BatchShape(shape, self.n_ticks)
        for s in subs:
            s.seconds, s.shape = seconds, batch

