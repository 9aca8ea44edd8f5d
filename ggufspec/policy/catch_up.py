"""When `auto` starts a drafting model: its catching up on the text it has not seen, against what its drafts can win
back."""

from __future__ import annotations

from ..proposers import Proposer
from .adaptive import PROBE_EVERY_MAX, AdaptiveLength

# The most tokens over which the draft model's catching up is expected to pay back (catch_up_pays): an
# estimate near break-even may turn drafting off again within as many steps, and the next start catches up again.
# docs/methods.md#measured-constants: CATCH_UP_HORIZON
CATCH_UP_HORIZON = PROBE_EVERY_MAX
# A probe's catching up is what exploring costs: at most this share of the plain steps left (up to CATCH_UP_HORIZON),
# so that a probe after a long prompt does not cost a short answer more than it could win back.
# docs/methods.md#measured-constants: PROBE_CATCH_UP_SHARE
PROBE_CATCH_UP_SHARE = 0.1


def catch_up_pays(proposer: Proposer, m: AdaptiveLength, context: list[int], room: int, k: int, busy: int) -> bool:
    """A drafting model (`proposer`, its record `m`) is not started where catching up on the context it has not seen
    (charged at costs.catch_up a token: a draft model's step, an upper bound; the MTP head's share of a catch-up
    batch) would cost more than drafting can win back: the time its expected gain saves on the
    tokens left (`room`, at most CATCH_UP_HORIZON), or for a probe, the plain steps between two probes and
    PROBE_CATCH_UP_SHARE of the plain steps left (in a pool, charged for every busy slot). After a
    long prompt the draft was not prefilled for, a catch-up takes seconds, more than those steps can win back; in
    a busy pool it is a tick every slot waits on (docs/methods.md#measured-constants: CATCH_UP_HORIZON). `k`: the
    model's planned length; `busy`: the busy slots of the batch it would run in (1 alone)."""
    cost = proposer.unseen(context) * m.costs.catch_up
    if not cost:
        return True
    if not k:  # a probe, if any: less than the plain steps between two probes, and a share of those left; in a
        # pool its catch-up is a tick every busy slot waits on, and each slot probes: charged once for each
        return cost * busy <= (min(m.probe_every, PROBE_CATCH_UP_SHARE * min(room, CATCH_UP_HORIZON))
                               * m.costs.verify[0])
    rate = m.costs.expected_rate  # tokens a second: the whole batch's, where other slots share it
    saved = min(room, CATCH_UP_HORIZON) * (1 / rate(0, 0) - 1 / rate(k, m.acceptance))
    return cost <= saved
