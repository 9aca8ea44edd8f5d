"""Medusa on real llama.cpp contexts: exact greedy and sampled output, KV after a path, heads, trees, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import TINY, FirstTokens, FixedCosts, open_decoder
from test_equivalence import NEAR_TIE, PROMPTS, assert_same_or_near_tie
from ggufspec.cli import main
from ggufspec.convert.medusa import convert_medusa
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.errors import GGUFSpecError, ModelFileError
from ggufspec.medusa.fit import fit_tree, tree_accepted
from ggufspec.medusa.heads import Heads, load_medusa_gguf, medusa_decoder_options
from ggufspec.medusa.train import save_checkpoint
from ggufspec.costs import CostModel
from ggufspec.loop import generate_steps
from ggufspec.policy import SizedTree, TreeSizer, WholeTree
from ggufspec.policy.auto import AutoPolicy
from ggufspec.proposers.medusa import MedusaProposer
from ggufspec.verifier import Verifier, walk_typical
from ggufspec.sampling import SamplingParams, pick
from ggufspec.trees import TREES, TreeError, build_tree, load_tree, walk

H = TINY.n_embd
V = 49152




def _random_blocks(rng: np.random.Generator, heads: int, layers: int, hidden: int, scale: float):
    return [[(rng.normal(0, scale, (hidden, hidden)), rng.normal(0, scale, hidden)) for _ in range(layers)]
            for _ in range(heads)]


def _write_heads(path: Path, blocks, lm_heads=None, outtype: str = "f32", choices=None) -> Path:
    ckpt = save_checkpoint(path.with_suffix(""), blocks, lm_heads, base_model="test", vocab_size=V, choices=choices)
    convert_medusa(ckpt, path, outtype)
    return path


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory) -> Path:
    """v2 heads with random ResBlocks: their guesses are mostly wrong."""
    rng = np.random.default_rng(7)
    return _write_heads(tmp_path_factory.mktemp("medusa") / "random.gguf", _random_blocks(rng, 4, 1, H, 0.3))


@pytest.fixture(scope="module")
def trained_heads(tiny_target, tmp_path_factory) -> Path:
    """Heads made by `ggufspec medusa train` on the tiny target's own answers (its text is random: so are they)."""
    d = tmp_path_factory.mktemp("trained")
    (d / "prompts.txt").write_text("\n".join(PROMPTS[:3]) + "\n")
    res = CliRunner().invoke(main, [
        "medusa", "train", str(tiny_target), str(d / "heads.gguf"), "--prompts", str(d / "prompts.txt"), "--no-chat",
        "--max-new", "24", "--parallel", "3", "--heads", "3", "--epochs", "2", "--batch", "16", "-t", "1",
        "--checkpoint-dir", str(d / "ckpt"),
    ])
    assert res.exit_code == 0, res.output
    assert "validation top-1 per head" in res.output and "tree: " in res.output
    assert f"checkpoint in {d / 'ckpt'}" in res.output
    # the GGUF is written directly: no other checkpoint folder than the one asked for
    assert sorted(p.name for p in d.iterdir()) == ["ckpt", "heads.gguf", "prompts.txt"]
    return d / "heads.gguf"


def test_trained_heads_are_what_converting_their_checkpoint_gives(trained_heads, tmp_path) -> None:
    """`medusa train` writes its GGUF through format.py, no longer by converting the checkpoint it wrote; the file
    is the same as that conversion's (f16, the default), all but general.name, and loads with its fitted tree."""
    from test_convert_medusa import assert_same_gguf

    converted = convert_medusa(trained_heads.parent / "ckpt", tmp_path / "converted.gguf").out
    assert_same_gguf(trained_heads, converted, ignore=("general.name",))
    raw = load_medusa_gguf(trained_heads)
    assert (raw.version, raw.heads, raw.hidden, raw.vocab, raw.base_model) == (2, 3, H, V, "tiny-target.gguf")
    assert raw.choices and raw.name == "heads"


@pytest.fixture(scope="module")
def demo_heads() -> Path:
    """The heads trained for SmolLM2-135M-Instruct that ship in models/demo (good guesses: paths get accepted)."""
    found = sorted((Path(__file__).resolve().parents[1] / "models" / "demo").glob("*medusa*.gguf"))
    if not found:
        pytest.fail("models/demo/*medusa*.gguf is missing: see scripts/medusa/README.md to train it")
    return found[0]


def trees_pay() -> CostModel:
    """Costs of a target where a tree of any size costs little more than one token: the sizer keeps whole trees.
    Fixed: learned from this machine's batches, the tiny target's costs drift run to run (a 2-token batch at 1.7
    decodes in one run), and so did how often `auto` verified a guess."""
    # batches of 1..5: what `auto` needs at its default draft length of 4 (fewer, and it measures this machine's)
    return FixedCosts([0.02, 0.0201, 0.0202, 0.0203, 0.0204], 0.0, [16, 32, 64], [0.021, 0.022, 0.023])


def _engine(target: Path, heads: Path, costs: CostModel | None = None) -> SpeculativeEngine:
    return SpeculativeEngine.load(target, options=DecoderOptions(n_ctx=1024), medusa_path=heads,
                                  costs=costs or trees_pay())


