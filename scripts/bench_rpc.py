"""The target over llama.cpp's RPC backend, through a link with a fixed round-trip delay (issue 41's benchmark).

For each delay: two `ggufspec rpc-server`s on loopback, each behind scripts/delay_relay.py; then each server
command (with {port} and {rpc}, the relays' endpoints) is started in turn and sent the same streamed
/v1/completions, one at a time (scripts/bench_parallel.py's client: HumanEval dev and Spec-Bench dev first turns,
alternating). One JSON line per (delay, server): generated tok/s with and without the prompt's prefill (after
the first token), the median time to first token, and the texts.

    python scripts/bench_rpc.py --delays 0,1,5 --requests 4 -n 128 \\
        --server "gg-auto=python -m ggufspec.cli serve -m T.gguf -md D.gguf --rpc {rpc} --port {port}" \\
        --server "ls-draft=/tmp/llama-server -m T.gguf -md D.gguf --rpc {rpc} -ngl 99 -ngld 0 --port {port}"
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_parallel import emit, free_port, one_request, prompts, stop, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=COMMAND with {port} and {rpc}")
    ap.add_argument("--delays", default="0,1,5", help="round-trip delays in ms")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="each rpc-server's CPU threads")
    ap.add_argument("-o", "--output", default=None, help="append the JSON lines here too")
    a = ap.parse_args()
    out = open(a.output, "a") if a.output else None
    for delay in (float(d) for d in a.delays.split(",")):
        procs, relays = [], []
        try:
            for _ in range(2):
                port, relay = free_port(), free_port()
                procs.append(start([sys.executable, "-m", "ggufspec.cli", "rpc-server", "--port", str(port),
                                    "-t", str(a.threads)]))
                procs.append(start([sys.executable, str(ROOT / "scripts" / "delay_relay.py"), "--listen", str(relay),
                                    "--to", f"127.0.0.1:{port}", "--rtt-ms", str(delay)]))
                relays.append(f"127.0.0.1:{relay}")
            time.sleep(3)
            for name, _, command in (s.partition("=") for s in a.server):
                port = free_port()
                proc = start(shlex.split(command.format(port=port, rpc=",".join(relays))))
                try:
                    wait_healthy(port, proc)
                    one_request(port, "Hello", 8, 0.0, 0)  # warm-up
                    rs = [one_request(port, p, a.max_tokens, 0.0, 1000 + i) for i, p in enumerate(prompts(a.requests))]
                    row = {"server": name, "rtt_ms": delay, "max_tokens": a.max_tokens, "requests": len(rs),
                           "tok_s": round(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), 3),
                           # after the first token: the speed of generation alone, the prompt's prefill left out
                           "decode_tok_s": round(sum(r["tokens"] - 1 for r in rs)
                                                 / sum(r["seconds"] - r["ttft"] for r in rs), 3),
                           "ttft_median": round(statistics.median(r["ttft"] for r in rs), 3),
                           "texts": [r["text"] for r in rs]}
                    emit(row, out)
                finally:
                    stop(proc)
                    time.sleep(1)  # the rpc-servers take their next client once this one has gone
        finally:
            for p in procs:
                p.kill()


if __name__ == "__main__":
    main()
