"""SIGINT during convert, quantize or pull: exit 130 with one line, no traceback, nothing under the final name.

Each test runs the real CLI in a subprocess, waits until the output is really being written (the temp file exists
and grows, or the fake hub below has served part of the file), then sends SIGINT. A run that finished before the
signal landed fails the test instead of passing it vacuously.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("tokenizers")

from convert_fixtures import train_bpe_tokenizer, write_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start_cli(*args: object, env: dict[str, str] | None = None, entry: tuple[str, ...] = ("-m", "ggufspec.cli")
              ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *entry, *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 60.0) -> None:
    """Poll `ready()` until true; the process ending first (or the time running out) fails the test."""
    end = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}; input too small?\n{out}\n{err}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.005)


def interrupt(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[str, str, float]:
    """SIGINT, then wait: (stdout, stderr, seconds from the signal to the exit)."""
    assert proc.poll() is None, "the command ended before the signal"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return out, err, time.monotonic() - t0


def assert_interrupted(proc: subprocess.Popen, out: str, err: str) -> None:
    assert proc.returncode == 130, f"exit {proc.returncode} (0: it finished before the signal)\n{out}\n{err}"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert "wrote" not in out, out


def temp_files(folder: Path, out: Path) -> list[Path]:
    return list(folder.glob(f".{out.name}.*.tmp"))


# --- convert and quantize ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A ~100 MB bf16 Llama checkpoint: `convert hf --outtype q8_0` spends over a second writing it."""
    folder = tmp_path_factory.mktemp("hf")
    n = train_bpe_tokenizer(folder, "smollm", 300)
    write_tiny_model(folder, "llama", n, hidden=512, ffn=1536, heads=4, kv_heads=2, layers=16, dtype="BF16")
    return folder


@pytest.mark.parametrize("entry", [("-m", "ggufspec.cli", "convert", "hf"), (str(ROOT / "converters" / "hf_to_gguf.py"),)],
                         ids=["ggufspec-convert-hf", "hf_to_gguf.py"])
def test_sigint_during_convert_leaves_no_file(checkpoint: Path, tmp_path: Path, entry: tuple[str, ...]) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model-q8_0.gguf"
    proc = start_cli(checkpoint, out, "--outtype", "q8_0", entry=entry)
    wait_for(proc, lambda: any(p.stat().st_size > 1 << 20 for p in temp_files(out_dir, out)),
             "the temp file held 1 MB")
    out_text, err, _ = interrupt(proc)
    assert_interrupted(proc, out_text, err)
    assert list(out_dir.iterdir()) == []  # neither the final name nor the temp file


def test_sigint_during_quantize_stops_it_and_leaves_no_file(checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from ggufspec.convert.hf import convert_hf

    src = tmp_path / "model-f16.gguf"
    convert_hf(checkpoint, src, "f16")  # ~100 MB: q4_k_m on one thread takes several seconds
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model-q4_k_m.gguf"
    proc = start_cli("quantize", src, out, "--type", "q4_k_m", "--threads", "1")
    wait_for(proc, lambda: any(p.stat().st_size > 0 for p in temp_files(out_dir, out)), "llama.cpp writing the temp file")
    time.sleep(0.3)  # well inside llama_model_quantize
    out_text, err, seconds = interrupt(proc)
    assert_interrupted(proc, out_text, err)
    assert list(out_dir.iterdir()) == []
    # llama.cpp's call cannot be cancelled: the process must end at once, not after quantizing everything
    assert seconds < 3, f"took {seconds:.1f} s to stop"


# --- pull, against a local hub ----------------------------------------------------------------

COMMIT = "c0ffee" + "0" * 34


class FakeHub:
    """The hub endpoints huggingface_hub's list_repo_files and hf_hub_download call, on 127.0.0.1.

    GET /api/models/{repo}/tree/{rev} lists the files; HEAD and GET /{repo}/resolve/{rev}/{file} give the metadata
    (X-Repo-Commit, X-Linked-Etag = sha256 as for an LFS file, X-Linked-Size) and the bytes, `delay` seconds per
    64 KB chunk, honouring Range.
    """

    def __init__(self, repo: str, files: dict[str, bytes]):
        self.repo, self.files = repo, files
        self.delay = 0.0
        self.served = 0  # body bytes sent by GETs of files
        self.gets = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.resolve(self, body=False)

            def do_GET(self) -> None:
                path = urlsplit(self.path).path
                if path.startswith(f"/api/models/{hub.repo}/tree/"):
                    hub.tree(self)
                else:
                    hub.resolve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def tree(self, h: BaseHTTPRequestHandler) -> None:
        body = json.dumps([
            {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
             "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}}
            for name, data in self.files.items()
        ]).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def resolve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        m = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/[^/]+/(.+)", unquote(urlsplit(h.path).path))
        data = self.files.get(m[1]) if m else None
        if data is None:
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if rng:
            start = int(rng[1])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(data) - start))
        h.end_headers()
        if not body:
            return
        self.gets += 1
        try:
            for i in range(start, len(data), 1 << 16):
                h.wfile.write(data[i:i + (1 << 16)])
                h.wfile.flush()
                self.served += min(1 << 16, len(data) - i)
                if self.delay:
                    time.sleep(self.delay)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-file


def test_sigint_during_pull_leaves_no_file_and_the_next_pull_completes(tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    repo, name = "someone/tiny-GGUF", "tiny-Q8_0.gguf"
    data = os.urandom(4 << 20)
    hub = FakeHub(repo, {name: data, "README.md": b"# tiny\n"})
    try:
        env = {k: v for k, v in os.environ.items()
               if k.upper() not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
                   GGUFSPEC_CACHE=str(tmp_path / "gg"))
        folder = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--"))
        final = folder / "snapshots" / COMMIT / name

        hub.delay = 0.05  # 64 chunks of 64 KB: over 3 s for the whole file
        proc = start_cli("pull", f"{repo}:*q8_0*", env=env)
        wait_for(proc, lambda: hub.served >= 256 << 10, "256 KB served")
        out, err, _ = interrupt(proc)
        assert_interrupted(proc, out, err)
        assert hub.served < len(data), "the whole file was served before the signal"
        assert not final.exists() and not final.is_symlink()
        left = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
        assert [p for p in left if p.parent.name == "blobs" or p.suffix == ".incomplete"] == [], left

        hub.delay = 0.0
        done = subprocess.run([sys.executable, "-m", "ggufspec.cli", "pull", f"{repo}:*q8_0*"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == f"{final} ({len(data) / 1e6:.1f} MB)"
        assert final.read_bytes() == data
        assert hub.gets == 2
    finally:
        hub.close()
