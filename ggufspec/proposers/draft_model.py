"""A draft model: a small model sharing the target's vocabulary proposes chains, or trees of its runner-ups."""

from __future__ import annotations

import numpy as np

from ..decoder import Decoder, prefill_steps
from ..history import common_prefix
from ..sampling import SamplingParams, probabilities, sample, softmax, suppress
from ..submission import Steps, run_steps
from ..trees import ordered_tree
from . import NO_DRAFT, Context, Counters, Draft

# A draft tree follows the draft's best guesses while the draft itself gives the whole chain at least this chance,
# and spends the nodes left on runner-up guesses (where a batch of 4 costs about as much as one of 3, stopping short
# without them saves draft steps but not target time). docs/methods.md#measured-constants: REACH_MIN
REACH_MIN = 0.3


class DraftModelProposer:
    """Chains of up to k tokens, stopped early where the draft's top probability < p_min; with tree_leaves > 1,
    trees of up to that many leaves. When sampling, each token comes with the distribution it was drawn from.
    `suppressed`: token ids it never proposes (those the verifier's target never picks)."""

    name = "draft"
    reach_min = REACH_MIN

    def __init__(self, draft: Decoder, n_vocab: int, params: SamplingParams, rng: np.random.Generator,
                 p_min: float = 0.0, tree_leaves: int = 0, suppressed: np.ndarray | None = None) -> None:
        self.draft, self.n_vocab, self.p_min, self.tree_leaves = draft, n_vocab, p_min, tree_leaves
        self.params, self.rng, self.suppressed = params, rng, suppressed
        self.counters = Counters()

    def begin(self, prompt: list[int], warm: bool) -> None:
        run_steps(self.begin_steps(prompt, warm))

    def begin_steps(self, prompt: list[int], warm: bool) -> Steps[None]:
        if warm:
            yield from prefill_steps(self.draft, prompt)

    def accept(self, n_kept: int) -> None:
        self.counters.accepted += n_kept

    def unseen(self, context: list[int]) -> int:
        """Tokens of `context` the draft model would have to catch up on before proposing after it."""
        return len(context) - common_prefix(self.draft.history, context)

    def propose(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Draft:
        return run_steps(self.propose_steps(context, k, plan_nodes))

    def propose_steps(self, context: Context, k: int, plan_nodes: np.ndarray | None = None) -> Steps[Draft]:
        if k <= 0:
            return NO_DRAFT
        d, c = self.draft, self.counters
        seconds, decodes, decoded, batched = d.decode_seconds, d.n_decodes, d.n_decoded_tokens, d.n_batched_tokens
        tree = self.tree_leaves > 1 and k > 1
        draft = yield from (self._tree(context.tokens, k) if tree else self._chain(context.tokens, k))
        c.seconds += d.decode_seconds - seconds
        c.decodes += d.n_decodes - decodes
        c.decoded += d.n_decoded_tokens - decoded
        c.batched += d.n_batched_tokens - batched
        c.tick = d.last_batch.tick
        c.drafts += 1
        c.drafted += len(draft.tokens)
        return draft

    def _chain(self, context: list[int], k: int) -> Steps[Draft]:
        params, rng = self.params, self.rng
        logits = yield from self._start(context, k)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        while True:
            if params.greedy:
                tokens.append(int(logits.argmax()))
            else:
                qs.append(probabilities(logits, params))
                tokens.append(sample(qs[-1], rng))
            if len(tokens) == k or (self.p_min > 0 and softmax(logits).max() < self.p_min):
                break
            logits = self._logits((yield from self.draft.feed_steps([tokens[-1]], view=True)))
        return Draft(tokens, q=np.stack(qs) if qs else None, source=self.name)

    def _start(self, context: list[int], k: int) -> Steps[np.ndarray]:
        """The draft's logits after `context` (caught up on what it has not seen); where it will decode its own guesses
        after them (k > 1), the point to go back to after the verdict is held (a recurrent draft's checkpoint: its
        snapshots cannot undo single-token decodes)."""
        rows = yield from self.draft.sync_steps(context, view=True)
        if k > 1:
            self.draft.hold()  # copies memory only: `rows`, a view of llama.cpp's outputs, stays valid
        return self._logits(rows)

    def _logits(self, rows: np.ndarray) -> np.ndarray:
        """The last row's logits over the target's vocabulary, suppressed tokens at -inf."""
        return suppress(rows[-1, : self.n_vocab], self.suppressed)

    def _tree(self, context: list[int], k: int) -> Steps[Draft]:
        """k nodes: the draft's chain (its best guesses when greedy, draws from its q when sampling) while its chance of
        being kept whole (the product of the draft's top probabilities) is at least reach_min, then runner-ups where
        the draft expects them to pay most (chance of the chain before them x their probability): the next-best
        guesses, or when sampling, further draws from the same q without replacement, each with the q it was drawn
        from (see trees.walk)."""
        params, rng = self.params, self.rng
        chain: list[int] = []
        dists: list[np.ndarray] = []  # per depth: the draft's distribution (its plain softmax when greedy)
        reach = [1.0]  # chance of the chain before each depth, then of the whole chain
        logits = yield from self._start(context, k)
        while True:
            z = softmax(logits) if params.greedy else probabilities(logits, params)
            chain.append(int(z.argmax()) if params.greedy else sample(z, rng))
            dists.append(z)
            # the draft's top probability: the chance its best guess is kept when greedy; when sampling, a calibrated
            # estimate of its draw's acceptance (the drawn token's own probability is lower, and stops chains too
            # early: docs/methods.md#measured-constants)
            top = float(z.max())
            reach.append(reach[-1] * top)
            if len(chain) == k or reach[-1] < self.reach_min or top < self.p_min:
                break
            logits = self._logits((yield from self.draft.feed_steps([chain[-1]], view=True)))
        chain_only = Draft(chain, q=None if params.greedy else np.stack(dists), source=self.name)
        room = min(k - len(chain), self.tree_leaves - 1)  # every runner-up is a leaf, as is the chain's end
        if room <= 0:
            return chain_only
        rest = [z.copy() for z in dists]  # what is left at each depth to propose
        for d, x in enumerate(chain):
            rest[d][x] = 0.0
        best = [float(r.max()) for r in rest]
        nodes: list[tuple[int, int, np.ndarray | None]] = []  # runner-ups: (depth, token, q drawn from)
        for _ in range(room):
            d = max(range(len(chain)), key=lambda d: reach[d] * best[d])
            if best[d] <= 0:  # sampling with top-k/top-p: nothing left that the draft would propose
                break
            if params.greedy:
                nodes.append((d, int(rest[d].argmax()), None))
            else:
                q = rest[d] / rest[d].sum()
                nodes.append((d, sample(q, rng), q))
            rest[d][nodes[-1][1]] = 0.0
            best[d] = float(rest[d].max())
        if not nodes:
            return chain_only
        # the chain first: when it is kept, the target's cache needs no repair (see Decoder.commit_tree_path)
        ranks = [0] * len(chain)
        choices = [(0,) * (d + 1) for d in range(len(chain))]
        for d, _, _ in nodes:
            ranks[d] += 1
            choices.append((0,) * d + (ranks[d],))
        tokens = chain + [t for _, t, _ in nodes]
        q = None if params.greedy else np.stack(dists + [r for _, _, r in nodes])
        return Draft(tokens, ordered_tree(tuple(choices)), q, self.name)
