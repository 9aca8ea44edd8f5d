"""Session fixtures: real llama.cpp models (tiny random GGUFs written here, and SmolLM2-135M)."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare

from ggufspec import cpu_backend
from ggufspec.costs import CostModel
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.sampling import SamplingParams, probabilities
from tiny_models import (HybridConfig, TinyConfig, hybrid_weights, noisy_copy, random_weights, read_tokenizer,
                         write_hybrid_gguf, write_tiny_gguf)

# One llama.cpp thread per context: tiny models gain nothing from two, and a second thread
# waiting at llama.cpp's barriers makes tests crawl whenever another process holds a core.
os.environ.setdefault("GGUFSPEC_THREADS", "1")
# Tests that open models with llama_cpp.Llama directly get the same safe CPU kernels as ggufspec's decoders
# (on Xeons with AMX, llama.cpp's AMX kernels crash this build: see cpu_backend).
CPU_BACKEND = cpu_backend.prepare()
# A test run started in the background by a script inherits SIGINT ignored, and so would every command the tests
# interrupt (a run launched so here failed all six Ctrl-C tests): they get the default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise a run under nohup: its commands would keep SIGHUP ignored, as they rightly do for nohup (outputs.py), and
# the SIGHUP test would see its convert finish (a CI run started so here failed only that test).
if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# GGUFSPEC_TEST_GPU_LAYERS=-1 (or N) opens every decoder whose test does not choose its GPU layers with that many, so
# the exactness tests check a CUDA or Metal build's kernels too. Commands the tests start stay on the CPU.
if _GPU_ENV := os.environ.get("GGUFSPEC_TEST_GPU_LAYERS"):
    try:
        _GPU_LAYERS, _plain_init = int(_GPU_ENV), DecoderOptions.__init__
    except ValueError:
        raise pytest.UsageError(f"GGUFSPEC_TEST_GPU_LAYERS takes a number of layers (-1: all), "
                                f"got {_GPU_ENV!r}") from None

    def _init_on_gpu(self, *args, n_gpu_layers: int = _GPU_LAYERS, **kwargs) -> None:
        _plain_init(self, *args, n_gpu_layers=n_gpu_layers, **kwargs)

    DecoderOptions.__init__ = _init_on_gpu

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = Path(os.environ.get("GGUFSPEC_TEST_MODEL", REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
TINY = TinyConfig()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    if not SMOLLM2.exists():
        pytest.fail(f"{SMOLLM2} is missing: run `bash .ci/run` once (it fetches the demo model), "
                    "or set GGUFSPEC_TEST_MODEL to SmolLM2-135M-Instruct.Q4_1.gguf")
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_q4_0(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 requantized to Q4_0: a real second model close to the target but not equal, and the type llama.cpp
    repacks on x86 (and AMX would take)."""
    from ggufspec.convert.quantize import quantize

    out = tmp_path_factory.mktemp("q4_0") / "SmolLM2-135M-Instruct.Q4_0.gguf"
    quantize(smollm2_path, out, "q4_0", threads=2, allow_requantize=True)
    return out


@pytest.fixture(scope="session")
def tokenizer_fields(smollm2_path):
    return read_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_weights():
    return random_weights(TINY, 49152, seed=0)


@pytest.fixture(scope="session")
def tiny_target(tiny_dir, tokenizer_fields, tiny_weights) -> Path:
    """Random weights with SmolLM2's vocabulary."""
    return write_tiny_gguf(tiny_dir / "tiny-target.gguf", tokenizer_fields, tiny_weights, TINY, "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir, tokenizer_fields, tiny_weights) -> Path:
    """The target's weights plus noise: agrees with the target often, not always."""
    return write_tiny_gguf(tiny_dir / "tiny-draft.gguf", tokenizer_fields, noisy_copy(tiny_weights), TINY, "tiny-draft")


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory, tokenizer_fields):
    """hybrid(arch) -> (target, draft): a tiny random model of that architecture (lfm2, qwen35, mamba2: HybridConfig)
    and its noisy copy, written once per session."""
    made: dict[str, tuple[Path, Path]] = {}
    folder = tmp_path_factory.mktemp("hybrid")

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            cfg = HybridConfig(arch)
            weights = hybrid_weights(cfg, 49152, seed=0)
            made[arch] = (write_hybrid_gguf(folder / f"tiny-{arch}.gguf", tokenizer_fields, weights, cfg, arch),
                          write_hybrid_gguf(folder / f"tiny-{arch}-draft.gguf", tokenizer_fields, noisy_copy(weights),
                                            cfg, f"{arch}-draft"))
        return made[arch]

    return get


