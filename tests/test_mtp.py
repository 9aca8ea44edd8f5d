"""MTP heads: the target's own multi-token-prediction block (Qwen3.5's nextn), on a tiny random qwen35 (and qwen35moe)
with one block written with gguf-py. The head reads the target's hidden rows as llama.cpp's draft-mtp does, and the
text stays the target's own: greedy at every draft length, alone and in a pool, and sampled; where the model has no
block or llama-cpp-python cannot run it, one line says so and `auto` drafts without it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, FirstTokens, FixedCosts
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.mtp import HiddenRows, MtpDecoder
from ggufspec.pool import EnginePool
from ggufspec.sampling import SamplingParams
from test_hybrid import PROMPTS, SAME_STATE, assert_greedy_equal

LENGTHS = (1, 2, 3, 4)
# Prices under which the MTP head's chains pay (a step a twentieth of a decode) and a draft model's do not, and the
# other way round: `auto` must draft from the one that pays
CHEAP_HEAD = dict(verify=[1.0, 1.1, 1.2, 1.3, 1.4], draft=2.0, mtp=0.05, mtp_catch_up=0.005)
CHEAP_DRAFT = dict(verify=[1.0, 1.1, 1.2, 1.3, 1.4], draft=0.05, mtp=2.0, mtp_catch_up=0.2)
NO_MTP_LIBRARY = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):  # as llama_cpp_ext raises where its library lacks a symbol
    def find_spec(self, name, path, target=None):
        if name == "llama_cpp.llama_cpp_ext":
            raise AttributeError("None of the shared library symbols were found: llama_set_embeddings_nextn")
sys.meta_path.insert(0, Missing())
from ggufspec.cli import main
main()
"""


def settings(method: str, k: int = 4, **kw) -> GenerationSettings:
    return GenerationSettings(max_tokens=24, method=method, draft_max=k, **kw)


def test_hidden_rows_follow_the_targets_positions() -> None:
    rows = HiddenRows(2, cap=6)
    block = lambda a, b: np.arange(a, b, dtype=np.float32)[:, None].repeat(2, 1)  # noqa: E731  (row p holds p)
    rows.put(0, block(0, 4))
    rows.cut(2)  # a rollback, then other tokens
    rows.put(2, block(2, 5))
    assert (rows.lo, rows.hi) == (0, 5) and rows.row(4)[0] == 4 and rows.row(5) is None
    rows.put(5, block(5, 8))  # past the cap: the oldest go
    assert (rows.lo, rows.hi) == (2, 8) and rows.row(1) is None and rows.row(7)[0] == 7
    rows.shift(3, 2)  # a context shift: 3 and 4 go, the later ones move down by 2
    assert (rows.lo, rows.hi) == (2, 6) and [rows.row(p)[0] for p in range(2, 6)] == [2, 5, 6, 7]
    rows.put(9, block(9, 10))  # a gap: never read across
    assert (rows.lo, rows.hi) == (9, 10) and rows.row(8) is None


def test_the_head_reads_the_targets_rows_as_a_fresh_head_does(mtp_model) -> None:
    """After a prompt read in chunks (batches of 16) and drafts kept and rejected (the head's own guesses decoded
    again with the target's rows once judged), its logits after the text are a fresh head's that read the text in one
    batch, and far from a head's that read zeros in place of the target's rows: the rows matter, and each token
    reads the one before it."""
    target, _ = mtp_model
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512, n_batch=16)) as engine:
        r = engine.generate(PROMPTS[0] * 8, settings("mtp", 3))
        assert 0 < r.stats.accepted < r.stats.drafted
        context = [*engine.target.history, r.tokens[-1]]
        got = engine.mtp.sync(context)[-1]
    with LlamaCppDecoder(target, DecoderOptions(n_ctx=512, mtp=True)) as t:
        t.feed(context[:-1])
        fresh = MtpDecoder.open(t)
        want = fresh.sync(context)[-1]
        t.hidden_rows.clear()
        blind = MtpDecoder.open(t)
        zeros = blind.sync(context)[-1]
        fresh.close()
        blind.close()
    assert np.abs(got - want).max() < SAME_STATE < 1.0 < np.abs(zeros - want).max()