@pytest.mark.parametrize("heads_fixture", ["random_heads", "trained_heads"])
def test_greedy_medusa_equals_autoregressive_tiny(tiny_target, heads_fixture, request) -> None:
    heads = request.getfixturevalue(heads_fixture)
    with _engine(tiny_target, heads) as engine:
        for prompt in PROMPTS[:2]:
            ref = engine.generate(prompt, GenerationSettings(max_tokens=30, method="autoregressive"))
            for tree in ("mc_sim_7b_63", "chain_4"):
                got = engine.generate(prompt, GenerationSettings(max_tokens=30, method="medusa", medusa_tree=tree))
                assert_same_or_near_tie(tiny_target, prompt, ref.tokens, got.tokens, NEAR_TIE["f32"])
                assert len(got.tokens) == len(ref.tokens)


@pytest.mark.slow
def test_greedy_medusa_equals_autoregressive_smollm2(smollm2_path, demo_heads, tmp_path) -> None:
    """The heads' own tree, named so that it is verified whole every step (the sizer would cut it to what pays
    on this machine, often nothing)."""
    passes = tokens = 0
    with _engine(smollm2_path, demo_heads) as engine:
        own = tmp_path / "own.json"
        own.write_text(json.dumps(engine.medusa.choices))
        for prompt in (PROMPTS[0], PROMPTS[5]):
            ref = engine.generate(prompt, GenerationSettings(max_tokens=40, method="autoregressive"))
            got = engine.generate(prompt, GenerationSettings(max_tokens=40, method="medusa", medusa_tree=str(own)))
            assert_same_or_near_tie(smollm2_path, prompt, ref.tokens, got.tokens, NEAR_TIE["quantized"])
            passes += got.stats.target_passes
            tokens += len(got.tokens)
    assert tokens / passes > 1.3, f"the demo heads should get paths accepted ({tokens / passes:.2f} tokens per pass)"


def test_sized_trees_on_this_machine_keep_the_targets_text(smollm2_path, demo_heads) -> None:
    """With this machine's measured costs the sizer picks what pays (often nothing on a compute-bound 135M target);
    the text stays the target's own, exactly (q8_0 cache)."""
    with SpeculativeEngine.load(smollm2_path, options=DecoderOptions(n_ctx=1024),
                                medusa_path=demo_heads) as engine:
        ref = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=40, method="autoregressive"))
        got = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=40, method="medusa"))
        assert got.tokens == ref.tokens
        assert engine.costs is not None and engine.costs.long_sizes  # measured, long batches too


def test_sizer_cuts_every_generation_not_only_the_first(tiny_target, random_heads) -> None:
    """Where n tokens cost n decodes no tree pays, in the engine's second generation as in its first (the sizer
    kept across generations once met a freshly built tree and was dropped: whole 64-node trees, 0.18x)."""
    linear = CostModel([0.02 * n for n in range(1, 5)], 0.0, [16, 32, 64], [0.32, 0.64, 1.28])
    with _engine(tiny_target, random_heads, linear) as engine:
        for prompt in PROMPTS[:2]:
            got = engine.generate(prompt, GenerationSettings(max_tokens=20, method="medusa"))
            assert got.stats.drafted == 0 and got.stats.target_passes == 20
    with pytest.raises(ValueError, match="another tree"):
        SizedTree(TreeSizer(build_tree(TREES["chain_4"]), linear)).begin(
            [0], {"medusa": SimpleNamespace(tree=build_tree(TREES["mc_sim_15"]))})


def test_idle_heads_probe_at_a_bounded_cost() -> None:
    """With no tree paying, the heads run every 8th step while cheap, and at most 1% of the decode time when not."""
    sizer = TreeSizer(build_tree(TREES["mc_sim_15"]), CostModel([0.1, 0.2], 0.0))
    assert [sizer.wants_heads(1) for _ in range(16)] == ([False] * 7 + [True]) * 2
    sizer.probe_seconds = 0.04  # heads over a large vocabulary: 0.4 decodes
    runs = [sizer.wants_heads(1) for _ in range(400)]
    assert sum(runs) == 10 and runs[39]
    assert sizer.wants_heads(5)  # a tree always needs them
    # a probe that slowed the decode after it (numpy's threads): that counts against probing, not against trees
    tree = sizer.tree
    fresh = TreeSizer(tree, CostModel([0.1, 0.2], 0.0))
    fresh.observe(np.arange(tree.size), [7], 0.01, 1, 0.1 + 0.09)
    assert fresh.heads_seconds == pytest.approx(0.01) and fresh.probe_seconds == pytest.approx(0.1)
    fresh.observe(np.arange(tree.size), [7], 0.03, 1, 0.1)  # then the mean of the samples (not 0.2 of them)
    assert fresh.heads_seconds == pytest.approx(0.02) and fresh.probe_seconds == pytest.approx(0.065)


def test_heads_stop_being_probed_where_no_tree_could_pay() -> None:
    """Where a chain of heads that are always right would cost more a token than a plain step (this Zen 4's Q4_0
    batches of the bench pair; heads over the whole vocabulary at two decodes), the heads stop running once two
    probes have timed them; heads over fewer candidates go on being probed."""
    zen4 = CostModel([0.0322, 0.0587, 0.0854, 0.0877, 0.116], 0.0)
    tree = build_tree(TREES["mc_sim_15"])

    def probes(heads_seconds: float) -> int:
        sizer, runs = TreeSizer(tree, zen4), 0
        for _ in range(2000):
            nodes = sizer.plan(max_depth=5)
            assert len(nodes) == 1
            if sizer.wants_heads(len(nodes)):
                runs += 1
                sizer.observe(np.arange(tree.size), [-1], heads_seconds, 1, zen4.batch_seconds(1))
        return runs

    assert probes(0.066) == 2
    assert probes(0.012) > 20
    linear = TreeSizer(tree, CostModel([0.1, 0.2, 0.3, 0.4, 0.5], 0.0))
    assert not any(linear.wants_heads(1) for _ in range(100))  # n tokens for n decodes: not even free heads pay


