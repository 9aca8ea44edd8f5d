"""The acceptance step and the shared transform, on fixed distributions (no model)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from ggufspec.verifier import accept_greedy, accept_sampled
from ggufspec.sampling import DistributionError, SamplingParams, pick, probabilities, sample, softmax

ALPHA = 0.001
RUNS = 20_000


def _dist(*w: float) -> np.ndarray:
    a = np.array(w, dtype=np.float64)
    return a / a.sum()


P0 = _dist(5, 3, 1, 1, 0, 0)
P1 = _dist(1, 1, 1, 4, 2, 1)
CASES = {
    "q equals p": (np.stack([P0, P1, P1]), np.stack([P0, P1])),
    "q has mass where p has none": (np.stack([P0, P1, P0]), np.stack([_dist(1, 1, 1, 1, 4, 4), _dist(0, 0, 0, 1, 1, 8)])),
    "p and q far apart": (np.stack([P0, P1, P1]), np.stack([_dist(0, 0, 1, 9, 0, 0), _dist(9, 1, 0, 0, 0, 0)])),
}


def _check(counts: np.ndarray, p: np.ndarray) -> None:
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside p's support were emitted: {counts}"
    n = counts.sum()
    result = chisquare(counts[support], n * p[support])
    assert result.pvalue > ALPHA, f"counts {counts} do not follow p={p} (p-value {result.pvalue:.2e})"


@pytest.mark.parametrize("case", CASES)
def test_accept_sampled_follows_p(case: str) -> None:
    """Position 0 always follows p[0]; position 1, reached when draft 0 is kept, follows p[1]."""
    p, q = CASES[case]
    rng = np.random.default_rng(42)
    first = np.zeros(p.shape[1], int)
    second = np.zeros(p.shape[1], int)
    lengths = np.zeros(4, int)
    for _ in range(RUNS):
        drafts = [sample(q[i], rng) for i in range(len(q))]
        out = accept_sampled(p, q, drafts, rng)
        lengths[len(out)] += 1
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    _check(first, p[0])
    _check(second, p[1])
    if case == "q equals p":
        assert lengths[3] == RUNS, "with q = p every draft must be accepted and a bonus token added"


def test_sample_over_a_large_vocabulary() -> None:
    """Unnormalised weights spread over many blocks, the last one short, zeros between: draws follow them exactly."""
    weights = np.zeros(49_152 + 100)
    picks = [0, 255, 256, 1000, 20_000, 49_151, 49_152, 49_251]  # block edges and the short last block
    weights[picks] = [3, 1, 2, 5, 0.5, 4, 1, 2]
    rng = np.random.default_rng(7)
    counts = np.bincount([sample(weights, rng) for _ in range(RUNS)], minlength=len(weights))
    _check(counts, weights / weights.sum())
    assert sample(np.eye(5)[4], rng) == 4 and sample(np.eye(300)[0], rng) == 0


def test_accept_greedy_stops_at_first_mismatch() -> None:
    logits = np.array([[0, 5, 1], [9, 0, 0], [0, 0, 3], [1, 0, 0]], dtype=np.float32)
    assert accept_greedy(logits, [1, 0, 2]) == [1, 0, 2, 0]  # all kept + bonus
    assert accept_greedy(logits, [1, 2, 2]) == [1, 0]  # second rejected, target's own token
    assert accept_greedy(logits, [0, 0, 2]) == [1]


def test_transform_filters() -> None:
    logits = np.log(_dist(40, 30, 15, 10, 5))[None].astype(np.float32)
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_k=2))) == 2
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0, top_k=2))[0, :2], [4 / 7, 3 / 7])
    # top-p keeps the smallest prefix reaching the mass: 0.4 + 0.3 >= 0.69 (an exact tie at 0.7 is float32 rounding's)
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_p=0.69))) == 2
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_p=0.39))) == 1
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, top_p=0.71))) == 3
    # min-p keeps tokens with p >= 0.3 * max = 0.12
    assert np.count_nonzero(probabilities(logits, SamplingParams(1.0, min_p=0.3))) == 3
    cold = probabilities(logits, SamplingParams(0.5))[0]
    np.testing.assert_allclose(cold, _dist(*(np.array([40, 30, 15, 10, 5]) ** 2.0)))
    greedy = probabilities(logits, SamplingParams(0.0))
    assert greedy[0].tolist() == [1, 0, 0, 0, 0]
    np.testing.assert_allclose(probabilities(np.tile(logits, (3, 1)), SamplingParams(1.0, top_p=0.69)).sum(-1), 1)


def test_top_k_keeps_ties_with_the_kth_and_matches_the_definition_on_a_vocabulary() -> None:
    tied = np.array([[2.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 2.0]], dtype=np.float32)
    p = probabilities(tied, SamplingParams(1.0, top_k=2))  # tokens tied with the 2nd largest all stay, as before
    assert (p > 0).tolist() == [[True, True, True, True, False], [False, True, True, True, True]]
    np.testing.assert_allclose(p.sum(axis=-1), 1)
    logits = np.random.default_rng(0).normal(0, 3, size=(3, 49152)).astype(np.float32)
    for params in (SamplingParams(1.5, top_k=6), SamplingParams(0.8, top_k=40, top_p=0.9, min_p=0.05)):
        want = np.exp((logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)) / params.temperature)
        kth = np.sort(want, axis=-1)[:, -params.top_k, None]
        want[want < kth] = 0  # the definition: temperature, then top-k on the distribution, ...
        if params.top_p < 1:
            for row in want:
                order = np.argsort(-row, kind="stable")
                before = np.cumsum(row[order]) - row[order]
                row[order[before >= params.top_p * row.sum()]] = 0
        want[want < params.min_p * want.max(axis=-1, keepdims=True)] = 0
        want /= want.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(probabilities(logits, params), want, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                dict(min_p=1.5), dict(temperature=float("inf")), dict(temperature=float("nan"))])
def test_invalid_sampling_values(kw) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_accept_sampled_point_mass_guesses_follow_p() -> None:
    """Guesses made without sampling (q None, as lookup's): the first output follows p[0], the second, reached when
    guess 0 is kept, p[1]; a rejected guess is never emitted at its position."""
    p = np.stack([P0, P1, P1])
    rng = np.random.default_rng(7)
    first = np.zeros(p.shape[1], int)
    second = np.zeros(p.shape[1], int)
    for _ in range(RUNS):
        out = accept_sampled(p, None, [0, 3], rng)
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    _check(first, p[0])
    _check(second, p[1])


@pytest.mark.parametrize("params", [SamplingParams(0.5), SamplingParams(2.0), SamplingParams(0.8, top_k=5),
                                    SamplingParams(1.3, top_p=0.9, min_p=0.05)])
def test_a_plain_pick_draws_what_drafts_are_judged_by(params) -> None:
    """A plain step draws with pick, a speculative one judges drafts by probabilities(): one distribution, the
    tempered softmax with the filters (pick goes its own way where no filter is set, the default)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, 12).astype(np.float32)
    p = probabilities(logits, params).astype(np.float64)
    if not (params.top_k or params.top_p < 1.0 or params.min_p):
        z = np.exp((logits - logits.max()).astype(np.float64) / params.temperature)
        np.testing.assert_allclose(p, z / z.sum(), rtol=1e-5)
    _check(np.bincount([pick(logits, params, rng) for _ in range(RUNS)], minlength=len(p)), p / p.sum())