def _greedy(engine: SpeculativeEngine, target, methods: tuple[str, ...]) -> tuple[int, int, set[str]]:
    """Every method at every draft length gives the target's greedy text on PROMPTS; tokens drafted and kept, and
    what `auto` drafted from."""
    drafted = kept = 0
    decisions = set()
    for prompt in PROMPTS:
        ref = engine.generate(prompt, settings("autoregressive"))
        for method in methods:
            for k in LENGTHS:
                got = engine.generate(prompt, settings(method, k))
                assert_greedy_equal(target, prompt, ref.tokens, got.tokens)
                drafted, kept = drafted + got.stats.drafted, kept + got.stats.accepted
                decisions.add(got.stats.decision) if method == "auto" else None
    return drafted, kept, decisions


def test_greedy_text_is_the_targets_alone(mtp_model) -> None:
    """`mtp`, and `auto` where the head's steps pay, at draft lengths 1-4 on the hybrid target: its state goes back by
    snapshots, the head's by removing cells."""
    target, _ = mtp_model
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512), costs=FixedCosts(**CHEAP_HEAD)) as engine:
        drafted, kept, decisions = _greedy(engine, target, ("mtp", "auto"))
        rollbacks = engine.target.rollbacks
    assert drafted > 200 and 0.2 < kept / drafted < 0.9, (drafted, kept)
    assert all("MTP head" in d for d in decisions) and rollbacks.snapshots > 20, (decisions, rollbacks)


def test_a_mixture_of_experts_targets_head_keeps_its_text(mtp_moe_model) -> None:
    """qwen35moe (Qwen3.5's MoE: routed experts and a shared one in every MLP, the MTP block's too) runs by the same
    path: `mtp` and `auto` at draft lengths 1-4 give the target's greedy text, the head's guesses kept often; so
    does `mtp` in a pool of two slots."""
    target = mtp_moe_model
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512), costs=FixedCosts(**CHEAP_HEAD)) as engine:
        assert engine.mtp is not None
        drafted, kept, decisions = _greedy(engine, target, ("mtp", "auto"))
        refs = [engine.generate(p, settings("autoregressive")).tokens for p in PROMPTS]
    assert drafted > 200 and 0.2 < kept / drafted < 0.9, (drafted, kept)
    assert all("MTP head" in d for d in decisions), decisions
    drafted = 0
    with EnginePool.load(target, None, DecoderOptions(n_ctx=1024), parallel=2, costs=FixedCosts(**CHEAP_HEAD)) as pool:
        for k in (2, 4):
            for i, r in pool.stream_many(PROMPTS, settings("mtp", k)):
                assert not isinstance(r, Exception), r
                if r.finish_reason is not None:
                    assert_greedy_equal(target, PROMPTS[i], refs[i], r.result.tokens)
                    drafted += r.result.stats.drafted
    assert drafted > 50, drafted


def test_auto_drafts_from_whichever_of_the_head_and_a_draft_model_pays(mtp_model) -> None:
    target, draft = mtp_model
    for prices, source, other in ((CHEAP_HEAD, "MTP head", "draft model"), (CHEAP_DRAFT, "draft model", "MTP head")):
        with SpeculativeEngine.load(target, draft, DecoderOptions(n_ctx=512), costs=FixedCosts(**prices)) as engine:
            drafted, _, decisions = _greedy(engine, target, ("auto",))
        drafted_from = [d.split(";")[0] for d in decisions]  # "drafted on 9 of 12 passes (MTP head 7, lookup 2)"
        assert drafted > 50 and all(source in d and other not in d for d in drafted_from), decisions


def test_greedy_text_is_the_targets_with_two_slots(mtp_model) -> None:
    """Every slot's MTP steps run in one batch of the shared MTP context, as a draft model's."""
    target, _ = mtp_model
    prompts = [*PROMPTS, "Once upon a time", "import numpy as np\n"]
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512)) as engine:
        refs = [engine.generate(p, settings("autoregressive")).tokens for p in prompts]
    drafted = 0
    with EnginePool.load(target, None, DecoderOptions(n_ctx=1024), parallel=2, costs=FixedCosts(**CHEAP_HEAD)) as pool:
        for method in ("mtp", "auto"):
            for k in LENGTHS:
                for i, r in pool.stream_many(prompts, settings(method, k)):
                    assert not isinstance(r, Exception), r
                    if r.finish_reason is not None:
                        assert_greedy_equal(target, prompts[i], refs[i], r.result.tokens)
                        drafted += r.result.stats.drafted
        heads = [s.engine.mtp for s in pool.slots]
        together = [h.n_batched_tokens - h.n_decoded_tokens for h in heads]  # the other slot's tokens beside its own
    assert drafted > 200 and all(n > 100 for n in together), (drafted, together)


