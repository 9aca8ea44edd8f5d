"""Timing this machine's batches: measure() (one sequence's batches, a draft token, the MTP head's steps, recurrent
checkpoints) and measure_together() (a batch of every slot's tokens, as a pool's steps run)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ..decoder import Decoder, LlamaCppDecoder
from ..lockstep import Lockstep
from .table import CostModel

# Long batches measured for prompt lookup's long guesses (where the text copies its context): the draft
# lengths they hold are one less. At most llama.cpp's CPU micro-batch (decoder.CPU_UBATCH), so one pass.
LONG_BATCHES = (16, 32, 64)
# The MTP head's catch-up batch measure() times: the committed tokens of a few steps (its price per token is what
# `auto` charges for text the head has not read)
MTP_CATCH_UP = 16
measure_clock = time.perf_counter  # measure()'s timer: a module attribute, so that a test can make it noisy


def measure(target: LlamaCppDecoder, draft: Decoder | None, k_max: int, repeats: int = 5,
            long_sizes: Sequence[int] = LONG_BATCHES, long_repeats: int = 2,
            mtp: Decoder | None = None) -> tuple[CostModel, float]:
    """Time target batches of 1..k_max+1 tokens (and of `long_sizes` that fit), a draft token and the MTP head's (a
    step, and a batch catching up on MTP_CATCH_UP tokens) after a short context, and on recurrent memory each model's
    checkpoint (saved and restored: hold); resets them all (a pool's batches of every slot's tokens: measure_together).

    Rounds interleave all sizes, so a busy spell hits every one; each time is the fastest round's (long
    batches take part in the first `long_repeats` rounds: each costs as much as many short ones).
    Also returns the spread (slowest / fastest round, worst short size): large when the machine was busy.
    """
    ctx = list(range(100, 132))
    decoders = [target] + [d for d in (draft, mtp) if d is not None]  # the target first: the head reads its rows
    for d in decoders:
        d.sync(ctx)
        d.hold(anchor=True)  # recurrent memory: every round's rollback returns to this checkpoint
        d.feed([7])  # warm-up
        d.rollback_to(len(ctx))
    room = min(target.n_ctx - len(ctx) - 1, target.options.micro_batch)  # one micro-batch, inside the context
    longs = [n for n in long_sizes if k_max + 1 < n <= room]
    # (decoder, tokens, with every token's logits, long): the drafters' tokens cost a fraction of the target's batches:
    # every round, after the short sizes
    short = [(target, n, True) for n in range(1, k_max + 2)] + ([(draft, 1, True)] if draft is not None else [])
    if mtp is not None:
        short += [(mtp, 1, True), (mtp, MTP_CATCH_UP, False)]
    sizes = [(*size, False) for size in short] + [(target, n, True, True) for n in longs]
    times: list[list[float]] = [[] for _ in sizes]
    holds: dict[int, list[float]] = {id(d): [] for d in decoders if _recurrent(d)}
    for r in range(repeats):
        for (d, n, every, long), out in zip(sizes, times):
            if long and r >= long_repeats:
                continue
            t0 = measure_clock()
            d.feed(list(range(200, 200 + n)), all_logits=every)
            out.append(measure_clock() - t0)
            d.rollback_to(len(ctx))
        for d in decoders:
            if id(d) in holds:
                holds[id(d)].append(_hold_seconds(d, len(ctx)))
    for d in decoders:
        d.rollback_to(0)
    best = [min(t) for t in times]
    spread = max(max(t) / min(t) for t in times[: k_max + 1 + (draft is not None)])
    model = CostModel(best[: k_max + 1], best[k_max + 1] if draft is not None else 0.0, longs, best[len(short):],
                      hold=min(holds.get(id(target), [0.0])), snapshots=getattr(target, "n_rs_seq", 0),
                      draft_hold=min(holds.get(id(draft), [0.0])))
    if mtp is not None:
        model.mtp, model.mtp_catch_up = best[len(short) - 2], best[len(short) - 1] / MTP_CATCH_UP
    return model, spread


def _recurrent(d: Decoder) -> bool:
    """Whether d's memory has a recurrent state (whose rollbacks may need checkpoints)."""
    memory = getattr(d, "memory", None)
    return memory is not None and memory.recurrent


def _hold_seconds(d: Decoder, base: int) -> float:
    """Seconds d takes to save a checkpoint of its recurrent state and to restore it, after `base` tokens (held)."""
    d.feed([9])
    before = d.hold_seconds
    d.hold()  # a new point (base + 1): saved
    d.feed([10])
    d.rollback_to(base + 1)  # a decode of one token: restored from that checkpoint
    seconds = d.hold_seconds - before
    d.rollback_to(base)
    return seconds


def measure_together(lockstep: Lockstep, views: Sequence[LlamaCppDecoder], widths: Sequence[int],
                     repeats: int = 3) -> list[float]:
    """Seconds for one batch of w tokens in each of `views`' sequences (slots of one shared context: the shape a
    pool's steps run in), for each w in `widths`, the fastest of `repeats`, after a short context; resets them.
    measure() times one sequence's tokens, which llama.cpp runs in other kernels than several sequences' as many:
    neither a batch's price nor how it grows with the chains carries over from one to the other. Each view feeds
    from a thread
    of its own (a member of `lockstep`), so their decodes meet in one tick, on the lockstep's decode thread. A
    view's error is raised here, once every thread has stopped."""
    ctx = list(range(100, 132))
    times: dict[int, list[float]] = {w: [] for w in widths}
    together = threading.Barrier(len(views))
    errors: list[BaseException] = []

    def slot(v: LlamaCppDecoder) -> None:
        # a member waiting at the barrier would hold back a tick another thread waits on: each waits only where no
        # thread has a decode pending (and each feed's tick has every member's)
        try:
            v.sync(ctx)
            v.hold(anchor=True)  # recurrent memory: each rollback returns to this checkpoint
            together.wait()
            with lockstep.member():
                together.wait()
                for _ in range(repeats):
                    for w in widths:
                        before = v.decode_seconds
                        v.feed(list(range(200, 200 + w)))
                        if v is views[0]:
                            times[w].append(v.decode_seconds - before)  # the whole batch's seconds
                        v.rollback_to(len(ctx))
                        together.wait()
            v.rollback_to(0)
        except BaseException as e:  # the others stop at the barrier (BrokenBarrierError) rather than wait for ever
            errors.append(e)
            together.abort()

    threads = [threading.Thread(target=slot, args=(v,)) for v in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [min(times[w]) for w in widths]
