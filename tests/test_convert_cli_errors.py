"""The real `ggufspec` command on inputs the converters refuse or only partly honour: an already quantized model
(--allow-requantize and the fallbacks it brings) and truncated files. One `error:` line and exit 2, no traceback,
no llama.cpp log lines; a one-line summary where llama.cpp logs a line a tensor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from convert_fixtures import write_medusa

pytest.importorskip("llama_cpp")


def ggufspec(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ggufspec ARGS` in a child process, as a user runs it (the CLI's error mapping included)."""
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The command failed with exit 2 and exactly one `error:` line, no traceback; that line."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def no_outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_quantize_of_a_quantized_model_names_its_type_and_allow_requantize(smollm2_path: Path,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    r = ggufspec("quantize", smollm2_path, out / "q4_0.gguf", "--type", "q4_0", "--threads", "2")
    line = one_error_line(r)
    assert "already quantized (q4_1)" in line
    assert "--allow-requantize" in line and "quality" in line
    assert "requantizing from type" not in r.stderr  # llama.cpp's own words, which name no option
    assert no_outputs(out) == []


def test_requantize_fallbacks_are_summarised_unless_verbose(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "q4_k_m.gguf"
    # SmolLM2's rows of 576 values do not split into K-quants' 256-value blocks: most tensors fall back
    r = ggufspec("quantize", smollm2_path, out, "--type", "q4_k_m", "--threads", "2", "--allow-requantize")
    assert r.returncode == 0, r.stderr
    assert out.is_file()
    assert not [ln for ln in r.stderr.splitlines() if ln.startswith("fallback:")], r.stderr
    summary = [ln for ln in r.stderr.splitlines() if "fell back" in ln]
    assert len(summary) == 1, r.stderr
    m = re.search(r"(\d+) tensors fell back to another type \((.*)\): their row length \(576\) is not a multiple "
                  r"of the block size \(256\); --verbose lists them", summary[0])
    assert m, summary[0]
    n = int(m[1])
    assert n > 100
    pairs = dict((p.split(" ", 1)[1], int(p.split(" ", 1)[0])) for p in m[2].split(", "))
    assert sum(pairs.values()) == n and "q4_K -> q5_0" in pairs, pairs
    assert len(r.stderr.splitlines()) <= 3, r.stderr  # progress label, summary; nothing else

    r = ggufspec("quantize", smollm2_path, out, "--type", "q4_k_m", "--threads", "2", "--allow-requantize",
                 "--verbose")
    assert r.returncode == 0, r.stderr
    listed = [ln for ln in r.stderr.splitlines() if ln.startswith("fallback:")]
    assert len(listed) == n
    assert all("row length 576 is not a multiple of 256" in ln for ln in listed)
    assert "llama_model_quantize" in r.stderr or "llama_model_loader" in r.stderr  # llama.cpp's log, as asked
    assert "fell back" not in r.stderr


@pytest.fixture(scope="module")
def truncated(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("truncated")
    data = smollm2_path.read_bytes()
    out = {}
    for name, n in {"half": len(data) // 2, "last-byte": len(data) - 1}.items():
        out[name] = d / f"{name}.gguf"
        out[name].write_bytes(data[:n])
    return out


def assert_names_tensor_and_missing_bytes(line: str, path: Path) -> None:
    assert str(path) in line and "truncated" in line
    assert re.search(r"tensor '[^']+'", line), line
    size = path.stat().st_size
    m = re.search(r"needs bytes up to ([\d,]+) but the file has ([\d,]+) \(([\d,]+) bytes missing\)", line)
    assert m, line
    end, have, missing = (int(g.replace(",", "")) for g in m.groups())
    assert have == size and missing == end - size > 0


@pytest.mark.parametrize("case", ["half", "last-byte"])
def test_inspect_of_a_truncated_gguf_names_the_tensor_and_missing_bytes(truncated: dict[str, Path],
                                                                        case: str) -> None:
    r = ggufspec("inspect", truncated[case])
    line = one_error_line(r)
    assert "reshape" not in r.stderr  # gguf-py's numpy error, which names neither tensor nor bytes
    assert_names_tensor_and_missing_bytes(line, truncated[case])
    assert r.stdout == ""


@pytest.mark.parametrize("case", ["half", "last-byte"])
def test_quantize_of_a_truncated_gguf_says_so(truncated: dict[str, Path], case: str, tmp_path: Path) -> None:
    r = ggufspec("quantize", truncated[case], tmp_path / "q.gguf", "--type", "q8_0", "--allow-requantize")
    assert_names_tensor_and_missing_bytes(one_error_line(r), truncated[case])
    assert no_outputs(tmp_path) == []


def test_convert_medusa_of_a_truncated_checkpoint_says_so(tmp_path: Path) -> None:
    src = tmp_path / "heads"
    write_medusa(src, heads=2, layers=1, hidden=64, vocab=100)
    weights = src / "medusa_lm_head.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    out.mkdir()
    line = one_error_line(ggufspec("convert", "medusa", src, out / "medusa.gguf"))
    assert str(weights) in line and "truncated" in line and re.search(r"tensor '[^']+'", line), line
    assert no_outputs(out) == []


def test_convert_medusa_of_a_gguf_says_it_is_one(truncated: dict[str, Path], tmp_path: Path) -> None:
    """Not a torch checkpoint to load (nor a reason to ask for torch): a GGUF, whole or truncated."""
    line = one_error_line(ggufspec("convert", "medusa", truncated["half"], tmp_path / "medusa.gguf"))
    assert "GGUF" in line and "needs torch" not in line, line
    assert no_outputs(tmp_path) == []
