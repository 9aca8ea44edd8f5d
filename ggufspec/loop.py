"""The generation loop: prefill, then per step a plan, a proposal, one target pass, and what it committed.

Reads like mlx-lm's `speculative_generate_step`; every method is this loop with other proposers and another policy.
In a pool's slot it also yields each Submission its decodes wait on (submission.Steps: the pool's decode thread runs
every slot's generation so, one batch per tick); on contexts of their own, only verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from copy import copy

from .policy import Policy, Timing
from .proposers import NO_DRAFT, Context, Counters, Proposer
from .submission import Submission
from .verifier import Verdict, Verifier


def generate_steps(
    prompt: list[int], verifier: Verifier, proposers: dict[str, Proposer], policy: Policy, limit: int,
    prefilled: Callable[[], None] = lambda: None,
) -> Iterator[Verdict | Submission]:
    """Yield what each target pass commits, at most `limit` tokens in all; `prefilled` is called once the prompt is
    in the caches. The first token comes from the prompt's pass (its last row), as llama-server's does; each pass
    after it decodes the previous pick, so every position is decoded once."""
    warm = policy.begin(prompt, proposers)
    if limit <= 0:
        return
    first = yield from verifier.first_steps(prompt)
    for name, proposer in proposers.items():
        yield from proposer.begin_steps(prompt, name in warm)
    prefilled()
    yield first
    last, hidden = first.tokens[-1], first.hidden  # hidden: the target's state at the row that picked `last`
    limit -= 1
    while limit > 0:
        state = Context.after(verifier.history, last, hidden)
        plan = policy.plan(state, limit, verifier.deferred)
        proposer = proposers.get(plan.source) if plan.source else None
        before = copy(proposer.counters) if proposer is not None else None
        draft = (yield from proposer.propose_steps(state, plan.k, plan.nodes)) if proposer is not None else NO_DRAFT
        verdict = yield from verifier.verify_steps(last, draft)
        if proposer is not None:
            proposer.accept(verdict.kept)
        timing = _timing(verdict, proposer.counters if proposer is not None else None, before)
        policy.observe(plan, draft, verdict, timing)
        yield verdict
        last, hidden = verdict.tokens[-1], verdict.hidden
        limit -= len(verdict.tokens)


def _timing(verdict: Verdict, after: Counters | None, before: Counters | None) -> Timing:
    """What a step cost: the verifier's pass (the whole batch it rode in: its seconds are that batch's), and the
    proposer's work between its counters before and after."""
    tokens = max(verdict.batched, verdict.batch)
    if after is None or before is None:
        return Timing(verdict.seconds, tokens, batch=verdict.shape)
    decodes = after.decodes - before.decodes
    return Timing(verdict.seconds, tokens, after.seconds - before.seconds, decodes, after.decoded - before.decoded,
                  after.batched - before.batched, verdict.shape, after.tick if decodes else -1)
