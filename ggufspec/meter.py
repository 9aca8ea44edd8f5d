"""A generation's bookkeeping around the loop: the tokens each step commits, up to a stop token (`committed`), and
its clocks (`Meter`): wall time around the prefill and the steps, both models' time in llama.cpp, a spinner while a
long prompt is decoded, and `auto`'s decision for the stats line."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from .decoder import LlamaCppDecoder
from .mtp import MtpDecoder
from .policy import Policy
from .stats import Stats
from .submission import Submission
from .verifier import Verdict
from .waiting import Wait


def committed(steps: Iterator[Verdict | Submission], stats: Stats, is_stop: Callable[[int], bool],
              ) -> Iterator[tuple[int | None, bool] | Submission]:
    """Each step's tokens, and whether a draft proposed it (steps counted in `stats`); None at a stop token. The
    submissions a pool's slot waits on pass through (loop.generate_steps)."""
    try:
        for step in steps:
            if isinstance(step, Submission):
                yield step
                continue
            stats.record(step.drafted, len(step.tokens) - 1)
            for i, tok in enumerate(step.tokens):
                if is_stop(tok):
                    yield None, False
                    return
                yield tok, i < len(step.tokens) - 1
    finally:
        steps.close()


class Meter:
    """A generation's clocks: wall time around the prefill and the steps, and both models' decode time; a spinner
    on a terminal while a long prompt is decoded (waiting); the policy's decision, in the stats at the end."""

    def __init__(self, target: LlamaCppDecoder, drafters: tuple, stats: Stats, policy: Policy | None = None) -> None:
        self.target, self.drafters, self.stats, self.policy = target, drafters, stats, policy
        self.t0, self.decoded0 = time.perf_counter(), target.n_decoded_tokens
        self.target0 = self.draft0 = 0.0
        process = getattr(target, "process", None)  # isolated.DecoderProcess: a target on RPC servers
        stats.rpc_round_trip_ms = process.round_trip * 1e3 if process is not None else 0.0
        self.wait = Wait(f"decoding the prompt, {stats.prompt_tokens} tokens").start()

    def prefilled(self) -> None:
        self.wait.stop()
        st = self.stats
        st.prefill_seconds = time.perf_counter() - self.t0
        st.prefill_tokens = self.target.n_decoded_tokens - self.decoded0
        st.cached_tokens = max(0, st.prompt_tokens - st.prefill_tokens)
        self.target0, self.draft0 = busy(self.target), sum(map(busy, self.drafters))

    def finish(self, generated: int) -> Stats:
        self.wait.stop()
        st = self.stats
        st.generated_tokens = generated
        decision = getattr(self.policy, "decision", None)  # auto's: what it drafted from, or why nothing
        st.decision = decision() if decision is not None else ""
        if st.prefill_seconds:
            st.generation_seconds = time.perf_counter() - self.t0 - st.prefill_seconds
            st.target_seconds = busy(self.target) - self.target0
            st.draft_seconds = sum(map(busy, self.drafters)) - self.draft0
        return st


def busy(d: LlamaCppDecoder | MtpDecoder | None) -> float:
    """A decoder's seconds in llama.cpp: its decodes, and its checkpoints on recurrent memory."""
    return d.decode_seconds + d.hold_seconds if d is not None else 0.0
