"""Exact sampling through token trees at temperature > 0 (recursive rejection sampling in `walk`).

Chi-square tests at alpha = 0.001 on 20,000+ samples: on fixed target and draft distributions, including
adversarial ones (siblings that share tokens, draft mass where the target has none, deterministic and sampled
siblings mixed), and end to end through the draft model's sampled trees on real llama.cpp models.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from conftest import open_decoder
from ggufspec.submission import NO_BATCH
from ggufspec.lockstep import DecodeSteps
from ggufspec.proposers import Context
from ggufspec.proposers.draft_model import DraftModelProposer
from ggufspec.trees import build_tree, walk
from ggufspec.sampling import SamplingParams, probabilities, sample

ALPHA = 0.001
N = 20_000
V = 6


def chi_square_p(counts: Counter, expected: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities (cells under 5 expected merged)."""
    keys = sorted(expected, key=lambda k: -expected[k])
    obs, exp = [], []
    rest_o = rest_e = 0.0
    for k in keys:
        if expected[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(expected[k] * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += expected[k] * n
    assert sum(counts[k] for k in counts if k not in expected) == 0, "a sample the target cannot produce"
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    exp = np.array(exp, dtype=np.float64)
    exp *= sum(obs) / exp.sum()  # float64: chisquare wants the sums equal to 1.5e-8
    return float(chisquare(obs, exp).pvalue)


# Fixed two-level case: root -> children; each child's row is the target's next distribution after it.
P1 = np.log(np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03]))
P2 = {t: np.log(np.roll([0.4, 0.3, 0.15, 0.1, 0.05, 0.0 + 1e-9], t)) for t in range(V)}  # depends on t1


def run_fixed(params: SamplingParams, draw_siblings, rng: np.random.Generator) -> Counter:
    """N steps: siblings drawn by `draw_siblings(rng) -> [(token, q or None)]`, then walk; the first two tokens."""
    out: Counter = Counter()
    for _ in range(N):
        sib = draw_siblings(rng)
        tree = build_tree([(r,) for r in range(len(sib))], keep_order=True)
        tokens = np.array([0, *[t for t, _ in sib]])
        logits = np.stack([P1, *[P2[t] for t, _ in sib]])
        q = [None, *[qq for _, qq in sib]]
        path, nxt = walk(tree, tokens, logits, params, rng, q if any(x is not None for x in q) else None)
        seq = [int(tokens[i]) for i in path[1:]] + [nxt]
        if len(seq) == 1:  # the next target step would draw the second token after t1
            seq.append(sample(probabilities(P2[seq[0]], params), rng))
        out[tuple(seq[:2])] += 1
    return out


def expected_pairs(params: SamplingParams) -> dict:
    p1 = probabilities(P1, params)
    return {(a, b): p1[a] * probabilities(P2[a], params)[b] for a in range(V) for b in range(V)
            if p1[a] * probabilities(P2[a], params)[b] > 0}


Q = np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # the draft disagrees, and puts mass where the target has little


def iid(k: int):
    return lambda rng: [(sample(Q, rng), Q) for _ in range(k)]


def without_replacement(k: int):
    def draw(rng):
        q, out = Q.copy(), []
        for _ in range(k):
            qn = q / q.sum()
            t = sample(qn, rng)
            out.append((t, qn))
            q[t] = 0.0
        return out
    return draw


def mixed(rng):
    """A sampled chain token, then deterministic runner-ups that may repeat it."""
    t = sample(Q, rng)
    return [(t, Q), (0, None), (t, None), (5, None)]


SAMPLING = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),  # the target has no mass on 2 of 6 tokens: the draft does
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
]
DRAFTS = {"iid-3": iid(3), "no-replacement-3": without_replacement(3), "mixed": mixed,
          "deterministic-duplicates": lambda rng: [(1, None), (1, None), (4, None)]}


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk4", "t1.3-topp-minp"])
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_fixed_distributions(params, draft) -> None:
    counts = run_fixed(params, DRAFTS[draft], np.random.default_rng(7))
    assert chi_square_p(counts, expected_pairs(params), N) > ALPHA


