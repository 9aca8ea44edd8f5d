"""How many tokens to draft: a cost model measured on this machine, and the acceptance seen so far.

On CPUs the target's cost for a batch of n tokens is far from n times one token, and it depends
on the CPU as much as on the weight type (llama.cpp repacks Q4_0 and Q8_0 for small batches: a
4-token batch measured here at 1.6 decodes on one machine and 2.6 on an AVX2-only one), so the
best draft length is found by measuring, not assumed.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp

from .decoder import Decoder, LlamaCppDecoder, common_prefix
from .drafters import Draft, LookupDrafter, ModelDrafter

PROBE_EVERY = 16  # plain steps before the first probe while speculation is off; doubled after each failed one
PROBE_EVERY_MAX = 128
OPTIMISTIC = 0.9  # probes are made only if drafts kept this often would beat plain decoding
# by this factor: a probe costs a bigger batch and the draft catching up on every token since its last
# use (measured on an AVX-512 machine here: probes at a 12% optimistic gain made `auto` 8% slower)
PROBE_GAIN = 1.2
MIN_GAIN = 1.05  # drafting only when expected to beat plain decoding by this factor
# Costs are learned per context size: up to this many cached tokens, twice as many, four times... (past 256
# cached tokens llama.cpp's CPU flash attention decodes a batch with other kernels than one token: measured
# on the Xeon here, a 4-token batch cost 1.29 decodes after 32 tokens of context and 1.89 after 500)
CONTEXT_SIZE = 256


@dataclass
class CostModel:
    """verify[n-1]: seconds for the target to decode n tokens with all logits; draft: one draft token."""

    verify: list[float]
    draft: float

    @staticmethod
    def expected_tokens(k: int, acceptance: float | Sequence[float]) -> float:
        """Tokens a step with k drafts commits; acceptance[i]: chance draft i is kept once judged
        (a single number: the same at every position)."""
        a = [acceptance] * k if isinstance(acceptance, (int, float)) else acceptance[:k]
        tokens = kept = 1.0
        for x in a:  # plain Python: called several times a step, where numpy's call overhead would show
            kept *= x
            tokens += kept
        return tokens

    def step_seconds(self, k: int, free: bool = False) -> float:
        """Drafting k tokens (free: they cost nothing, as prompt lookup's) and verifying them."""
        return k * (0.0 if free else self.draft) + self.verify[min(k, len(self.verify) - 1)]

    def expected_rate(self, k: int, acceptance: float | Sequence[float], free: bool = False) -> float:
        """Committed tokens per second with k drafts."""
        return self.expected_tokens(k, acceptance) / self.step_seconds(k, free)

    def best_k(self, acceptance: float | Sequence[float], k_max: int, k_min: int = 0, free: bool = False) -> int:
        return max(range(k_min, k_max + 1), key=lambda k: self.expected_rate(k, acceptance, free))

    def observe(self, n_verify: int, verify_s: float, draft_decodes: int, draft_s: float, weight: float = 0.2) -> None:
        """Move toward what one step really cost: the batch size seen at `weight`, the others at half of it
        (after a plain step: every size and the draft at `weight`), the draft at `weight` per decode.

        A model measured while the machine was busy (or cached from another load) corrects itself in use.
        Plain steps scale every cost alike: they slow down as the context grows (the draft's too), and
        taking that as batches or drafts getting relatively cheaper would switch drafting on where it
        does not pay.
        """
        if verify_s > 0:
            n = min(n_verify, len(self.verify)) - 1
            ratio = verify_s / self.verify[n]
            others = weight if n == 0 else weight / 2
            self.verify = [v * ratio ** (weight if i == n else others) for i, v in enumerate(self.verify)]
            if n == 0 and not draft_decodes:
                self.draft *= ratio ** weight
        if draft_decodes:
            self.draft += (1 - (1 - weight) ** draft_decodes) * (draft_s / draft_decodes - self.draft)


class ContextCosts:
    """A CostModel per context size (up to CONTEXT_SIZE cached tokens, up to twice that, ...), each
    learning from the steps taken at its size: a batch attends to the whole context, so what a long
    prompt teaches must not price a short one. A size first used starts from the next smaller one."""

    def __init__(self, base: CostModel) -> None:
        self.base = base
        self._by_size: dict[int, CostModel] = {0: base}

    def at(self, n_ctx: int) -> CostModel:
        size = (max(n_ctx - 1, 0) // CONTEXT_SIZE).bit_length()
        if size not in self._by_size:
            smaller = self._by_size[max(s for s in self._by_size if s < size)]
            self._by_size[size] = CostModel(list(smaller.verify), smaller.draft)
        return self._by_size[size]


def measure(target: Decoder, draft: Decoder | None, k_max: int, repeats: int = 5) -> tuple[CostModel, float]:
    """Time target batches of 1..k_max+1 tokens and one draft token after a short context; resets both.

    Rounds interleave all sizes, so a busy spell hits every one; each time is the fastest round's.
    Also returns the spread (slowest / fastest round, worst size): large when the machine was busy.
    """
    ctx = list(range(100, 132))
    decoders = [target] + ([draft] if draft is not None else [])
    for d in decoders:
        d.sync(ctx)
        d.feed([7])  # warm-up
        d.rollback_to(len(ctx))
    sizes = [(target, n) for n in range(1, k_max + 2)] + ([(draft, 1)] if draft is not None else [])
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for (d, n), out in zip(sizes, times):
            t0 = time.perf_counter()
            d.feed(list(range(200, 200 + n)))
            out.append(time.perf_counter() - t0)
            d.rollback_to(len(ctx))
    for d in decoders:
        d.rollback_to(0)
    best = [min(t) for t in times]
    spread = max(max(t) / min(t) for t in times)
    return CostModel(best[: k_max + 1], best[k_max + 1] if draft is not None else 0.0), spread


MAX_SPREAD = 1.5  # a measurement noisier than this is used for this run but not cached


def costs_path() -> Path:
    return Path(os.environ.get("GGUFSPEC_CACHE", Path.home() / ".cache" / "ggufspec")) / "costs.json"


def cached_measure(target: LlamaCppDecoder, draft: LlamaCppDecoder | None, k_max: int) -> CostModel:
    """measure(), remembered per model files, thread settings, CPU and llama.cpp build in
    ~/.cache/ggufspec/costs.json (a home shared by different machines must not share their costs)."""
    path = costs_path()
    key = json.dumps([_identity(target), _identity(draft) if draft else None, k_max, machine()])
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return CostModel(**table[key])
    model, spread = measure(target, draft, k_max)
    if spread > MAX_SPREAD:
        return model
    table[key] = asdict(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return model


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "cpu family", ...); empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}


@functools.cache
def machine() -> str:
    """What sets batch costs besides the model: the CPU (name, family, model) and llama.cpp's build and features.

    Three CPUs seen here priced a 4-token batch at 1.6, 2.3 and 2.6 single-token decodes."""
    cpu = [platform.machine(), platform.processor()]
    fields = cpu_info()
    if fields:
        cpu += [fields.get(k, "") for k in ("model name", "cpu family", "model")]
    return " | ".join(cpu + [llama_cpp.__version__, llama_cpp.llama_print_system_info().decode(errors="replace").strip()])


def _identity(d: LlamaCppDecoder) -> list[object]:
    st = d.path.stat()
    o = d.options
    return [str(d.path), st.st_size, int(st.st_mtime), o.n_threads, o.n_threads_batch, o.n_gpu_layers, o.flash_attn,
            d.kv_type, sorted(d.weight_buffers)]  # where the weights went: repacked or not costs batches differently


class FixedLength:
    """Always draft k tokens (the drafter may stop earlier)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass


class AdaptiveLength:
    """Pick k each step to maximise expected tokens per second, drafting only for a gain of at least
    MIN_GAIN; k = 0 turns speculation off.

    Acceptance is a running average per draft position (a draft that got its first token right
    tends to get the next one right too), carried from one generation to the next but pulled
    halfway back to the prior at each start, so every prompt gets a fair try. While off, a probe
    at the best non-zero length keeps the estimates alive: after PROBE_EVERY plain steps, twice
    as long after each probe that did not pay for itself. A probe costs a bigger batch and a draft
    catching up, so none is made when even good drafts would gain little (on CPUs where a batch of
    4 costs ~2.6 decodes, as on the AVX2-only machines here, the best case is a few percent).
    """

    def __init__(self, costs: CostModel, k_max: int, prior: float = 0.7, memory: float = 0.95,
                 target: LlamaCppDecoder | None = None, draft: LlamaCppDecoder | None = None,
                 free: bool = False) -> None:
        self.costs, self.k_max, self.memory, self.prior, self.free = costs, k_max, memory, prior, free
        self.acceptance = [prior] * k_max
        self._off_steps, self._probe_every, self._probing = 0, PROBE_EVERY, False
        self._clocks = (target, draft)  # their decode counters time each step for costs.observe
        self._start = (0.0, 0, 0.0, 0, 0)

    def restart(self) -> AdaptiveLength:
        """Ready for the next generation: keep what was learned, acceptance halfway back to the prior."""
        self.acceptance = [(a + self.prior) / 2 for a in self.acceptance]
        return self

    def _read_clocks(self) -> tuple[float, int, float, int, int]:
        """Target seconds and tokens decoded; draft seconds, decodes and tokens."""
        target, draft = self._clocks
        t = (target.decode_seconds, target.n_decoded_tokens) if target else (0.0, 0)
        if draft is None:
            return *t, 0.0, 0, 0
        return *t, draft.decode_seconds, draft.n_decodes, draft.n_decoded_tokens

    def planned(self) -> int:
        """The length choose() would pick now, probes aside; no side effects."""
        k = self.costs.best_k(self.acceptance, self.k_max, free=self.free)
        rate = self.costs.expected_rate
        if k and rate(k, self.acceptance, self.free) < MIN_GAIN * rate(0, 0):
            k = 0  # at break-even the estimate's noise decides, and a wrong guess costs more than it earns
        return k

    def choose(self) -> int:
        self._start = self._read_clocks()
        k = self.planned()
        self._probing = False
        if k == 0:
            self._off_steps += 1
            if self._off_steps >= self._probe_every and self._worth_probing():
                self._off_steps, self._probing = 0, True
                return self.costs.best_k(self.acceptance, self.k_max, k_min=1, free=self.free)
        return k

    def _worth_probing(self) -> bool:
        k = self.costs.best_k(OPTIMISTIC, self.k_max, free=self.free)
        rate = self.costs.expected_rate
        return k > 0 and rate(k, OPTIMISTIC, self.free) >= PROBE_GAIN * rate(0, 0)

    def update(self, drafted: int, accepted: int) -> None:
        # tokens after the first rejection were never judged: they say nothing about acceptance
        for i in range(min(drafted, accepted + 1, self.k_max)):
            self.acceptance[i] = self.memory * self.acceptance[i] + (1 - self.memory) * (i < accepted)
        c = self.costs
        spent = c.step_seconds(drafted, self.free)
        if self._clocks[0] is not None:
            (t0, b0, d0, n0, k0), (t1, b1, d1, n1, k1) = self._start, self._read_clocks()
            spent = (t1 - t0) + (d1 - d0)  # what the step really cost, the draft's catching up included
            # a draft catching up on many tokens in one batch says little about one draft step
            steps = n1 - n0 if k1 - k0 <= n1 - n0 + 1 else 0
            # the batch the target decoded: deferred tokens (see commit_tree_path) may ride in front of the drafts
            c.observe(b1 - b0 or drafted + 1, t1 - t0, steps, d1 - d0)
        if self._probing:  # back off unless the probe itself beat plain steps
            paid = (accepted + 1) * c.verify[0] >= spent
            self._probe_every = PROBE_EVERY if paid else min(2 * self._probe_every, PROBE_EVERY_MAX)


class AutoDrafter:
    """`auto`: prompt lookup when the text repeats itself and verifying its guess pays, else the draft
    model when drafting pays, else a plain step; a Drafter and its own DraftLength.

    Each source keeps its own acceptance, and lookup's guesses cost no draft decodes, so lookup can
    pay on a machine where the draft model cannot.
    """

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter | None, costs: CostModel, k_max: int,
                 target: LlamaCppDecoder | None = None, draft: LlamaCppDecoder | None = None) -> None:
        self.lookup, self.model, self.k_max = lookup, model, k_max
        self.context_costs = ContextCosts(costs)
        self.lookup_length = AdaptiveLength(costs, k_max, free=True, target=target)
        self.model_length = AdaptiveLength(costs, k_max, target=target, draft=draft) if model is not None else None
        self.draft = draft
        self.source: AdaptiveLength | None = None  # whose proposal the target is judging

    @property
    def costs(self) -> CostModel:
        """The cost model measured at start-up (short context)."""
        return self.context_costs.base

    def price_at(self, n_ctx: int) -> None:
        """Price the next steps at the costs learned for a context of n_ctx tokens."""
        for length in (self.lookup_length, self.model_length):
            if length is not None:
                length.costs = self.context_costs.at(n_ctx)

    def restart(self) -> AutoDrafter:
        for length in (self.lookup_length, self.model_length):
            if length is not None:
                length.restart()
        return self

    def choose(self) -> int:
        self.source = None
        return self.k_max  # the source and length are picked in propose(), which sees the context

    def uses_model(self, n_ctx: int | None = None) -> bool:
        """Whether the draft model drafts at this point, or after n_ctx tokens of context (probes aside)."""
        if n_ctx is not None:
            self.price_at(n_ctx)
        return self.model_length is not None and self.model_length.planned() > 0

    def propose(self, context, k, params, rng):
        self.price_at(len(context))
        self.source = self.lookup_length
        n = min(self.lookup_length.choose(), k)
        if n:  # searched only when its guess would be verified: on a fast target the search shows
            draft = self.lookup.propose(context, n, params, rng)
            if draft.tokens and not self._model_beats_lookup(len(draft.tokens)):
                return draft
        if self.model_length is not None and self._catch_up_pays(context):
            self.source = self.model_length
            n = min(self.model_length.choose(), k)
            if n:
                return self.model.propose(context, n, params, rng)
        return Draft([])

    def _catch_up_pays(self, context: list[int]) -> bool:
        """The draft model is not started where catching up on the context it has not seen would cost more
        than the plain steps between two probes (charged at a draft step a token, an upper bound): after a long
        prompt it was not prefilled for, the catch-up took 2.3-3.3 s here, more than 64 tokens can win back."""
        if self.draft is None:
            return True
        m = self.model_length
        unseen = len(context) - common_prefix(self.draft.history, context)
        return unseen * m.costs.draft <= m._probe_every * m.costs.verify[0]

    def _model_beats_lookup(self, n: int) -> bool:
        """While the draft model drafts, lookup is not free: the draft must still decode every token a lookup
        step commits before it drafts again. Charged here at a draft step per token (a catch-up batch costs
        a little less), lookup's guess is verified only if it still beats the model's own proposal."""
        if not self.uses_model():
            return False
        costs, model = self.costs, self.model_length
        tokens = costs.expected_tokens(n, self.lookup_length.acceptance)
        lookup_rate = tokens / (costs.step_seconds(n, free=True) + tokens * costs.draft)
        return costs.expected_rate(model.planned(), model.acceptance) > lookup_rate

    def update(self, drafted: int, accepted: int) -> None:
        if self.source is not None:  # the last policy asked: it also times plain steps
            self.source.update(drafted, accepted)
