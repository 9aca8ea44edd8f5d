"""What `auto` says of a generation (the stats line and --json): what it drafted from, and why nothing, or why a
drafting model stayed off, at the costs of the last context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .adaptive import MIN_GAIN, OPTIMISTIC, SHARED_GAIN, AdaptiveLength

if TYPE_CHECKING:
    from .auto import AutoPolicy

SOURCE_NAMES = {"draft": "draft model", "lookup": "lookup", "medusa": "Medusa tree", "mtp": "MTP head"}
MODEL_NAMES = {"draft": "the draft model", "mtp": "the MTP head"}  # the drafting models, as decision() says them


def decision(policy: AutoPolicy) -> str:
    """`policy`'s generation, said as, e.g., "drafted on 40 of 64 passes (lookup 30, draft model 10)" or
    "speculation off: a 5-token batch costs 3.6 decodes here and a draft token 0.95: even drafts kept 90% of the
    time would not pay"."""
    drafted = {s: n for s, n in policy.steps.items() if s is not None}
    parts = []
    if drafted:
        by = ", ".join(f"{SOURCE_NAMES.get(s, s)} {n}" for s, n in sorted(drafted.items(), key=lambda x: -x[1]))
        parts.append(f"drafted on {sum(drafted.values())} of {sum(policy.steps.values())} passes ({by})")
    off = [(name, record) for name, record, _ in policy.models() if name not in drafted]
    if len(off) == 1 and not drafted:  # the draft model's as it always said it; the MTP head's named
        parts.append(f"speculation off: {'the MTP head: ' * (off[0][0] == 'mtp')}{why_off(policy, off[0][1])}")
    elif off:
        whys = "; ".join(f"{MODEL_NAMES[name]}: {why_off(policy, record)}" for name, record in off)
        parts.append(f"speculation off: {whys}" if not drafted else
                     "; ".join(f"{MODEL_NAMES[name]} off: {why_off(policy, record)}" for name, record in off))
    elif not drafted:
        why = why_off(policy, policy.lookup_length)
        if policy.sizer is not None:
            why = f"the heads' tree was not expected to pay, nor lookup's guesses ({why})"
        parts.append(f"speculation off: {why}")
    return "; ".join(parts)


def why_off(policy: AutoPolicy, record: AdaptiveLength) -> str:
    """Why `record` (a drafting model's, or lookup's chance matches) drafted nothing: no guess to verify, what a
    batch costs here against the best a draft could keep, or against what its drafts were expected to keep."""
    model = any(record is r for _, r, _ in policy.models())
    if not model and not policy.guessed and not policy.unsearched:
        return "the text did not repeat itself, so lookup had nothing to guess"
    c, free = record.costs, record.free
    k = c.best_k(OPTIMISTIC, policy.k_max, k_min=1, free=free)  # the length most likely to pay
    price = f"a {k + 1}-token batch costs {c.batch_seconds(k + 1) / c.verify[0]:.1f} decodes here"
    if not free:
        step = "an MTP step" if record is policy.mtp_length else "a draft token"
        price += f" and {step} {c.draft / c.verify[0]:.2f}"
    gain = SHARED_GAIN if c.shared else MIN_GAIN
    if c.expected_rate(k, OPTIMISTIC, free) < gain * c.expected_rate(0, 0):
        return f"{price}: even drafts kept {OPTIMISTIC:.0%} of the time would not pay"
    if not record.planned():
        return f"{price}: drafts kept {record.acceptance[0]:.0%} of the time (so far) would not pay"
    if model:
        return f"{price}: drafting would pay, but not the drafter's catching up on the text it has not seen"
    return f"{price}: no guess came where verifying it would pay"
