"""Medusa heads with a restricted candidate vocabulary: same logits on the kept ids, exact output, bad values."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import TINY
from test_equivalence import NEAR_TIE, PROMPTS, assert_same_or_near_tie
from test_medusa import V, _random_blocks, _write_heads, demo_heads, random_heads, trees_pay  # noqa: F401 (fixtures)
from ggufspec.cli import main
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.errors import GGUFSpecError
from ggufspec.medusa.candidates import CandidateVocabError, candidate_ids
from ggufspec.medusa.heads import Heads, load_medusa_gguf

H = TINY.n_embd


@pytest.mark.parametrize("version", [2, 1])
def test_restricted_heads_equal_a_numpy_reference_on_the_same_ids(tiny_weights, tmp_path, version) -> None:
    rng = np.random.default_rng(5)
    blocks = _random_blocks(rng, 2, 1, H, 0.2)
    lm = [rng.standard_normal((V, H), dtype=np.float32) for _ in range(2)] if version == 1 else None
    path = _write_heads(tmp_path / "h.gguf", blocks, lm)
    ids_file = tmp_path / "ids.txt"
    chosen = rng.choice(V, 3000, replace=False)
    ids_file.write_text("# some ids\n" + ", ".join(map(str, chosen[:1500])) + "\n" + " ".join(map(str, chosen[1500:])))
    for spec, keep in ((4096, (2, 40000)), (str(ids_file), ())):
        # Heads.load as the engine calls it is covered below; reading the target's output matrix from a GGUF
        # (GGUFReader parses the whole 49k-token vocabulary: seconds) is skipped here for the test's time.
        raw = load_medusa_gguf(path)
        heads = Heads(raw, None if lm else tiny_weights["output.weight"], candidate_ids(spec, V, keep))
        ids = np.union1d(np.arange(4096) if isinstance(spec, int) else chosen, np.array(keep, dtype=np.int64))
        assert list(heads.ids) == list(ids) and heads.n_candidates == len(ids) and heads.vocab == V
        h = rng.normal(0, 1, H).astype(np.float32)
        for i in range(2):
            x = h.astype(np.float64)
            for w, b in blocks[i]:
                z = np.asarray(w, np.float32).astype(np.float64) @ x + np.asarray(b, np.float32)
                x = x + z / (1 + np.exp(-z))
            full = x @ (lm[i] if lm else tiny_weights["output.weight"]).astype(np.float64).T
            np.testing.assert_allclose(heads.logits(h)[i], full[ids], rtol=1e-4, atol=1e-3, err_msg=f"head {i}")
            top = heads.top_k(h, (10, 3))[i]
            want = ids[np.argsort(-full[ids], kind="stable")[: len(top)]]
            assert list(top) == list(want)  # real token ids, best first


def test_greedy_medusa_with_a_restricted_vocabulary_equals_autoregressive_smollm2(smollm2_path, demo_heads) -> None:
    opts = DecoderOptions(n_ctx=512)
    with SpeculativeEngine.load(smollm2_path, options=opts, medusa_path=demo_heads, medusa_vocab=2048,
                                costs=trees_pay()) as engine:  # whole trees, not what pays on this CPU
        heads = engine.medusa
        assert heads.n_candidates == 2048 and {0, 1, 2} <= set(heads.ids.tolist())  # <|endoftext|>, <|im_*|>
        prompt = PROMPTS[0]
        ref = engine.generate(prompt, GenerationSettings(max_tokens=28, method="autoregressive"))
        # a named tree is verified whole (the sizer would learn that trees do not pay on this CPU)
        got = engine.generate(prompt, GenerationSettings(max_tokens=28, method="medusa", medusa_tree="mc_sim_7b_63"))
    assert_same_or_near_tie(smollm2_path, prompt, ref.tokens, got.tokens, NEAR_TIE["quantized"])
    assert any(t >= 2048 for t in ref.tokens), "the text should need tokens outside the candidate set"
    rate = len(got.tokens) / got.stats.target_passes
    assert rate > 1.1, f"restricted heads should still get paths accepted ({rate:.2f} tokens per pass)"


def test_special_ids_stay_in_the_set() -> None:
    assert list(candidate_ids(3, 100, keep={2, 50, 99})) == [0, 1, 2, 50, 99]
    assert candidate_ids(100, 100) is None  # the whole vocabulary: no restriction
    assert candidate_ids(None, 100) is None


@pytest.mark.parametrize("content,match", [
    (None, "cannot read"),
    ("", "holds no token ids"),
    ("1 2 x3", "not a token id: 'x3'"),
    ("1, 2.5", "not a token id"),
    ("[1, \"a\"]", "JSON list of integer"),
    ("[1, 2", "not a JSON list"),
    ("5 49152", "outside the target's vocabulary"),
    ("-1", "outside"),
])
def test_malformed_id_files_are_refused(tmp_path, content, match) -> None:
    f = tmp_path / "ids.txt"
    if content is not None:
        f.write_text(content)
    with pytest.raises(CandidateVocabError, match=match):
        candidate_ids(str(f), V)


def test_bad_counts_are_refused(random_heads) -> None:
    for n in (0, -3, V + 1):
        with pytest.raises(CandidateVocabError, match=f"1..{V}"):
            candidate_ids(n, V)
    heads = Heads(load_medusa_gguf(random_heads), np.zeros((V, H), np.float32), candidate_ids(5, V))
    with pytest.raises(CandidateVocabError, match="top 10 tokens"):
        heads.top_k(np.zeros(H, np.float32), (10, 2))
    assert issubclass(CandidateVocabError, GGUFSpecError)


def test_cli_medusa_vocab(tiny_target, random_heads, tmp_path) -> None:
    def run(*args: str):
        return CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "-n", "10", "-c", "256", "--json", "--raw",
                                         "--medusa", str(random_heads), *args, PROMPTS[1]])

    ref = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "-n", "10", "-c", "256", "--json", "--raw",
                                    "--method", "autoregressive", PROMPTS[1]])
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(300))))
    r = run("--medusa-vocab", str(ids))
    assert r.exit_code == 0, r.output
    got, want = (json.loads(x.stdout.strip().splitlines()[-1])["tokens"] for x in (r, ref))
    assert_same_or_near_tie(tiny_target, PROMPTS[1], want, got, NEAR_TIE["f32"])
    wide = tmp_path / "wide.json"  # 20 top-1 choices: head 0 needs 20 candidates, the set holds 17 (specials + id 0)
    wide.write_text(json.dumps([[i] for i in range(20)]))
    for args, match in ((["--medusa-vocab", "99999"], "1..49152"),
                        (["--medusa-vocab", str(tmp_path / "missing.txt")], "cannot read"),
                        (["--medusa-vocab", "1", "--tree", str(wide)], "top 20 tokens")):
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert "error:" in r.output and match in r.output, r.output
    r = CliRunner().invoke(main, ["generate", "-m", str(tiny_target), "--medusa-vocab", "100", "hello"])
    assert r.exit_code == 2 and "--medusa" in r.output


def test_bench_takes_a_candidate_vocabulary(tiny_target, random_heads, tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS[1] + "\n")
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "--medusa", str(random_heads), "-p", str(prompts),
                                  "--method", "autoregressive", "--method", "medusa", "--medusa-vocab", "300",
                                  "--repeats", "1", "--warmup", "0", "-n", "6", "-c", "256", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["meta"]["medusa_vocab"] == 300
    assert {run["method"] for run in data["runs"]} == {"autoregressive", "medusa"}
    for args, match in ((["--medusa-vocab", "100"], "--medusa"),
                        (["--medusa", str(random_heads), "--medusa-vocab", "99999"], "1..49152")):
        r = CliRunner().invoke(main, ["bench", "-m", str(tiny_target), "-p", str(prompts), *args])
        assert r.exit_code == 2 and match in r.output, r.output