def test_one_slow_tree_batch_does_not_price_trees_out() -> None:
    """A tree batch at 10x its expected time (a warm-up, a busy spell) moves the sizer's price of trees a bounded
    step, so a tree that pays is verified again (a tree priced out is never timed again); trees that keep
    costing more than expected are dropped."""
    tree = build_tree(TREES["mc_sim_15"])
    sizer = TreeSizer(tree, CostModel([0.1, 0.11, 0.12, 0.13, 0.14], 0.0))
    tokens = np.arange(100, 100 + tree.size)
    kept = [int(tokens[tree.choices.index((0,)) + 1]), 7]  # the head's best guess was right

    def tree_step(slower: float) -> int:
        n = len(sizer.plan(max_depth=5))
        sizer.observe(tokens, kept, 0.0, n, slower * sizer.costs.batch_seconds(n))
        return n

    assert tree_step(10.0) > 1
    assert len(sizer.plan(max_depth=5)) > 1
    assert 1 in [tree_step(3.0) for _ in range(10)]


def test_trees_priced_out_by_a_busy_spell_are_tried_again() -> None:
    """While no tree runs, the price that tree batches raised ages back toward the measured costs, so the heads are
    probed again and a tree that pays is verified again; one that keeps costing 3x is dropped again."""
    tree = build_tree(TREES["mc_sim_15"])
    sizer = TreeSizer(tree, CostModel([0.1, 0.11, 0.12, 0.13, 0.14], 0.0))
    tokens = np.arange(100, 100 + tree.size)
    kept = [int(tokens[tree.choices.index((0,)) + 1]), 7]

    def step(slower: float) -> int:
        n = len(sizer.plan(max_depth=5))
        probe = n > 1 or sizer.wants_heads(n)
        sizer.observe(tokens if probe else None, kept if probe else [7], 0.0, n, slower * sizer.costs.batch_seconds(n))
        return n

    sizes = [step(3.0) for _ in range(30)]
    assert sizes[0] > 1 and sizes[-1] == 1 and sizer.tree_factor > 1.3, "a busy spell priced trees out"
    sizes = [step(1.0) for _ in range(600)]
    assert max(sizes[-100:]) > 1, "once the price has aged, a tree that pays runs again"
    assert sizer.tree_factor < 1.1
    sizes = [step(3.0) for _ in range(600)]
    assert sum(n > 1 for n in sizes[-400:]) <= 10, "trees that keep costing 3x are tried again only now and then"


def test_tree_sizer_verifies_what_pays_parents_first() -> None:
    tree = build_tree(TREES["mc_sim_15"])
    linear = CostModel([0.02 * n for n in range(1, 5)], 0.0, [16, 32, 64], [0.32, 0.64, 1.28])
    flat = trees_pay()
    assert list(TreeSizer(tree, linear).plan(max_depth=5)) == [0]  # n tokens cost n decodes: no tree pays
    sizer = TreeSizer(tree, flat)
    nodes = sizer.plan(max_depth=5)
    assert len(nodes) > tree.size // 2 and nodes[0] == 0  # nearly free batches: most of the tree
    seen = {0}
    for i in nodes[1:]:  # each node after its parent
        assert tree.parents[i] in seen
        seen.add(int(i))
    assert max(tree.depth[sizer.plan(max_depth=1)]) == 1  # near the token limit: no node deeper than allowed
    # the target committed the tokens of choice [0, 1] then a token of its own: that path's nodes count as kept,
    # every other node as missed (all of them proposed, verified or not)
    tokens = np.arange(100, 100 + tree.size)
    path = [tree.choices.index((0,)) + 1, tree.choices.index((0, 1)) + 1]
    before = sizer.kept.copy()
    sizer.observe(tokens, [int(tokens[path[0]]), int(tokens[path[1]]), 7], 0.001, len(nodes), 0.0)
    rose = set(np.flatnonzero(sizer.kept > before))
    assert rose == set(path) and sizer.kept[0] == 1.0
    # a node that keeps missing drops out of the plan while the path that keeps matching stays
    for _ in range(200):
        sizer.observe(tokens, [int(tokens[path[0]]), int(tokens[path[1]]), 7], 0.001, len(nodes), 0.0)
    costly = TreeSizer(tree, CostModel([0.02, 0.025, 0.03, 0.035], 0.0, [16, 32, 64], [0.2, 0.4, 0.8]))
    costly.kept = sizer.kept
    assert set(costly.plan(max_depth=5)) == {0, *path}


def test_walk_samples_exactly_like_the_target_token_by_token() -> None:
    """At temperature > 0 the walk draws each committed token from the target's distribution at that
    position, with the same generator calls as autoregressive sampling: exact, not an approximation."""
    tree = load_tree("mc_sim_7b_63")
    params = SamplingParams(temperature=0.9, top_p=0.95)
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = rng.normal(0, 2, (tree.size, 50))
        tokens = rng.integers(0, 50, tree.size)
        for node in range(1, tree.size):  # siblings hold distinct tokens, as top-k candidates do
            kids = tree.children(node)
            tokens[kids] = rng.permutation(50)[: len(kids)]
        tokens[tree.children(0)] = rng.permutation(50)[: len(tree.children(0))]
        path, last = walk(tree, tokens, logits, params, np.random.default_rng(seed))
        ref_rng = np.random.default_rng(seed)
        for a, b in zip(path, path[1:]):  # every accepted node is the target's own draw at its parent
            assert tokens[b] == pick(logits[a], params, ref_rng)
        assert last == pick(logits[path[-1]], params, ref_rng)
        assert last not in tokens[tree.children(path[-1])]