@pytest.mark.slow
def test_sampling_follows_the_target_with_the_heads_q(mtp_model) -> None:
    """The first three tokens sampled with the head's drafts (after the prompt's pick, each with the head's
    distribution as q, judged by rejection sampling) follow the target's own (top-k, tempered) distribution."""
    target, _ = mtp_model
    params = SamplingParams(temperature=1.5, top_k=6)
    with LlamaCppDecoder(target, DecoderOptions(n_ctx=512)) as d:
        first = FirstTokens(d, d.vocab.tokenize(PROMPTS[0]), params)
    accepted = drafted = 0
    with SpeculativeEngine.load(target, None, DecoderOptions(n_ctx=512)) as engine:
        for seed in range(2000):
            r = engine.generate(first.toks, GenerationSettings(max_tokens=4, sampling=params, seed=seed, method="mtp",
                                                               draft_max=2))
            first.add(r.tokens)
            accepted, drafted = accepted + r.stats.accepted, drafted + r.stats.drafted
    assert 0.05 < accepted / drafted < 0.95, (accepted, drafted)  # the head's guesses are judged both ways
    first.check()


def _cli(*args: object, script: str | None = None) -> subprocess.CompletedProcess:
    head = ["-c", script] if script else ["-m", "ggufspec.cli"]
    return subprocess.run([sys.executable, *head, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def _generate(model, *args: str, script: str | None = None) -> tuple[dict, list[str]]:
    """generate's JSON and its fallback lines ("... without an MTP head"), checked: exit code 0, no traceback."""
    r = _cli("generate", "-m", model, "-c", "512", "-n", "12", "--raw", "--json", *args, PROMPTS[0], script=script)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout), [line for line in r.stderr.splitlines() if "without an MTP head" in line]


def test_an_mtp_model_drafts_with_its_head_by_default_and_says_so(mtp_model) -> None:
    target, _ = mtp_model
    out, lines = _generate(target)
    ref, _ = _generate(target, "--method", "autoregressive")
    assert out["tokens"] == ref["tokens"] and out["stats"]["method"] == "auto" and not lines
    stats = _cli("generate", "-m", target, "-c", "512", "-n", "12", "--stats", PROMPTS[0]).stderr.splitlines()[-1]
    # what it drafted from, or why the head stayed off
    said = r"\| (drafted on [^|]*MTP head \d|speculation off: the MTP head: |[^|]*the MTP head off: )"
    assert re.search(said, stats), stats
    doctor = _cli("doctor", "-m", target)
    assert "MTP head: 1 block, and this llama-cpp-python runs it" in doctor.stdout, doctor.stdout + doctor.stderr


def test_a_model_without_mtp_layers_runs_auto_with_one_line(tiny_target) -> None:
    out, lines = _generate(tiny_target, "--method", "mtp")
    ref, _ = _generate(tiny_target, "--method", "autoregressive")
    assert out["tokens"] == ref["tokens"] and out["stats"]["method"] == "auto"
    assert lines == [f"ggufspec: {tiny_target.name} has no MTP layers: --method mtp runs as auto, without an MTP head"]


@pytest.mark.parametrize("method", [None, "mtp"])
def test_a_library_without_the_mtp_functions_runs_auto_with_one_line(mtp_model, method) -> None:
    """llama_cpp_ext raises at import where the library lacks a staging function (simulated): one line names it."""
    target, _ = mtp_model
    args = ("--method", method) if method else ()
    out, lines = _generate(target, *args, script=NO_MTP_LIBRARY)
    ref, _ = _generate(target, "--method", "autoregressive")
    assert out["tokens"] == ref["tokens"] and len(lines) == 1, lines
    assert "cannot run them: llama_cpp.llama_cpp_ext does not load (None of the shared library symbols were found: " \
           "llama_set_embeddings_nextn)" in lines[0]
    # --method mtp runs as auto; no method is a plain model's default: autoregressive without a draft model
    assert out["stats"]["method"] == ("auto" if method else "autoregressive")
    assert lines[0].endswith("--method mtp runs as auto, without an MTP head" if method else
                             "running without an MTP head")
    doctor = _cli("doctor", "-m", target, script=NO_MTP_LIBRARY)
    assert "MTP head: 1 block, not used: " in doctor.stdout and "cannot run them" in doctor.stdout, doctor.stdout
