"""What the writers do to files: never replace an input, leave no temp file behind after a failure or a signal, and
blame the output folder (not the input) when it is read-only or full.

The CLI runs for real (a subprocess of `python -m ggufspec.cli`, or click's CliRunner on `ggufspec.cli.main`) on
tiny real checkpoints. Read-only and full folders are tmpfs mounts made in a private mount namespace (`unshare`),
so they vanish with the command and need no cleanup; where that is impossible the tests say why they skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("tokenizers")

from convert_fixtures import train_bpe_tokenizer, write_medusa, write_tiny_model  # noqa: E402
from ggufspec.cli import main  # noqa: E402
from ggufspec import outputs  # noqa: E402
from ggufspec.convert.hf import convert_hf  # noqa: E402
from ggufspec.errors import ConversionError  # noqa: E402
from test_interrupt import start_cli, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFUSED = "is one of the inputs; choose another file name"


def cli(*args: object, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `python -m ggufspec.cli ARGS` to the end (bounded by `timeout`)."""
    return subprocess.run([sys.executable, "-m", "ggufspec.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def invoke(*args: object):
    """Run the CLI in-process; the Group maps GGUFSpecError to "error: ..." and exit code 2."""
    return CliRunner().invoke(main, [str(a) for a in args])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def temp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


@pytest.fixture()
def hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hfcopy"
    folder.mkdir()
    n = train_bpe_tokenizer(folder, "gpt2", 300)
    write_tiny_model(folder, "llama", n, hidden=64, layers=2, heads=2, kv_heads=1, ffn=64)
    return folder


@pytest.fixture()
def f16_gguf(hf_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model-f16.gguf"
    convert_hf(hf_dir, out, "f16")
    return out


# --- 1. the output is never one of the inputs ---------------------------------------------------------------


def test_convert_hf_refuses_to_write_over_its_checkpoint(hf_dir: Path) -> None:
    """The reported data loss: `convert hf hfcopy hfcopy/model.safetensors` replaced the checkpoint with a GGUF."""
    before = snapshot(hf_dir)
    proc = cli("convert", "hf", hf_dir, hf_dir / "model.safetensors")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == [f"error: {hf_dir / 'model.safetensors'}: this file {REFUSED}"]
    assert snapshot(hf_dir) == before
    assert temp_files(hf_dir) == []


def _alias(hf_dir: Path, tmp_path: Path, kind: str) -> Path:
    """An output path that is, or leads to, one of the files `convert hf` reads."""
    weights = hf_dir / "model.safetensors"
    if kind in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        return hf_dir / kind
    if kind == "symlink":
        (tmp_path / "out.gguf").symlink_to(weights)
        return tmp_path / "out.gguf"
    if kind == "hardlink":
        os.link(weights, tmp_path / "out.gguf")
        return tmp_path / "out.gguf"
    if kind == "linked-folder":
        (tmp_path / "elsewhere").symlink_to(hf_dir, target_is_directory=True)
        return tmp_path / "elsewhere" / "model.safetensors"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["config.json", "tokenizer.json", "tokenizer_config.json", "symlink", "hardlink",
                                  "linked-folder"])
def test_convert_hf_refuses_every_input_and_links_to_them(hf_dir: Path, tmp_path: Path, kind: str) -> None:
    out = _alias(hf_dir, tmp_path, kind)
    before = snapshot(hf_dir)
    res = invoke("convert", "hf", hf_dir, out)
    assert res.exit_code == 2, res.output
    assert REFUSED in res.output and str(out) in res.output
    assert snapshot(hf_dir) == before
    original = out.name if out.parent == hf_dir else "model.safetensors"
    assert out.read_bytes() == before[original]  # the link, too, still leads to the untouched input
    assert temp_files(out.parent) == []


def test_convert_hf_refuses_a_sharded_checkpoints_shard(hf_dir: Path) -> None:
    import json

    (hf_dir / "model.safetensors").rename(hf_dir / "model-00001-of-00001.safetensors")
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    before = snapshot(hf_dir)
    for out in (hf_dir / "model-00001-of-00001.safetensors", hf_dir / "model.safetensors.index.json"):
        res = invoke("convert", "hf", hf_dir, out)
        assert res.exit_code == 2 and REFUSED in res.output, res.output
    assert snapshot(hf_dir) == before


def test_convert_hf_refuses_the_vocab_from_gguf(hf_dir: Path, f16_gguf: Path) -> None:
    """Re-converting with --vocab-from the GGUF being replaced: the tokenizer source would be gone."""
    before = f16_gguf.read_bytes()
    res = invoke("convert", "hf", hf_dir, f16_gguf, "--vocab-from", f16_gguf)
    assert res.exit_code == 2, res.output
    assert f"{f16_gguf}: this file {REFUSED}" in res.output
    assert f16_gguf.read_bytes() == before


@pytest.mark.parametrize("target", ["medusa_lm_head.safetensors", "config.json", "link"])
def test_convert_medusa_refuses_its_source(tmp_path: Path, target: str) -> None:
    src = tmp_path / "src"
    write_medusa(src, heads=2, layers=1, hidden=32, vocab=64)
    out = src / target
    if target == "link":
        out = tmp_path / "heads.gguf"
        out.symlink_to(src / "medusa_lm_head.safetensors")
    before = snapshot(src)
    res = invoke("convert", "medusa", src, out)
    assert res.exit_code == 2, res.output
    assert REFUSED in res.output
    assert snapshot(src) == before


@pytest.mark.parametrize("link", ["hardlink", "symlink"])
def test_quantize_refuses_a_link_to_its_input(f16_gguf: Path, tmp_path: Path, link: str) -> None:
    pytest.importorskip("llama_cpp")
    out = tmp_path / "q8.gguf"
    (os.link if link == "hardlink" else os.symlink)(f16_gguf, out)
    before = f16_gguf.read_bytes()
    res = invoke("quantize", f16_gguf, out, "--type", "q8_0", "--threads", "1")
    assert res.exit_code == 2, res.output
    assert f"{out}: links to {f16_gguf}, which {REFUSED}" in res.output
    assert f16_gguf.read_bytes() == before and out.read_bytes() == before


@pytest.mark.parametrize("which", ["target", "text", "data"])
def test_medusa_train_refuses_an_input_as_output_before_any_work(tmp_path: Path, which: str) -> None:
    """Checked first: finding out after hours of collection and training, or not at all, loses the file."""
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF" + bytes(60))  # never opened: the refusal comes first
    text = tmp_path / "train.txt"
    text.write_text("some text to train on\n")
    data = tmp_path / "cache.npz"
    out = {"target": target, "text": text, "data": data}[which]
    res = invoke("medusa", "train", target, out, "--text", text, "--data", data)
    assert res.exit_code == 2, res.output
    assert REFUSED in res.output
    assert target.read_bytes() == b"GGUF" + bytes(60) and text.read_text() == "some text to train on\n"
    assert not data.exists()


def test_medusa_tree_refuses_to_write_over_the_heads(tmp_path: Path) -> None:
    files = {n: tmp_path / n for n in ("target.gguf", "heads.gguf", "data.npz")}
    for p in files.values():
        p.write_bytes(b"input " + p.name.encode())
    res = invoke("medusa", "tree", *files.values(), files["heads.gguf"])
    assert res.exit_code == 2, res.output
    assert REFUSED in res.output
    assert files["heads.gguf"].read_bytes() == b"input heads.gguf"


def test_same_file_rules(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    b.write_bytes(b"x")
    assert outputs.same_file(a, tmp_path / "." / "a")
    assert not outputs.same_file(a, b)  # equal content is not the same file
    assert not outputs.same_file(tmp_path / "new.gguf", a)  # an output that does not exist yet
    with pytest.raises(ConversionError, match=REFUSED):
        outputs.refuse_overwriting_inputs(a, [None, b, a])


# --- 2. signals remove the temp file and end the process -----------------------------------------------------


def test_temp_output_turns_sigterm_into_cleanup_and_exit_143(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """In-process: SIGTERM in the body removes the temp file, prints "terminated" and exits 143; the previous
    handlers come back."""
    out = tmp_path / "o.gguf"
    before = {s: signal.getsignal(s) for s in outputs.ENDING_SIGNALS}
    if before[signal.SIGTERM] != signal.SIG_DFL:
        pytest.skip("this test run has its own SIGTERM handler, which temp_output rightly leaves in charge")
    with pytest.raises(SystemExit) as exc:
        with outputs.temp_output(out) as tmp:
            tmp.write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecode boundary; this is a bounded wait for it
                time.sleep(0.001)
            pytest.fail("SIGTERM did not interrupt the body")
    assert exc.value.code == 143
    assert list(tmp_path.iterdir()) == []
    assert capfd.readouterr().err.strip().splitlines()[-1] == "terminated"
    assert {s: signal.getsignal(s) for s in outputs.ENDING_SIGNALS} == before


def test_temp_output_keeps_handlers_it_does_not_own(tmp_path: Path) -> None:
    """A handler someone installed (or SIG_IGN, as nohup sets for SIGHUP) stays in charge; off the main thread no
    handler is touched at all (Python allows signal.signal only there)."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with outputs.temp_output(tmp_path / "o.gguf") as tmp:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                if seen:
                    break
                time.sleep(0.001)
            tmp.write_bytes(b"complete")
        assert seen == [signal.SIGTERM] and (tmp_path / "o.gguf").read_bytes() == b"complete"
    finally:
        signal.signal(signal.SIGTERM, previous)

    errors: list[BaseException] = []

    def write() -> None:
        try:
            with outputs.temp_output(tmp_path / "t.gguf") as tmp:
                tmp.write_bytes(b"from a thread")
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    t.join(timeout=30)
    assert errors == [] and (tmp_path / "t.gguf").read_bytes() == b"from a thread"


def test_temp_output_removes_the_temp_file_on_any_failure(tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    out.write_bytes(b"previous")
    with pytest.raises(ValueError):
        with outputs.temp_output(out) as tmp:
            tmp.write_bytes(b"partial")
            raise ValueError("boom")
    full = rf"^cannot write to {re.escape(str(tmp_path))}: No space left on device \(o\.gguf was not written\)$"
    with pytest.raises(ConversionError, match=full):
        with outputs.temp_output(out) as tmp:
            raise OSError(28, "No space left on device")  # as a full disk makes write() fail
    assert snapshot(tmp_path) == {"o.gguf": b"previous"}
    assert temp_files(tmp_path) == []


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    """A ~50 MB bf16 Llama checkpoint: `convert hf --outtype q8_0` spends over a second writing it."""
    folder = tmp_path_factory.mktemp("big")
    n = train_bpe_tokenizer(folder, "smollm", 300)
    write_tiny_model(folder, "llama", n, hidden=512, ffn=1536, heads=4, kv_heads=2, layers=8, dtype="BF16")
    return folder


def signal_and_wait(proc: subprocess.Popen, signum: int) -> tuple[str, str]:
    assert proc.poll() is None, "the command ended before the signal"
    proc.send_signal(signum)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the command did not end within 60 s of signal {signum}")


def assert_terminated(proc: subprocess.Popen, signum: int, out: str, err: str) -> None:
    assert proc.returncode == 128 + signum, f"exit {proc.returncode} (0: finished before the signal)\n{out}\n{err}"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-1] == "terminated", err
    assert "wrote" not in out, out


SCRIPT = (str(ROOT / "converters" / "hf_to_gguf.py"),)


@pytest.mark.parametrize("signum, entry", [(signal.SIGTERM, ()), (signal.SIGHUP, ()), (signal.SIGTERM, SCRIPT)],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-hf_to_gguf.py"])
def test_signal_during_convert_removes_the_temp_file(big_checkpoint: Path, tmp_path: Path, signum: int,
                                                     entry: tuple[str, ...]) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model-q8_0.gguf"
    args = (big_checkpoint, out, "--outtype", "q8_0")
    proc = start_cli(*args, entry=entry) if entry else start_cli("convert", "hf", *args)
    wait_for(proc, lambda: any(p.stat().st_size > 1 << 20 for p in temp_files(out_dir)), "the temp file held 1 MB",
             timeout=120)
    out_text, err = signal_and_wait(proc, signum)
    assert_terminated(proc, signum, out_text, err)
    assert list(out_dir.iterdir()) == []


def test_sigterm_during_quantize_removes_the_temp_file(big_checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    src = tmp_path / "model-f16.gguf"
    convert_hf(big_checkpoint, src, "f16")  # ~50 MB: q4_k_m on one thread takes seconds
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model-q4_k_m.gguf"
    proc = start_cli("quantize", src, out, "--type", "q4_k_m", "--threads", "1")
    # the temp file is created empty before llama.cpp starts: data in it means the C call is under way
    wait_for(proc, lambda: any(p.stat().st_size > 0 for p in temp_files(out_dir)), "llama.cpp writing the temp file",
             timeout=120)
    out_text, err = signal_and_wait(proc, signal.SIGTERM)
    assert_terminated(proc, signal.SIGTERM, out_text, err)
    assert list(out_dir.iterdir()) == []


# --- 3. read-only and full output folders ---------------------------------------------------------------------

# sh -c script: mount a tmpfs with options $1 on $2, run the rest of the arguments, list what they left in $2
_MOUNT = ('set -e; mount -t tmpfs -o "$1" tmpfs "$2"; dir=$2; shift 2; set +e; '
          '"$@"; rc=$?; echo "left:$(ls -A "$dir")"; exit $rc')


@pytest.fixture(scope="module")
def unshare_flags(tmp_path_factory) -> list[str]:
    """How to run a command in a private mount namespace where it may mount a tmpfs: `unshare -rm` (a user
    namespace: works unprivileged where the kernel allows it) or `unshare -m` (root). Skips when neither works."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: cannot mount a read-only or full filesystem for the test")
    probe = tmp_path_factory.mktemp("probe")
    for flags in (["-rm"], ["-m"]):
        proc = subprocess.run(["unshare", *flags, "sh", "-c", _MOUNT, "sh", "size=64k", str(probe), "true"],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return flags
    pytest.skip(f"cannot mount a tmpfs in a private mount namespace here ({proc.stderr.strip()})")


def cli_on_tmpfs(flags: list[str], mount_opts: str, folder: Path, *args: object) -> subprocess.CompletedProcess:
    """Mount a tmpfs with `mount_opts` on `folder`, run the CLI with ARGS, then list what it left in `folder`
    (stdout's last line, "left:NAMES"); all in a mount namespace that ends with the command."""
    cmd = ["unshare", *flags, "sh", "-c", _MOUNT, "sh", mount_opts, str(folder),
           sys.executable, "-m", "ggufspec.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def _command(kind: str, hf_dir: Path, f16_gguf: Path, tmp_path: Path, out: Path) -> list[object]:
    if kind == "convert-hf":
        return ["convert", "hf", hf_dir, out, "--outtype", "f32"]
    if kind == "convert-medusa":
        write_medusa(tmp_path / "heads", heads=4, layers=1, hidden=64, vocab=512)
        return ["convert", "medusa", tmp_path / "heads", out, "--outtype", "f32"]
    pytest.importorskip("llama_cpp")
    return ["quantize", f16_gguf, out, "--type", "f16", "--threads", "1"]


def assert_blames_output(proc: subprocess.CompletedProcess, folder: Path, reason: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert error_lines(proc.stderr) == [f"error: cannot write to {folder}: {reason} (out.gguf was not written)"], \
        proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "left:", proc.stdout  # no temp file, no output


COMMANDS = ["convert-hf", "convert-medusa", "quantize"]


# A read-only tmpfs, and a 64 kB one: every output here is several times larger, so the disk fills up half-way.
FOLDERS = [("ro", "Read-only file system"), ("size=64k", "No space left on device")]


@pytest.mark.parametrize("mount,reason", FOLDERS, ids=["read-only", "full"])
@pytest.mark.parametrize("kind", COMMANDS)
def test_an_output_folder_that_cannot_take_the_file_is_named_with_the_reason(
        kind: str, mount: str, reason: str, hf_dir: Path, f16_gguf: Path, tmp_path: Path,
        unshare_flags: list[str]) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    args = _command(kind, hf_dir, f16_gguf, tmp_path, folder / "out.gguf")
    proc = cli_on_tmpfs(unshare_flags, mount, folder, *args)
    assert_blames_output(proc, folder, reason)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 0555 folder anyway: covered by the tmpfs test")
def test_unwritable_folder_without_mounts(hf_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o555)
    try:
        proc = cli("convert", "hf", hf_dir, folder / "out.gguf")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert error_lines(proc.stderr) == [
            f"error: cannot write to {folder}: Permission denied (out.gguf was not written)"]
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)