def _count_steps(monkeypatch) -> dict[str, int]:
    """Counts, as `auto` runs, the lookup guesses it verifies and the Medusa trees."""
    ran = {"lookup": 0, "tree": 0}
    observe = AutoPolicy.observe

    def observed(self, plan, draft, verdict, timing) -> None:
        ran["lookup"] += plan.source == "lookup"
        ran["tree"] += draft.tree is not None
        observe(self, plan, draft, verdict, timing)

    monkeypatch.setattr(AutoPolicy, "observe", observed)
    return ran


def test_auto_with_heads_verifies_lookup_guesses_and_sized_trees(smollm2_path, demo_heads, monkeypatch) -> None:
    """`auto` with heads and no draft model: lookup's guess where the text repeats and its cost model expects more
    tokens a second from it than from the sized tree, else the tree; the target's text either way. The costs given
    say trees pay, so a fresh engine's first steps verify trees (until real tree batches teach the sizer what they
    cost here); the code repeats its own names, so lookup guesses too."""
    steps = _count_steps(monkeypatch)
    # costs where trees and lookup guesses pay, kept so (this CPU's may rightly turn lookup off)
    with _engine(smollm2_path, demo_heads, trees_pay()) as engine:
        assert engine.method_for(GenerationSettings()).name == "auto"
        got = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=48))
        ref = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=48, method="autoregressive"))
    assert_same_or_near_tie(smollm2_path, PROMPTS[0], ref.tokens, got.tokens, NEAR_TIE["quantized"])
    assert steps["lookup"] >= 2 and steps["tree"] >= 1, steps
    assert got.stats.accepted > 0 and got.stats.target_passes < len(got.tokens)


def test_auto_with_heads_verifies_every_guess_lookup_chose_unless_a_tree_runs(smollm2_path, demo_heads,
                                                                             monkeypatch) -> None:
    """Against a plain step, lookup's own choice stands, its probes too (they expect less than a plain step, and were
    dropped unverified and unjudged when weighed against the plain step's rate); only a tree that pays more takes
    a guess's place."""
    planned, probes, verified, dropped = [0], [0], [0], []
    plan_, observe = AutoPolicy.plan, AutoPolicy.observe

    def plan(self, *a):
        got = plan_(self, *a)
        planned[0] += got.source == "lookup"
        probes[0] += got.source == "lookup" and self.source.probing
        if self.guess_planned != (got.source == "lookup"):  # a guess held that is neither verified nor withdrawn
            dropped.append(got)
        return got

    def observed(self, plan, *a):
        verified[0] += plan.source == "lookup"
        observe(self, plan, *a)

    monkeypatch.setattr(AutoPolicy, "plan", plan)
    monkeypatch.setattr(AutoPolicy, "observe", observed)
    # batches where trees of these heads seldom pay and a lookup guess kept 90% of the time would: chance n-gram
    # guesses fail, their record turns lookup off for them, and it probes
    costs = FixedCosts([0.02, 0.035, 0.045, 0.055, 0.065], 0.0, [16, 32, 64], [0.1, 0.2, 0.4])
    with _engine(smollm2_path, demo_heads, costs) as engine:
        for prompt in PROMPTS[:4]:
            engine.generate(prompt, GenerationSettings(max_tokens=64))
    assert probes[0] >= 1 and verified[0] == planned[0] and not dropped, (probes, planned, verified, dropped)


@pytest.mark.slow
def test_sampled_auto_with_heads_follows_the_target(tiny_target, random_heads, monkeypatch) -> None:
    """`auto` with heads when sampling: the first three tokens (the first from the prompt's pass, the others each
    from a lookup guess, a tree or a plain pass) follow the target's tempered top-k distribution. Lookup's guesses are
    most of the steps judged here; the sizer soon finds these random heads' trees do not pay, and sampled trees alone
    are tested below."""
    ran = _count_steps(monkeypatch)
    # the sizer learns what the seeds make the heads keep, not this machine's timings: in one CI run trees were priced
    # out after the first (1 tree step in 2000 answers; without timings, 21 here)
    sizer_observe = TreeSizer.observe
    monkeypatch.setattr(TreeSizer, "observe", lambda self, tokens, new, heads_seconds, n_verified, verify_seconds:
                        sizer_observe(self, tokens, new, 0.0, n_verified, 0.0))
    params = SamplingParams(temperature=1.5, top_k=6)
    with open_decoder(tiny_target) as d:
        first = FirstTokens(d, d.vocab.tokenize("7 8 9 7 8 9 7 8 9 7"), params, lookup=True)
    with _engine(tiny_target, random_heads) as engine:
        for seed in range(3000):
            r = engine.generate(first.toks, GenerationSettings(max_tokens=4, sampling=params, seed=seed, draft_max=2))
            first.add(r.tokens)
    assert ran["lookup"] > 500 and ran["tree"] > 5, ran
    first.check()


