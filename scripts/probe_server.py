"""Probe `ggufspec serve` as a hostile client would, on 127.0.0.1, and print what each probe cost the server:
the answer, the seconds to it, and the growth of the server's resident memory. The figures in docs/server.md.

    python scripts/probe_server.py -m SmolLM2-135M-Instruct.Q4_1.gguf [--max-body 64M] [--only NAME ...]

Run it with PYTHONPATH pointing at another checkout to probe that code instead (a subprocess serves).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class Server:
    def __init__(self, model: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "serve", "-m", model, "--port", "0", *args],
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        self.port = int(re.search(r":(\d+)/v1", line).group(1))
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

    def rss_mb(self, field: str = "VmRSS") -> float:
        """Resident memory now (VmRSS), or its peak since the server started (VmHWM)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(field + r":\s+(\d+)", status).group(1)) / 1024

    def post(self, path: str, body: bytes, timeout: float = 600) -> tuple[int | str, float, float]:
        """(status, seconds to the answer, peak resident memory over what it was before, in MB)."""
        before = self.rss_mb()
        t0 = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode())
                try:
                    s.sendall(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                status = int(s.recv(65536).split()[1])
        except (OSError, IndexError) as e:
            status = type(e).__name__
        seconds = time.perf_counter() - t0
        time.sleep(0.5)  # work the server goes on with after answering counts too
        return status, seconds, self.rss_mb("VmHWM") - before

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


PROBES = {
    "body-50MB": ("/v1/completions", lambda: b'{"prompt": "' + b"x" * 50_000_000 + b'", "max_tokens": 4}'),
    "one-word-20MB": ("/v1/completions", lambda: json.dumps({"prompt": "x" * 20_000_000, "max_tokens": 4}).encode()),
    "messages-100k": ("/v1/chat/completions",
                      lambda: json.dumps({"messages": [{"role": "user", "content": "hi"}] * 100_000,
                                          "max_tokens": 4}).encode()),
    "messages-8k": ("/v1/chat/completions",
                    lambda: json.dumps({"messages": [{"role": "user", "content": "hi"}] * 8_000,
                                        "max_tokens": 4}).encode()),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--max-body", default=None, help="passed to serve (omit for the code's default)")
    ap.add_argument("--only", nargs="*", default=list(PROBES))
    args = ap.parse_args()
    extra = ["-c", "1024"] + (["--max-body", args.max_body] if args.max_body else [])
    for name in args.only:
        path, make = PROBES[name]
        server = Server(args.model, *extra)  # a fresh server per probe: growth is not hidden by an earlier one
        body = make()
        status, seconds, growth = server.post(path, body)
        print(f"{name:14} {len(body) / 1e6:6.1f} MB body -> {status} in {seconds:6.2f} s, peak RSS +{growth:7.1f} MB")
        server.stop()


if __name__ == "__main__":
    main()