# A tiny qwen35 with one MTP block whose head guesses the target's next token often (tiny_models.mtp_block)
MTP = HybridConfig("qwen35", mtp=True, trunk=0.1)


@pytest.fixture(scope="session")
def mtp_model(tmp_path_factory, tokenizer_fields) -> tuple[Path, Path]:
    """(a tiny qwen35 with an MTP block, a draft model: its layers plus noise, without the block), written once."""
    folder = tmp_path_factory.mktemp("mtp")
    weights = hybrid_weights(MTP, 49152, seed=0)
    trunk = {k: v for k, v in weights.items() if not k.startswith(f"blk.{MTP.n_layer}.")}
    no_mtp = HybridConfig("qwen35", trunk=MTP.trunk)
    return (write_hybrid_gguf(folder / "tiny-qwen35-mtp.gguf", tokenizer_fields, weights, MTP, "qwen35-mtp"),
            write_hybrid_gguf(folder / "tiny-qwen35-draft.gguf", tokenizer_fields, noisy_copy(trunk), no_mtp,
                              "qwen35-draft"))


# The same with Qwen3.5's mixture of experts (qwen35moe): routed experts and a shared one in every MLP, the block's too
MTP_MOE = replace(MTP, arch="qwen35moe")


@pytest.fixture(scope="session")
def mtp_moe_model(tmp_path_factory, tokenizer_fields) -> Path:
    """A tiny qwen35moe with an MTP block, written once."""
    path = tmp_path_factory.mktemp("mtp-moe") / "tiny-qwen35moe-mtp.gguf"
    return write_hybrid_gguf(path, tokenizer_fields, hybrid_weights(MTP_MOE, 49152, seed=0), MTP_MOE, "qwen35moe-mtp")


def open_decoder(path: Path, **kw) -> LlamaCppDecoder:
    kw.setdefault("n_ctx", 1024)
    return LlamaCppDecoder(path, DecoderOptions(**kw))


class FirstTokens:
    """For tests that the first three tokens sampled with speculation follow the target's distribution: the first
    from the prompt's pass, the next two judged as the first step's draft positions (a resample or a bonus). Holds the
    target's distributions along its likeliest path after the prompt (`toks`); `add` counts a run's tokens, each
    while the ones before it were that path's; `check` runs the chi-square tests."""

    def __init__(self, d: LlamaCppDecoder, toks: list[int], params: SamplingParams, lookup: bool = False) -> None:
        """`lookup`: the prompt is grown until the pair (its last token, the likeliest first) occurs in it, so that
        lookup has a match to draft from after the first token."""
        for _ in range(16):
            p0 = probabilities(d.sync(toks)[-1], params)
            first = int(p0.argmax())
            if not lookup or (toks[-1], first) in set(zip(toks, toks[1:])):
                break
            toks = [toks[-1], first, *toks]
        else:
            pytest.fail("no prompt found whose likeliest first token lookup could draft after")
        p1 = probabilities(d.feed([first])[-1], params)
        second = int(p1.argmax())
        self.toks, self.path = toks, [first, second]
        self.ps = [p0, p1, probabilities(d.feed([second])[-1], params)]
        self.counts = [np.zeros(len(p), int) for p in self.ps]

    def add(self, tokens: list[int]) -> None:
        for i, n in enumerate(self.counts):
            n[tokens[i]] += 1
            if i < len(self.path) and tokens[i] != self.path[i]:
                return

    def check(self) -> None:
        for n, p in zip(self.counts, self.ps):
            support = p > 0
            assert n[~support].sum() == 0
            expected = p[support].astype(np.float64)  # float32 rows: chisquare wants the sums equal to 1.5e-8
            pval = chisquare(n[support], expected * n.sum() / expected.sum()).pvalue
            assert pval > 0.001, f"sampled tokens {n[support]} do not follow p {p[support]} (p-value {pval:.2e})"


class FixedCosts(CostModel):
    """A cost model that does not learn from the steps it prices: a test that asserts what `auto` or the tree sizer
    chooses under given costs must not depend on what this machine's batches really cost."""

    def observe(self, *args, **kwargs) -> None:
        pass