def test_sampled_medusa_draws_what_the_target_draws(tiny_target, random_heads) -> None:
    """Same seed, same text as autoregressive sampling (until float noise of the tree batches moves a draw
    that sat on a boundary, which a few short runs almost never hit)."""
    with _engine(tiny_target, random_heads) as engine:
        for seed in range(3):
            s = dict(max_tokens=10, sampling=SamplingParams(temperature=0.8, top_k=50), seed=seed)
            ref = engine.generate(PROMPTS[1], GenerationSettings(method="autoregressive", **s))
            got = engine.generate(PROMPTS[1], GenerationSettings(method="medusa", **s))
            assert got.tokens == ref.tokens


def test_typical_acceptance_runs_within_the_limit(smollm2_path, demo_heads) -> None:
    """Typical acceptance keeps tree paths (more than one token a pass) and stops at max_tokens exactly, even where
    a kept path would run past it (the heads trained for SmolLM2: the tiny target's random ones are never kept)."""
    with _engine(smollm2_path, demo_heads) as engine:
        got = engine.generate(PROMPTS[0], GenerationSettings(
            max_tokens=25, method="medusa", medusa_tree="mc_sim_15", typical=True, sampling=SamplingParams(temperature=0.7),
            seed=1))  # a named tree runs whole: the sizer may rightly find no tree pays on this machine
    assert len(got.tokens) == 25 or got.stop_reason == "stop", (len(got.tokens), got.stop_reason)
    assert got.stats.accepted > 0 and got.stats.target_passes < len(got.tokens), got.stats


def test_medusa_sampling_is_exact_unless_typical_acceptance_is_asked_for(tiny_target, random_heads,
                                                                         monkeypatch) -> None:
    """Typical acceptance bends the promise (it keeps paths the target would not have drawn): a generation takes it
    only when asked (typical=True, --typical); by default every tree is judged by exact rejection sampling."""
    import ggufspec.verifier

    typical: list[int] = []
    monkeypatch.setattr(ggufspec.verifier, "walk_typical", lambda *a, **k: typical.append(1) or walk_typical(*a, **k))
    s = dict(max_tokens=8, method="medusa", medusa_tree="chain_4", sampling=SamplingParams(0.8), seed=0)
    with _engine(tiny_target, random_heads) as engine:
        assert engine.generate(PROMPTS[1], GenerationSettings(**s)).stats.target_passes > 2
        assert not typical
        engine.generate(PROMPTS[1], GenerationSettings(typical=True, **s))
    assert typical  # (what the check tells apart)


def test_typical_acceptance_keeps_the_deepest_typical_path() -> None:
    """Medusa's rule by hand: a node is typical when p(token) > min(0.09, 0.3 * exp(-entropy)) of its parent's
    distribution, and the deepest path of typical nodes is kept."""
    tree = build_tree([[0], [1], [0, 0]])  # nodes: 1 = rank 0, 2 = rank 1 (children of the root), 3 = child of 1
    root = np.log([0.7, 0.2, 0.05, 0.05])  # entropy 0.871: threshold min(0.09, 0.126) = 0.09
    flat = np.log([0.25, 0.25, 0.25, 0.25])  # entropy ln 4: threshold min(0.09, 0.075) = 0.075
    peaked = np.log([0.9, 0.05, 0.03, 0.02])  # entropy 0.428: threshold 0.09
    certain = np.array([50.0, 0.0, 0.0, 0.0])
    rng, params = np.random.default_rng(0), SamplingParams(temperature=1.0)
    # node 1 (token 1, p 0.2) and node 3 (token 0 after a flat row, p 0.25) are typical; node 2 (p 0.05) is not
    tokens = np.array([0, 1, 2, 0])
    assert walk_typical(tree, tokens, np.stack([root, flat, certain, certain]), params, rng) == ([0, 1, 3], 0)
    # after a peaked row, token 3 (p 0.02 < 0.09) is not typical: the path stops at node 1, whose row picks next
    tokens = np.array([0, 1, 2, 3])
    assert walk_typical(tree, tokens, np.stack([root, np.log([0.02, 0.02, 0.02, 0.94]), certain, certain]),
                        params, rng)[0] == [0, 1, 3]
    assert walk_typical(tree, tokens, np.stack([root, peaked, certain, certain]), params, rng)[0] == [0, 1]
    # p 0.12 after a row of entropy 0.516: over min(0.09, 0.3 * exp(-0.516) = 0.179), so typical (the smaller bound)
    sure = np.log([0.85, 0.12, 0.02, 0.01])
    assert walk_typical(tree, np.array([0, 1, 2, 0]), np.stack([sure, flat, certain, certain]), params, rng)[0] == [0, 1, 3]
    # a root whose every candidate is atypical keeps nothing
    assert walk_typical(tree, np.array([0, 3, 2, 0]), np.stack([root, flat, certain, certain]), params, rng)[0] == [0]


def test_kv_after_accepted_paths_equals_linear_decoding(smollm2_path, demo_heads) -> None:
    tree = load_tree("mc_sim_7b_63")
    with open_decoder(smollm2_path, **_medusa_kw()) as d:
        assert d.n_ubatch >= tree.size, "one llama.cpp step per tree"
        assert medusa_decoder_options(DecoderOptions(n_ubatch=16)).micro_batch >= tree.size
        heads = Heads.load(demo_heads, smollm2_path, d.n_embd, d.n_vocab)
        prompt = d.vocab.tokenize(PROMPTS[5])
        committed: list[int] = []
        verifier = Verifier(d, SamplingParams(), np.random.default_rng(0), hidden=True)
        steps = list(generate_steps(prompt, verifier, {"medusa": MedusaProposer(heads, tree)}, WholeTree(tree), 30))
        for step in steps:
            committed += step.tokens
        assert max(len(step.tokens) for step in steps) > 1, "no path was accepted: this test needs some"
        # the history is the prompt and every committed token but the last, which is not decoded yet
        assert d.history == prompt + committed[:-1]
        got = d.feed([committed[-1]])[-1]
        got_hidden = d.hidden_states()[-1]
    with open_decoder(smollm2_path, embeddings=True) as fresh:
        want = np.stack([fresh.feed([t])[-1] for t in prompt + committed])[-1]
        want_hidden = fresh.hidden_states()[-1]
    # bit for bit with the default q8_0 cache (an f16 one moved these logits by up to 0.71: the 64-node
    # batches take another attention kernel than single tokens there)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_hidden, want_hidden)


