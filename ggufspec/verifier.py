"""The verifier: the one place that runs the target on a proposal and applies the acceptance rule.

A proposal after `last` (the previous pass's pick, not yet decoded) is one target pass: a chain
[last, *tokens] or a tree rooted at last. Greedy, the target keeps what its own argmax would have
produced; sampling, rejection sampling keeps a prefix (a chain: Leviathan et al. 2023, Chen et al.
2023) or a path (a tree: recursive rejection over each node's children, `trees.walk`) distributed
exactly as the target's own sampling. Medusa's typical acceptance (opt-in) is the one rule that is not exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .decoder import Decoder, prefill_steps
from .proposers import Draft
from .sampling import SamplingParams, argmax, pick, probabilities, sample, suppress
from .submission import NO_BATCH, BatchShape, Steps
from .trees import Tree, residual, walk

TYPICAL_THRESHOLD = 0.09  # Medusa's posterior_threshold (epsilon)
TYPICAL_ALPHA = 0.3  # Medusa's posterior_alpha: sqrt of the default 0.09 threshold, as in the paper's code


@dataclass(frozen=True)
class Verdict:
    """What one target pass committed."""

    tokens: list[int]  # the kept draft tokens, then the target's own pick (the next `last`, not yet decoded)
    drafted: int  # draft positions judged along one path (Draft.depth)
    seconds: float  # the target's decode time for this pass
    batch: int  # tokens the target decoded: the draft, its root, and deferred tokens riding in front
    deferred: int  # committed tokens left out of the KV cache: the next pass decodes them in front of its batch
    hidden: np.ndarray | None = None  # (H,) with hidden states on: the target's state at the row that picked tokens[-1]
    batched: int = 0  # tokens of the whole batches `seconds` timed: `batch`, plus other slots' in a shared context
    shape: BatchShape = NO_BATCH  # a shared context's batch as it ran (tokens per sequence id, its tick)
    lane: int = 0  # this pass's sequence id in the shape's lanes

    @property
    def kept(self) -> int:
        return len(self.tokens) - 1


def accept_greedy(target_logits: np.ndarray, drafts: list[int], best: np.ndarray | None = None) -> list[int]:
    """Drafts up to the first that differs from the target's argmax (each row's: `best`, where worked out already),
    then the target's own token."""
    best = target_logits.argmax(axis=-1) if best is None else best
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [argmax(target_logits[n], best[n])]  # (checks the pick's logit: a NaN one is an error)


def accept_sampled(p: Sequence[np.ndarray], q: np.ndarray | None, drafts: list[int],
                   rng: np.random.Generator) -> list[int]:
    """Rejection sampling: p[i] is the target's distribution at position i (k+1 rows: an array, or rows made on
    demand, see TargetRows), q is (k, V) from the drafter, None for point-mass guesses (lookup's, greedy drafts).

    Draft token i survives with probability min(1, p_i/q_i); the first rejected position
    is resampled from norm(max(0, p - q)); if all survive, a bonus token comes from p[k].
    The result is distributed exactly as sampling from p token by token.
    """
    k = len(drafts)
    u = rng.random(k)  # all k drawn at once, whatever is kept: a seed uses the random stream it always did
    for n, x in enumerate(drafts):
        pn = p[n]
        qx = 1.0 if q is None else q[n, x]
        if u[n] * qx <= pn[x]:
            continue
        return drafts[:n] + [sample(residual(pn, None if q is None else q[n], x), rng)]
    return drafts + [sample(p[k], rng)]


class TargetRows:
    """The target's transformed distribution per row of `logits`, computed when first read: a rejection at
    position n leaves rows after n unread (each is a softmax over the vocabulary)."""

    def __init__(self, logits: np.ndarray, params: SamplingParams) -> None:
        self.logits, self.params = logits, params

    def __getitem__(self, i: int) -> np.ndarray:
        return probabilities(self.logits[i], self.params)


def walk_typical(
    tree: Tree, tokens: np.ndarray, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
    threshold: float = TYPICAL_THRESHOLD, alpha: float = TYPICAL_ALPHA,
) -> tuple[list[int], int]:
    """Typical acceptance: the deepest path whose every token has p > min(threshold, alpha * exp(-entropy))."""
    p = probabilities(logits, params)
    entropy = -(p * np.log(p + 1e-12)).sum(-1)
    parent = np.maximum(tree.parents, 0)
    ok = p[parent, tokens] > np.minimum(threshold, alpha * np.exp(-entropy[parent]))
    ok[0] = True
    accepted = ~(tree.ancestors & ~ok).any(axis=1)
    node = int(np.argmax(np.where(accepted, tree.depth, -1)))
    return tree.path(node), pick(logits[node], params, rng)


def pad_vocab(q: np.ndarray, n_vocab: int) -> np.ndarray:
    """Draft distributions over the target's vocabulary (the target's padding rows get q = 0)."""
    if q.shape[-1] == n_vocab:
        return q
    return np.pad(q, [(0, 0), (0, n_vocab - q.shape[-1])])


