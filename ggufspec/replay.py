"""Replay drafting policies on recorded greedy text, priced by this machine's cost model.

A trace holds a prompt, the target's greedy continuation and the draft's greedy guess after every
position (one teacher-forced draft pass). At temperature 0 a draft chain is kept exactly as long as
those guesses match the continuation, so any policy can be replayed without decoding again. The
per-step oracle, which knows each step's outcome, shows how much any policy choosing among the same
proposals could still gain: the headroom left to a better policy rather than a better draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .bench import BenchPrompt
from .costs import CostModel
from .engine import GenerationSettings, SpeculativeEngine
from .methods import METHODS
from .policy.auto import AutoPolicy
from .proposers import NO_DRAFT, Context, Counters, Draft
from .proposers.lookup import LookupProposer
from .verifier import Verdict

# the methods that draft with a draft model or lookup (or not at all), and the per-step oracle
# what a recording of the draft model's guesses can price: not Medusa's heads, nor an MTP head (neither recorded)
POLICIES = tuple(m.name for m in METHODS.values() if m.needs in (None, "draft")) + ("oracle",)


@dataclass
class Trace:
    category: str
    prompt_len: int
    tokens: list[int]  # prompt, then the target's greedy continuation
    guess: list[int]  # guess[i]: the draft's argmax after tokens[: i + 1]


@dataclass
class Replay:
    """Totals of one policy over some traces: modelled seconds, tokens and target passes."""

    seconds: float = 0.0
    tokens: int = 0
    passes: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


def record(engine: SpeculativeEngine, prompts: Iterable[BenchPrompt], max_tokens: int,
           progress: Callable[[int], None] | None = None) -> list[Trace]:
    """The target's greedy continuation of each prompt and the draft's guesses along it (fresh contexts).

    The continuation is decoded with vanilla speculation, for speed: the target's greedy text up to
    batch-kernel near-ties (see the README's promise section).
    """
    if engine.draft is None:
        raise ValueError("replay needs a draft model")
    traces = []
    for p in prompts:
        prompt = engine.encode(p.prompt)
        engine.reset()
        out = engine.generate(p.prompt, GenerationSettings(method="vanilla", max_tokens=max_tokens, draft_max=3))
        tokens = prompt + out.tokens
        engine.reset()
        logits = engine.draft.feed(tokens, all_logits=True, view=True)[:, : engine.target.n_vocab]
        traces.append(Trace(p.category, len(prompt), tokens, logits.argmax(axis=-1).tolist()))
        engine.reset()
        if progress:
            progress(1)
    return traces


def kept(proposal: list[int], tokens: list[int], t: int) -> int:
    """How many of the proposed tokens at position t the target's greedy decoding keeps."""
    n = 0
    while n < len(proposal) and t + n < len(tokens) and proposal[n] == tokens[t + n]:
        n += 1
    return n


def replay(traces: Iterable[Trace], costs: CostModel, policy: str, k: int, max_tokens: int) -> Replay:
    """Price every step of `policy` (one of POLICIES) with draft length k over the traces."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    lookup = LookupProposer(n_vocab=0)
    auto = AutoPolicy(costs.copy(), k, model=True) if policy == "auto" else None
    total = Replay()
    for tr in traces:
        guesses = _Guesses(tr.guess)
        if auto is not None:
            auto.begin(tr.tokens[: tr.prompt_len], {"lookup": lookup, "draft": guesses})
        t, end = tr.prompt_len, min(len(tr.tokens), tr.prompt_len + max_tokens)
        if t < end:  # the first token, from the prompt's pass (the prefill: not priced, as a generation's stats)
            total.tokens, total.passes, t = total.tokens + 1, total.passes + 1, t + 1
        while t < end:
            room = min(k, end - t - 1)  # as the engine does: never draft past the token limit
            model = [tr.guess[i] if i < len(tr.guess) else -1 for i in range(t - 1, t - 1 + room)]
            options = {  # proposal, draft decodes it costs
                "autoregressive": ([], 0),
                "vanilla": (model, room),
                "lookup": (lookup.find(tr.tokens[:t], room) if room else [], 0),
            }
            if policy == "oracle":
                rate = lambda o: (kept(o[0], tr.tokens, t) + 1) / _cost(costs, *o)  # noqa: E731
                proposal, decodes = max(options.values(), key=rate)
            elif auto is not None:  # its lookup may guess further than k where the text copies itself
                plan = auto.plan(Context(tr.tokens[:t]), end - t, 0)
                draft = {"lookup": lookup, "draft": guesses}[plan.source].propose(Context(tr.tokens[:t]), plan.k) \
                    if plan.source else NO_DRAFT
                proposal, decodes = draft.tokens, len(draft.tokens) if plan.source == "draft" else 0
            else:
                proposal, decodes = options[policy]
            n_kept = kept(proposal, tr.tokens, t)
            if auto is not None:
                verdict = Verdict(tr.tokens[t : t + n_kept + 1], len(proposal), 0.0, len(proposal) + 1, 0)
                auto.observe(plan, draft, verdict, None)
            total.seconds += _cost(costs, proposal, decodes)
            total.tokens += min(n_kept + 1, end - t)
            total.passes += 1
            t += n_kept + 1
    return total


class _Guesses:
    """The draft model, replayed: its recorded guesses along the trace (right until the first miss)."""

    name = "draft"

    def __init__(self, guess: list[int]) -> None:
        self.guess = guess
        self.counters = Counters()

    def propose(self, context: Context, k: int, plan_nodes=None) -> Draft:
        t = len(context.tokens)
        return Draft([self.guess[i] if i < len(self.guess) else -1 for i in range(t - 1, t - 1 + k)])

    def unseen(self, context: list[int]) -> int:
        return 0  # a replay has no draft context to catch up on


def _cost(costs: CostModel, proposal: list[int], decodes: int) -> float:
    return costs.batch_seconds(len(proposal) + 1) + decodes * costs.draft


def replay_table(traces: list[Trace], costs: CostModel, k: int, max_tokens: int) -> list[tuple[str, str, Replay, float]]:
    """(category, policy, totals, speedup over autoregressive) per category and for all traces."""
    rows = []
    groups = sorted({tr.category for tr in traces})
    for cat in groups + (["all"] if len(groups) > 1 else []):
        subset = [tr for tr in traces if cat in ("all", tr.category)]
        base = replay(subset, costs, "autoregressive", k, max_tokens).tokens_per_s
        for policy in POLICIES:
            r = replay(subset, costs, policy, k, max_tokens)
            rows.append((cat, policy, r, r.tokens_per_s / base if base else float(np.nan)))
    return rows