def test_medusa_tree_rooted_at_last_equals_linear_paths(tiny_target) -> None:
    """The layout Medusa verifies: node 0 is the undecoded last token, every candidate below it."""
    tree = load_tree("mc_sim_15")
    rng = np.random.default_rng(5)
    with open_decoder(tiny_target, **_medusa_kw()) as d:
        prefix = d.vocab.tokenize(PROMPTS[2])
        d.feed(prefix)
        tokens = rng.integers(10, 40_000, size=tree.size).tolist()
        logits = d.tree_logits(tokens, tree.parents.tolist())
        hidden = d.hidden_states()
    with open_decoder(tiny_target, embeddings=True) as lin:
        for node in (0, 3, tree.size - 1, int(np.argmax(tree.depth))):
            lin.rollback_to(0)
            row = lin.feed(prefix + [tokens[i] for i in tree.path(node)])[-1]
            np.testing.assert_allclose(logits[node], row, atol=1e-3, rtol=0, err_msg=f"node {node}")
            np.testing.assert_allclose(hidden[node], lin.hidden_states()[-1], atol=1e-3, rtol=0)


def _medusa_kw() -> dict:
    o = medusa_decoder_options(DecoderOptions())
    return dict(embeddings=o.embeddings, n_seq_max=o.n_seq_max, n_batch=o.n_batch, n_ubatch=o.n_ubatch)


# --- heads --------------------------------------------------------------------------------


@pytest.mark.parametrize("version,layers,outtype", [(2, 1, "f32"), (2, 2, "f16"), (1, 2, "f32"), (1, 0, "f32")])
def test_numpy_heads_equal_a_per_head_reference(tiny_target, tiny_weights, tmp_path, version, layers, outtype) -> None:
    rng = np.random.default_rng(11)
    blocks = _random_blocks(rng, 3, layers, H, 0.2) if layers else [[] for _ in range(3)]
    lm = [rng.normal(0, 1, (V, H)).astype(np.float32) for _ in range(3)] if version == 1 else None
    path = _write_heads(tmp_path / "h.gguf", blocks, lm, outtype)
    heads = Heads.load(path, tiny_target, H, V)
    h = rng.normal(0, 1, H).astype(np.float32)
    tol = dict(rtol=1e-3, atol=2e-2) if outtype == "f16" else dict(rtol=1e-4, atol=1e-3)
    for i in range(3):
        x = h.astype(np.float64)
        for w, b in blocks[i]:
            w = np.asarray(w, np.float16 if outtype == "f16" else np.float32).astype(np.float64)
            z = w @ x + np.asarray(b, np.float32)
            x = x + z / (1 + np.exp(-z))
        out = x @ (lm[i] if lm else tiny_weights["output.weight"]).astype(np.float64).T
        np.testing.assert_allclose(heads.logits(h)[i], out, **tol, err_msg=f"head {i}")
    top = heads.top_k(h, (5, 1, 3))
    for i, best in enumerate(top):
        assert list(best) == list(np.argsort(-heads.logits(h)[i], kind="stable")[: len(best)])


def test_heads_for_another_hidden_size_or_vocab_are_refused(tiny_target, tmp_path) -> None:
    rng = np.random.default_rng(2)
    wide = _write_heads(tmp_path / "wide.gguf", _random_blocks(rng, 2, 1, H * 2, 0.1))
    with pytest.raises(ModelFileError, match="hidden size 128"):
        Heads.load(wide, tiny_target, H, V)
    small_vocab = _write_heads(tmp_path / "v.gguf", _random_blocks(rng, 2, 1, H, 0.1),
                               [rng.normal(0, 1, (1000, H)) for _ in range(2)])
    with pytest.raises(ModelFileError, match="vocabulary of 1000"):
        Heads.load(small_vocab, tiny_target, H, V)
    r = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "--medusa", str(wide), "-n", "4", "hello"])
    assert r.exit_code == 2 and "hidden size 128" in r.output


def test_memory_check_counts_the_output_matrix_v2_heads_copy(tiny_target, random_heads, tmp_path, monkeypatch) -> None:
    """v2 heads with the whole vocabulary keep a float32 copy of the target's output matrix, so the engine's
    memory check counts it; v1 heads (their own LM heads) and a restricted vocabulary keep none of it."""
    from ggufspec import memory
    from ggufspec.gguf_check import read_header
    from ggufspec.medusa.heads import heads_memory

    header = read_header(tiny_target)
    assert [n for _, n in heads_memory(random_heads, header)] == [V * H * 4]
    assert heads_memory(random_heads, header, 4096) == []
    rng = np.random.default_rng(4)
    v1 = _write_heads(tmp_path / "v1.gguf", _random_blocks(rng, 2, 1, H, 0.1), [rng.normal(0, 1, (V, H)) for _ in range(2)],
                      outtype="f16")
    assert heads_memory(v1, header) == []
    options = DecoderOptions(n_ctx=1024).resolved()
    need = memory.needed_bytes(header, options.n_ctx, options.cache_type, options.cache_type_v)
    monkeypatch.setattr(memory, "available_bytes", lambda: need + V * H * 2)  # the model fits, the copy does not
    with pytest.raises(GGUFSpecError, match="not enough memory.*output matrix"):
        SpeculativeEngine.load(tiny_target, options=options, medusa_path=random_heads)
    SpeculativeEngine.load(tiny_target, options=options, medusa_path=random_heads, medusa_vocab=4096).close()