class Verifier:
    """Runs the target: a prefill, then one pass per proposal. `hidden`: return the target's hidden state with each
    verdict (Medusa's heads read it; the target must have embeddings on). `typical`: Medusa's typical acceptance
    for trees when sampling (NOT exact; opt-in). `suppressed`: token ids the target never picks (ignore_eos: its
    end-of-generation tokens), as if their logits were -inf."""

    def __init__(self, target: Decoder, params: SamplingParams, rng: np.random.Generator,
                 hidden: bool = False, typical: bool = False, suppressed: np.ndarray | None = None) -> None:
        self.target, self.params, self.rng, self.hidden = target, params, rng, hidden
        self.suppressed = suppressed
        self.typical = typical and not params.greedy
        self.deferred = 0  # see Verdict.deferred

    @property
    def history(self) -> list[int]:
        """The tokens the target has committed (a context shift drops older ones), deferred ones included."""
        return self.target.history

    def first_steps(self, prompt: list[int]) -> Steps[Verdict]:
        """Decode `prompt` into the target's cache, reusing its common prefix with what the cache holds (its last
        token decoded again where all of it is there), and pick the first token from its last row: the prompt's own
        batch, as llama-server's, so a pool's request starts a tick earlier than with a pass of its own. A decode
        coroutine (submission.Steps: run_steps runs it in the calling thread)."""
        t = self.target
        seconds, decoded, batched = t.decode_seconds, t.n_decoded_tokens, t.n_batched_tokens
        hidden = None
        if self.hidden:  # the last token's hidden row: a decode of its own (a longer prefill's would cost every
            # token's logits, Decoder.hidden_states)
            yield from prefill_steps(t, prompt[:-1])
            rows = yield from t.feed_steps(prompt[-1:], view=True)
            hidden = t.hidden_states()[-1]
        else:
            rows = yield from t.sync_steps(prompt, view=True)
        t.hold(anchor=True)
        self.deferred = 0
        row = suppress(rows[-1:], self.suppressed)[0]
        token = argmax(row) if self.params.greedy else pick(row, self.params, self.rng)
        return Verdict([token], 0, t.decode_seconds - seconds, t.n_decoded_tokens - decoded, 0, hidden,
                       t.n_batched_tokens - batched, t.last_batch, t.lane)

    def verify_steps(self, last: int, draft: Draft) -> Steps[Verdict]:
        """One target pass over `last` and the draft: the tokens the target commits (a decode coroutine)."""
        t = self.target
        seconds, decoded, batched = t.decode_seconds, t.n_decoded_tokens, t.n_batched_tokens
        if draft.tree is None:
            tokens = yield from self._chain(last, draft)
            row = len(tokens) - 1  # the cache keeps all but the last committed token; the last's row
            # a chain decodes the deferred tokens in front of it; on recurrent memory a rollback from a checkpoint
            # defers the tokens kept after it (Decoder.rollback_to)
            self.deferred = t.n_deferred
        else:
            nodes = np.array([last, *draft.tokens])
            logits = suppress((yield from t.tree_logits_steps(nodes, draft.tree.parents)), self.suppressed)
            q = None if draft.q is None else [None, *pad_vocab(draft.q, logits.shape[-1])]
            if self.typical:
                path, nxt = walk_typical(draft.tree, nodes, logits, self.params, self.rng)
            else:  # greedy: the target's own picks node by node; sampling: recursive rejection
                path, nxt = walk(draft.tree, nodes, logits, self.params, self.rng, q)
            tokens, row = [int(x) for x in nodes[path[1:]]] + [nxt], path[-1]
        hidden = t.hidden_states()[row] if self.hidden else None
        if draft.tree is not None:
            self.deferred = t.commit_tree_path(path)
        return Verdict(tokens, draft.depth, t.decode_seconds - seconds, t.n_decoded_tokens - decoded, self.deferred,
                       hidden, t.n_batched_tokens - batched, t.last_batch, t.lane)

    def _chain(self, last: int, draft: Draft) -> Steps[list[int]]:
        t, params, drafts = self.target, self.params, draft.tokens
        picks = params.greedy and self.suppressed is None  # each row's argmax, from the batch where it works them out
        if not drafts:  # a plain step: nothing to judge, nothing to roll back
            rows = suppress((yield from t.feed_steps([last], view=True, picks=picks)), self.suppressed)
            if params.greedy:
                return accept_greedy(rows, [], t.picks(1) if picks else None)
            return [pick(rows[-1], params, self.rng)]
        t.hold(len(drafts))  # recurrent memory: what its snapshots of this batch will not undo, a checkpoint does
        logits = suppress((yield from t.feed_steps([last, *drafts], view=True, picks=picks)), self.suppressed)
        if params.greedy:
            new = accept_greedy(logits, drafts, t.picks(len(logits)) if picks else None)
        else:
            q = None if draft.q is None else pad_vocab(draft.q, logits.shape[-1])
            new = accept_sampled(TargetRows(logits, params), q, drafts, self.rng)
        yield from t.rollback_steps(len(t.history) - len(drafts) + len(new) - 1)
        return new
