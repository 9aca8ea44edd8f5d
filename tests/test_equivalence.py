"""The promise: speculation yields the target's own greedy text and the target's sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO, FirstTokens, FixedCosts, open_decoder
from ggufspec.costs import CostModel
from ggufspec.proposers.draft_model import DraftModelProposer
from ggufspec.decoder import LlamaCppDecoder
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.sampling import SamplingParams

PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "import numpy as np\n\ndef softmax(x):\n",
    "Once upon a time, in a small village,",
    "Q: What is 17 * 23?\nA:",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]

# llama.cpp computes a k-token batch with other CPU kernels than one token: logits differ by
# ~1e-5 on f32 models and up to ~0.1 on quantized ones at these short contexts (more past 256
# cached tokens: see docs/exactness.md), so an argmax may flip where the target's top two logits are
# that close. A divergence anywhere else is a bug.
NEAR_TIE = {"f32": 1e-3, "quantized": 0.25}
# SmolLM2 runs on the default q8_0 cache, where a batch and single tokens give the same logits bit for bit
# (test_decoder): there the text must be plain decoding's exactly, with no near-tie allowance.
EXACT = 0.0


def assert_same_or_near_tie(target_path, prompt: str, want: list[int], got: list[int], gap: float) -> None:
    if got == want:
        return
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    with open_decoder(target_path) as d:
        logits = d.feed(d.vocab.tokenize(prompt) + want[:i])[-1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < gap, (
        f"speculative output diverges from the target's greedy output at token {i} "
        f"({want[i:i + 3]} vs {got[i:i + 3]}) where the target's top-2 gap is {top2[1] - top2[0]:.4f}, "
        f"not a near-tie (< {gap})"
    )


def _greedy_runs(engine: SpeculativeEngine, target_path, prompts, draft_lengths, gap, max_tokens=40,
                 method="vanilla"):
    accepted = drafted = 0
    for prompt in prompts:
        ref = engine.generate(prompt, GenerationSettings(max_tokens=max_tokens, method="autoregressive"))
        assert ref.stats.target_passes == len(ref.tokens) + (ref.stop_reason == "stop")
        for k in draft_lengths:
            got = engine.generate(prompt, GenerationSettings(max_tokens=max_tokens, method=method, draft_max=k))
            assert_same_or_near_tie(target_path, prompt, ref.tokens, got.tokens, gap)
            if got.tokens == ref.tokens:
                assert got.text == ref.text
            accepted += got.stats.accepted
            drafted += got.stats.drafted
    return accepted / max(drafted, 1)


def test_greedy_tiny_pair_all_draft_lengths(tiny_target, tiny_draft) -> None:
    with SpeculativeEngine.load(tiny_target, tiny_draft) as engine:
        rate = _greedy_runs(engine, tiny_target, PROMPTS, range(1, 9), NEAR_TIE["f32"])
    assert 0.05 < rate < 0.95, f"the test draft should agree only sometimes (acceptance {rate:.2f})"


@pytest.mark.slow
def test_greedy_smollm2_with_a_requantized_draft(smollm2_path, smollm2_q4_0) -> None:
    with SpeculativeEngine.load(smollm2_path, smollm2_q4_0) as engine:
        assert engine.target.kv_type == "q8_0"
        rate = _greedy_runs(engine, smollm2_path, PROMPTS[:4], [1, 3, 5, 8], EXACT)
    assert rate < 0.99


def test_greedy_draft_equal_to_target_accepts_everything(smollm2_path) -> None:
    with SpeculativeEngine.load(smollm2_path, smollm2_path) as engine:
        rate = _greedy_runs(engine, smollm2_path, PROMPTS[:3], [4], EXACT, max_tokens=60)
    assert rate > 0.97, f"a draft identical to the target must be accepted (acceptance {rate:.3f})"


REPETITIVE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]


def drafting_pays() -> CostModel:
    """Costs of a target where drafting pays: a batch of n+1 at 1 + n/10 single decodes, a draft token at a tenth."""
    return CostModel([0.02 * (1 + 0.1 * n) for n in range(7)], 0.002)


@pytest.mark.parametrize("method", ["lookup", "auto"])
def test_greedy_lookup_and_auto(smollm2_path, smollm2_q4_0, method, tmp_path) -> None:
    # On 2 cores this 135M target is compute-bound: its measured costs would (rightly) keep `auto`
    # from drafting at all. Start it from the costs of a target where drafting pays, so its drafts
    # are verified here; real step times then pull the model toward this machine's.
    with SpeculativeEngine.load(smollm2_path, smollm2_q4_0, costs=drafting_pays()) as engine:
        # the copy prompt repeats on every CPU; on an AVX2 EPYC the target follows neither REPETITIVE pattern, and
        # lookup kept 29 of the 145 tokens it drafted on those and PROMPTS[0]
        prompts = REPETITIVE + PROMPTS[:1] + [f"<|im_start|>user\n{COPY}<|im_end|>\n<|im_start|>assistant\n"]
        rate = _greedy_runs(engine, smollm2_path, prompts, [3, 6], EXACT, method=method)
    assert rate > 0.2, f"{method} should find and keep drafts on repetitive text (acceptance {rate:.2f})"


COPY = ("Copy this text exactly: The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion, the members agreed to fund the new library, repair the old bridge, and hire two more teachers.")


def test_greedy_long_lookup_guesses(smollm2_path, smollm2_q4_0) -> None:
    """Where the answer copies the prompt, `auto` verifies lookup guesses longer than --draft-max (16-64 token
    batches priced as cheap here, and kept so: learning this CPU's costs may rightly turn them off), and the text
    is still the target's own, exactly (q8_0 cache)."""
    costs = FixedCosts(drafting_pays().verify, 0.002, [16, 32, 64], [0.03, 0.035, 0.045])
    prompt = [{"role": "user", "content": COPY}]
    with SpeculativeEngine.load(smollm2_path, smollm2_q4_0, costs=costs) as engine:
        ref = engine.generate(prompt, GenerationSettings(max_tokens=60, method="autoregressive"))
        got = engine.generate(prompt, GenerationSettings(max_tokens=60, method="auto", draft_max=3))
    assert "committee met on Tuesday" in ref.text  # the target does copy
    assert got.tokens == ref.tokens
    assert len(got.stats.judged_at) > 3, "some lookup guess should have gone past --draft-max"
    assert got.stats.target_passes < len(got.tokens) / 2


def test_copy_guesses_priced_apart(smollm2_path) -> None:
    """On a CPU where a chance n-gram guess does not pay (the Zen 4 costs measured here, a 4-token batch at 2.4
    decodes, long batches as measured on the same CPU), `auto` still verifies guesses that continue a copy of the
    prompt, right from the first step where 16 tokens of copy stand before the guess."""
    costs = FixedCosts([0.0386, 0.0726, 0.1027, 0.0940], 0.0082, [16, 32, 64], [0.285, 0.55, 1.12])
    prompt = [{"role": "user", "content": COPY}]
    with SpeculativeEngine.load(smollm2_path, costs=costs) as engine:
        ref = engine.generate(prompt, GenerationSettings(max_tokens=60, method="autoregressive"))
        got = engine.generate(prompt, GenerationSettings(max_tokens=60, method="auto", draft_max=3))
    assert "committee met on Tuesday" in ref.text
    assert got.tokens == ref.tokens
    assert got.stats.target_passes < 0.6 * len(got.tokens), got.stats


def test_greedy_auto_draft_trees(tiny_target, tiny_draft, monkeypatch) -> None:
    """`auto`'s draft trees commit the target's own greedy text (an f32 pair: only near-ties may differ)."""
    monkeypatch.setattr(DraftModelProposer, "reach_min", 0.9)  # a tree wherever the draft is not near-certain
    trees: list[int] = []
    tree_logits_steps = LlamaCppDecoder.tree_logits_steps

    def counted(self, tokens, parents):  # the verifier's tree pass (a decode coroutine)
        trees.append(len(tokens))
        return (yield from tree_logits_steps(self, tokens, parents))

    monkeypatch.setattr(LlamaCppDecoder, "tree_logits_steps", counted)
    rates = []
    with SpeculativeEngine.load(tiny_target, tiny_draft) as engine:
        for k in (2, 3, 6):  # each length from the optimistic costs: this machine's would soon turn trees off
            engine.costs = drafting_pays()
            rates.append(_greedy_runs(engine, tiny_target, PROMPTS, [k], NEAR_TIE["f32"], method="auto"))
    rate = sum(rates) / len(rates)
    assert len(trees) > 20 and max(trees) > 3, f"auto should have verified draft trees ({trees})"
    assert rate > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("method,prompt,arch", [("vanilla", "Once upon a time", None),
                                               ("lookup", "7 8 9 7 8 9 7 8 9 7", None),
                                               ("vanilla", "Once upon a time", "qwen35")])
def test_sampling_end_to_end_follows_the_target(tiny_target, tiny_draft, hybrid, method, prompt, arch) -> None:
    """The first three tokens sampled with speculation follow the target's own (top-k, tempered) distribution: the
    first from the prompt's pass, the next two judged as the first step's draft positions (a resample or a bonus).

    Lookup drafts are deterministic (q one-hot): acceptance is then p(x), the residual p without x; the prompt is
    grown until the pair (its last token, the likeliest first) occurs in it, so lookup has a match to draft from. On a
    hybrid pair (arch) the third token comes after the first step's rollbacks: the target's by snapshot, the draft's
    from a checkpoint.
    """
    if arch is not None:
        tiny_target, tiny_draft = hybrid(arch)
    params = SamplingParams(temperature=1.5, top_k=6)
    with open_decoder(tiny_target) as d:
        first = FirstTokens(d, d.vocab.tokenize(prompt), params, lookup=method == "lookup")
    accepted = drafted = 0
    with SpeculativeEngine.load(tiny_target, tiny_draft) as engine:
        for seed in range(3000):
            r = engine.generate(first.toks, GenerationSettings(max_tokens=4, sampling=params, seed=seed, method=method,
                                                               draft_max=2))
            first.add(r.tokens)
            accepted, drafted = accepted + r.stats.accepted, drafted + r.stats.drafted
    assert drafted > 0 and (method != "vanilla" or 0.05 < accepted / drafted < 0.95), "drafts must be judged"
    first.check()


def test_seeded_sampling_is_reproducible(tiny_target, tiny_draft) -> None:
    s = GenerationSettings(max_tokens=30, sampling=SamplingParams(0.8, top_p=0.9), seed=7)
    with SpeculativeEngine.load(tiny_target, tiny_draft) as engine:
        a, b = engine.generate("Hello", s), engine.generate("Hello", s)
        c = engine.generate("Hello", GenerationSettings(max_tokens=30, sampling=SamplingParams(0.8, top_p=0.9), seed=8))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


@pytest.mark.slow
def test_ignore_eos_goes_on_with_the_targets_own_pick_among_the_other_tokens(smollm2_path, smollm2_q4_0) -> None:
    """llama-server's ignore_eos: an answer that ends by itself goes on to max_tokens, each token the target's argmax
    with its end-of-generation tokens left out (checked against single-token decoding by hand), the same text for
    every method, Medusa's trees too (their rows are masked apart); sampled, no end-of-generation token either."""
    question = [{"role": "user", "content": "What is 2+2?"}]
    n = 40
    with SpeculativeEngine.load(smollm2_path, smollm2_q4_0) as engine:
        eog = sorted(engine.target.vocab.eog_ids)
        alone = engine.generate(question, GenerationSettings(max_tokens=n, method="autoregressive"))
        assert alone.stop_reason == "stop" and len(alone.tokens) < n // 2  # it ends by itself
        prompt = engine.encode(question, engine.n_ctx)
        with open_decoder(smollm2_path) as d:
            want, logits = [], d.feed(prompt)[-1]
            while len(want) < n:
                masked = logits.copy()
                masked[eog] = -np.inf
                want.append(int(masked.argmax()))
                logits = d.feed([want[-1]])[-1]
        assert want[: len(alone.tokens)] == alone.tokens
        for method in ("autoregressive", "vanilla", "lookup", "auto"):
            got = engine.generate(question, GenerationSettings(max_tokens=n, method=method, ignore_eos=True))
            assert got.stop_reason == "max_tokens", method
            assert got.tokens == want, method
        for method in ("autoregressive", "vanilla"):
            sampled = GenerationSettings(max_tokens=n, method=method, sampling=SamplingParams(1.0), seed=3,
                                         ignore_eos=True)
            got = engine.generate(question, sampled)
            assert len(got.tokens) == n and not set(got.tokens) & set(eog), method
            assert engine.generate(question, sampled).tokens == got.tokens  # a seed still repeats a run
    # Medusa's trees, each pass a named tree whole (the heads trained for SmolLM2: paths are kept), end tokens left out
    heads = sorted((REPO / "models" / "demo").glob("*medusa*.gguf"))[0]
    m = 20  # past the answer's own end (its 11th token or so)
    trees = dict(max_tokens=m, method="medusa", medusa_tree="mc_sim_15", ignore_eos=True, seed=3)
    with SpeculativeEngine.load(smollm2_path, medusa_path=heads) as engine:
        got = engine.generate(question, GenerationSettings(**trees))
        assert got.tokens == want[:m] and got.stats.accepted > 0  # (EXACT: the q8_0 cache; paths kept)
        got = engine.generate(question, GenerationSettings(sampling=SamplingParams(1.0), **trees))
        assert len(got.tokens) == m and not set(got.tokens) & set(eog) and got.stats.accepted > 0
