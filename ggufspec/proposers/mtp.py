"""The target's own MTP head: chains as a draft model's, drafted by the head (mtp.MtpDecoder).

The head is a draft model in all that the proposer sees: it catches up on the context it has not read (each token
with the target's hidden row before it), then guesses one token a decode from its own row. When sampling, each guess
comes with the head's distribution as q, and the verifier's rejection sampling keeps the target's distribution.
"""

from __future__ import annotations

from ..submission import Steps
from .draft_model import DraftModelProposer


class MtpProposer(DraftModelProposer):
    """Chains of up to k of the MTP head's guesses (stopped where its top probability < p_min); `draft` is the head
    (mtp.MtpDecoder)."""

    name = "mtp"

    def unseen(self, context: list[int]) -> int:
        """Tokens of `context` the head would read before proposing after it: the ones it has not, and its own guesses
        the target has judged since (read again with the target's rows)."""
        return self.draft.unseen(context)

    def begin_steps(self, prompt: list[int], warm: bool) -> Steps[None]:
        """Warm: the head reads the prompt now, from the target's rows of its prefill (kept until it does)."""
        if warm and prompt:
            yield from self.draft.sync_steps(prompt)