# --- trees --------------------------------------------------------------------------------


def test_standard_tree_arrays() -> None:
    t = load_tree("mc_sim_7b_63")
    assert t.size == 64 and t.top_k == (10, 10, 10, 2) and t.n_heads == 4
    assert t.parents[0] == -1 and all(t.parents[i] < i for i in range(1, t.size))
    for i, c in enumerate(t.choices, start=1):
        assert t.depth[i] == len(c) and t.rank[i] == c[-1] and t.head[i] == len(c) - 1
        assert len(t.path(i)) == len(c) + 1
    assert load_tree(None).size == 64
    assert [len(load_tree(n).choices) for n in ("mc_sim_31", "mc_sim_15", "chain_4")] == [31, 15, 4]
    assert load_tree("mc_sim_7b_63").truncated(2).n_heads == 2


def test_user_tree_file(tmp_path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    t = load_tree(str(f))
    assert t.size == 6 and t.top_k == (2, 2, 1)
    f.write_text(json.dumps({"choices": [[0], [0, 0]]}))
    assert load_tree(str(f)).size == 3


@pytest.mark.parametrize("content,match", [
    ("not json", "not a JSON tree file"),
    ("{\"x\": 1}", "expected a non-empty JSON list"),
    ("[]", "expected a non-empty JSON list"),
    ("[[0], [\"a\"]]", "expected a non-empty JSON list"),
    ("[[0], []]", "expected a non-empty JSON list"),
    ("[[0], [1, 0, 0]]", "prefix"),
    ("[[0], [-1]]", "negative"),
])
def test_malformed_tree_files_are_refused(tmp_path, content, match) -> None:
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(TreeError, match=match):
        load_tree(str(f))


def test_fitted_tree_is_the_best_prefix_closed_tree() -> None:
    """fit_tree against every prefix-closed tree of 4 nodes over 2 heads and ranks 0-2 (brute force)."""
    import itertools

    rng = np.random.default_rng(3)
    ranks = rng.choice([-1, 0, 1, 2], p=[0.2, 0.4, 0.25, 0.15], size=(2000, 2))
    ranks[rng.random(2000) < 0.3, 1] = 0  # head 1 right more often than chance
    paths = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    best = max(tree_accepted(ranks, [list(c) for c in combo]) for combo in itertools.combinations(paths, 4)
               if all(len(c) == 1 or c[:1] in combo for c in combo))
    fitted = fit_tree(ranks, 4)
    tree = build_tree(fitted)  # prefix-closed
    assert len(fitted) == 4 and tree_accepted(ranks, fitted) == pytest.approx(best)

    def walk_depth(r: list[int]) -> int:  # how far a walk down the tree gets when head k ranked the truth r[k]
        node = 0
        for d, want in enumerate(r):
            match = [k for k in tree.children(node) if tree.rank[k] == want]
            if not match:
                return d
            node = match[0]
        return len(r)

    assert tree_accepted(ranks, fitted) == pytest.approx(np.mean([walk_depth(r) for r in ranks.tolist()]))
    assert len(fit_tree(ranks, 1000)) == 12  # never more nodes than paths ever accepted
    with pytest.raises(TreeError):
        fit_tree(np.zeros((0, 2), dtype=int), 4)


def test_heads_bring_their_own_tree(tiny_target, trained_heads, tmp_path) -> None:
    """Heads with a tree in their GGUF: generate uses it unless --tree says otherwise."""
    # trained on the tiny target's random text, the heads are rarely right: a small tree at most
    fitted = Heads.load(trained_heads, tiny_target, H, V).choices
    assert fitted is None or (len(fitted) <= 63 and build_tree(fitted).n_heads <= 3)
    chain = _write_heads(tmp_path / "chain.gguf", _random_blocks(np.random.default_rng(1), 3, 1, H, 0.3),
                         choices=[[0]])
    with _engine(tiny_target, chain) as engine:
        ref = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=20, method="autoregressive"))
        own = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=20, method="medusa"))
        std = engine.generate(PROMPTS[0], GenerationSettings(max_tokens=20, method="medusa", medusa_tree="mc_sim_15"))
        assert engine.medusa_tree(GenerationSettings(method="medusa")).choices == ((0,),)
        assert engine.medusa_tree(GenerationSettings(method="medusa", medusa_tree="mc_sim_15")).choices == \
            build_tree(TREES["mc_sim_15"]).choices
    assert_same_or_near_tie(tiny_target, PROMPTS[0], ref.tokens, own.tokens, NEAR_TIE["f32"])
    # the heads' own tree is a chain of one: never a guess judged past the first position (the sizer may cut it
    # to nothing where guesses are rarely kept); a tree named is verified whole, 3 deep (the first pass drafts
    # nothing, nor do passes cut short by the token limit)
    assert len(own.stats.judged_at) <= 1
    assert std.stats.drafted >= 3 * (std.stats.target_passes - 3) and build_tree(TREES["mc_sim_15"]).n_heads == 3