@pytest.mark.parametrize("temperature", [1e-31, 1e-38, 1e-45, 5e-324])
def test_a_temperature_too_small_for_float32_is_greedy(temperature) -> None:
    """1/T overflowed float32 and every probability was NaN: such a T is the greedy limit, for target and draft."""
    logits = np.array([[3.0, 20.5, -7.0, 20.0]], dtype=np.float32)
    params = SamplingParams(temperature)
    assert params.greedy
    assert probabilities(logits, params)[0].tolist() == [0, 1, 0, 0]
    assert pick(logits[0], SamplingParams(temperature, top_p=0.9), np.random.default_rng(0)) == 1


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's, on inf - inf: the error follows
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_row_of_probabilities_never_holds_a_nan(bad) -> None:
    logits = np.array([[1.0, bad, 0.5], [1.0, 2.0, 3.0]], dtype=np.float32)
    rng = np.random.default_rng(0)
    with pytest.raises(DistributionError, match="not finite"):
        probabilities(logits, SamplingParams(0.7))
    for k in (1, 2):  # top-k keeps only the largest logits before exp: a bad one among the rest is caught too
        with pytest.raises(DistributionError, match="not finite"):
            probabilities(logits, SamplingParams(0.7, top_k=k))
    with pytest.raises(DistributionError, match="not finite"):
        softmax(logits)
    with pytest.raises(DistributionError, match="not finite"):
        pick(logits[0], SamplingParams(0.7), rng)
    with pytest.raises(DistributionError, match="not finite"):
        sample(np.array([0.5, np.nan, 0.5]), rng)