def test_the_check_can_fail() -> None:
    """The same harness rejects a verifier that is not exact: keeping every sampled sibling."""
    params, rng = SamplingParams(temperature=1.0), np.random.default_rng(8)
    out: Counter = Counter()
    for _ in range(N):
        t = sample(Q, rng)
        out[(t, sample(probabilities(P2[t], params), rng))] += 1
    assert chi_square_p(out, expected_pairs(params), N) < ALPHA


class MemoDecoder(DecodeSteps):
    """A real llama.cpp decoder whose logits are computed once per history (or tree) and then replayed, so that
    20,000 draws through the real drafter and walk take seconds: the numbers are llama.cpp's."""

    # the proposer's counters read them: nothing is timed
    decode_seconds, n_decodes, n_decoded_tokens, n_batched_tokens = 0.0, 0, 0, 0
    last_batch = NO_BATCH  # a context of its own: no shared batch

    def __init__(self, decoder) -> None:
        self.d, self.n_vocab, self.history, self.memo = decoder, decoder.n_vocab, [], {}

    def rows(self, key, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def sync(self, tokens, view=False):
        self.history = list(tokens)
        return self.rows(tuple(tokens), lambda: self.d.sync(tokens)[-1:].copy())

    def feed(self, tokens, all_logits=True, view=False):
        self.history += list(tokens)
        return self.sync(self.history)

    def hold(self, undo=None, anchor=False):  # rollbacks replay memoised rows: nothing to keep
        pass

    def tree_logits(self, tokens, parents):
        key = (tuple(self.history), tuple(int(t) for t in tokens), tuple(int(p) for p in parents))
        return self.rows(key, lambda: self.tree_rows(tokens, parents))

    def tree_rows(self, tokens, parents):
        self.d.sync(self.history + [int(tokens[0])])  # the root is the context's last token
        self.d.rollback_to(len(self.history))
        logits = self.d.tree_logits([int(t) for t in tokens], [int(p) for p in parents])
        self.d.rollback_to(len(self.history))  # drops the uncommitted tree: the history is as before it
        return logits


@pytest.mark.slow
def test_real_models_first_two_tokens_through_sampled_draft_trees(tiny_target, tiny_draft) -> None:
    params = SamplingParams(temperature=0.8, top_k=3)  # few continuations: the memo stays small
    target, draft = open_decoder(tiny_target, n_seq_max=8), open_decoder(tiny_draft)
    try:
        prompt = target.vocab.tokenize("The weather today is", add_special=True, parse_special=True)
        rng = np.random.default_rng(3)
        drafter = DraftModelProposer(MemoDecoder(draft), target.n_vocab, params, rng, tree_leaves=4)
        drafter.reach_min = 0.9  # chains stop early, so runner-ups fill trees (top-3 draws make confident chains)
        memo = MemoDecoder(target)
        memo.history = prompt[:-1]
        p1 = probabilities(target.sync(prompt)[-1], params)
        firsts = np.flatnonzero(p1)
        p2 = {int(a): probabilities(target.sync(prompt + [int(a)])[-1], params) for a in firsts}
        expected = {(int(a), int(b)): p1[a] * p2[int(a)][b] for a in firsts for b in np.flatnonzero(p2[int(a)])}
        counts: Counter = Counter()
        shapes = Counter()
        for _ in range(N):
            d = drafter.propose(Context(prompt), 4)
            assert d.tree is not None and d.q is not None  # sampling builds trees now
            shapes[d.tree.size] += 1
            nodes = np.array([prompt[-1], *d.tokens])
            memo.history = prompt[:-1]
            logits = memo.tree_logits(nodes, d.tree.parents)
            path, nxt = walk(d.tree, nodes, logits, params, rng, [None, *d.q])
            seq = [int(nodes[i]) for i in path[1:]] + [nxt]
            if len(seq) == 1:
                seq.append(sample(p2[seq[0]], rng))
            counts[tuple(seq[:2])] += 1
        assert len(shapes) >= 1 and max(shapes) > 2
        assert chi_square_p(counts, expected, N) > ALPHA
    finally:
        target.close()
        draft.close()