def test_unknown_tree_and_missing_heads_exit_2(tiny_target, random_heads, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2]]")
    for args in (["--tree", "no_such_tree"], ["--tree", str(bad)]):
        r = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "--medusa", str(random_heads), "-n", "4",
                                      "-c", "256", *args, "hello"])
        assert r.exit_code == 2, r.output
        assert "error:" in r.output
    r = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "--method", "medusa", "hello"])
    assert r.exit_code == 2 and "--medusa" in r.output
    with pytest.raises(GGUFSpecError):
        build_tree([[0, 0]])


def test_cli_generate_medusa_json(tiny_target, random_heads) -> None:
    def run(*args: str) -> dict:
        r = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "-n", "12", "-c", "512", "--json", "--raw", *args,
                                         PROMPTS[1]])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout.strip().splitlines()[-1])

    got = run("--method", "medusa", "--medusa", str(random_heads), "--tree", "mc_sim_15")  # a tree named: verified whole
    want = run("--method", "autoregressive")
    assert_same_or_near_tie(tiny_target, PROMPTS[1], want["tokens"], got["tokens"], NEAR_TIE["f32"])
    assert got["stats"]["target_passes"] <= want["stats"]["target_passes"]


@pytest.mark.parametrize("soft_weight", [0.0, 1.0])
def test_soft_labels_steer_the_heads(tiny_target, soft_weight) -> None:
    """Heads follow the soft labels (the target's top-K after token i + k + 1) when weighted in, not otherwise.

    Real hidden states of the tiny target; soft labels that all put their mass on one token T. With
    soft_weight 1 the heads predict T for a large share of positions (a ResBlock cannot cancel x, so not all);
    with 0 only the text's own tokens count, and T is never among them.
    """
    from ggufspec.medusa.heads import target_lm_head
    from ggufspec.medusa.train import TrainConfig, collect_text, open_for_collection, train_heads, training_pairs

    d = open_for_collection(tiny_target, 1, 256, threads=1)
    try:
        corpus = collect_text(d, [" ".join(PROMPTS) * 3], 48)
    finally:
        d.close()
    T, K = 4242, 4
    corpus.top_ids = [np.tile(np.array([T, 5, 6, 7], dtype=np.int32), (len(t), 1)) for t in corpus.tokens]
    corpus.top_logits = [np.tile(np.array([8.0, 0, 0, 0], dtype=np.float16), (len(t), 1)) for t in corpus.tokens]
    pairs = training_pairs(corpus, 2)
    assert pairs.soft_ids.shape == (len(pairs.rows), 2, K) and len(set(pairs.seqs.tolist())) == len(corpus.tokens)
    lm = target_lm_head(tiny_target)
    blocks, history = train_heads(pairs, lm, TrainConfig(2, epochs=30, batch=32, lr=1e-2, valid_samples=40,
                                                         negatives=256, soft_weight=soft_weight))
    x = pairs.hidden[pairs.rows].astype(np.float32)
    share = []
    for (w, b), in blocks:
        z = x @ w.T + b
        share.append(float(((x + z / (1 + np.exp(-z))) @ lm.T).argmax(-1).__eq__(T).mean()))
    if soft_weight:
        assert min(share) > 0.4, share
    else:
        assert max(share) < 0.05, share
        assert len(history["top1_head0"]) == 30


def test_medusa_tree_command_fits_a_tree_file(tiny_target, tmp_path) -> None:
    """`medusa tree` on data where head 0 is always right and head 1 never: one node, rank 0; usable by --tree."""
    from ggufspec.medusa.heads import target_lm_head
    from ggufspec.medusa.train import Corpus

    lm = target_lm_head(tiny_target)
    zero = _write_heads(tmp_path / "zero.gguf", [[(np.zeros((H, H)), np.zeros(H))] for _ in range(2)])
    rng = np.random.default_rng(0)
    tokens = rng.integers(1000, 20000, size=200).astype(np.int32)
    # a zero ResBlock leaves h as it is: with h = the LM-head row of token i + 2, head 0 ranks that token first
    hidden = np.zeros((200, H), dtype=np.float16)
    hidden[:-2] = 4 * lm[tokens[2:]] / np.linalg.norm(lm[tokens[2:]], axis=1, keepdims=True)
    Corpus([tokens], [hidden]).save(tmp_path / "data.npz")
    r = CliRunner().invoke(main, ["medusa", "tree", str(tiny_target), str(zero), str(tmp_path / "data.npz"),
                                  str(tmp_path / "tree.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "tree.json").read_text())[0] == [0] and "~2.00 tokens per pass" in r.output
    assert load_tree(str(tmp_path / "tree.json")).choices[0] == (0,)
    Corpus([tokens], [np.zeros((200, H), dtype=np.float16)]).save(tmp_path / "flat.npz")  # heads never right
    r = CliRunner().invoke(main, ["medusa", "tree", str(tiny_target), str(zero), str(tmp_path / "flat.npz"),
                                  str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "no token" in r.output and not (tmp_path / "none.json").exists()


def test_openblas_workers_sleep_unless_the_user_chose() -> None:
    """Importing ggufspec first sets OpenBLAS's spin time low (heads' products then leave the cores to
    llama.cpp), and leaves a value the user set alone."""
    probe = "import ggufspec, numpy, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}

    def timeout(e: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True, check=True).stdout.strip()

    assert timeout(env) == "4"
    assert timeout({**env, "OPENBLAS_THREAD_TIMEOUT": "12"}) == "12"
