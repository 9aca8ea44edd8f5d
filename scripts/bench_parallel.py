"""Aggregate throughput of an OpenAI-compatible server under 1..N concurrent clients (issue 40's benchmark).

Starts each server command given (with {port} in it) on 127.0.0.1, waits for /health, then for each client count
sends `--requests-per-client` streamed /v1/completions per client (HumanEval dev and Spec-Bench dev first turns,
alternating; the same prompts for every server, and prompts of their own for each client count and round, so that
no run finds its prompts cached by an earlier one, as no real workload would), and prints one JSON line per (server,
clients): aggregate generated tok/s, p50/p95 time to first token, median per-request tok/s, and the texts (to check
that every server gives the same greedy text). Servers run one after another, client counts alternate across rounds.

With --interleave every server runs at once (idle but one) and each round sends its prompts to each server in turn,
the order rotated round by round: a VM whose speed moves by 5-30% from one server's whole run to the next moves far
less within a round, so each round's tok/s over the first server's is the steadier ratio (`vs_<first>`: the median
of the rounds', with their range).

    python scripts/bench_parallel.py --clients 1,2,4,8 --rounds 1 -n 128 \\
        --server "ggufspec-auto=python -m ggufspec.cli serve -m T.gguf -md D.gguf --port {port} -np 8" \\
        --server "llama-server=/tmp/llama-server -m T.gguf --port {port} -np 8"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

# ../shared/bench beside the checkout; GGUFSPEC_BENCH_DIR names another folder of the same two files (the GPU check
# carries a few prompts of each, as ../shared does not travel to the device machine)
BENCH = Path(os.environ.get("GGUFSPEC_BENCH_DIR") or Path(__file__).resolve().parents[2] / "shared" / "bench")


def prompts(n: int, start: int = 0) -> list[str]:
    """n prompts from the `start`-th on, HumanEval and Spec-Bench first turns alternating (file order)."""
    code = [json.loads(x)["prompt"] for x in (BENCH / "humaneval_dev.jsonl").read_text().splitlines() if x.strip()]
    chat = [json.loads(x)["turns"][0] for x in (BENCH / "spec_bench_dev.jsonl").read_text().splitlines() if x.strip()]
    mixed = [p for pair in zip(code, chat) for p in pair]
    return [mixed[i % len(mixed)] for i in range(start, start + n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def one_request(port: int, prompt: str, max_tokens: int, temperature: float, seed: int, extra: dict | None = None,
                ) -> dict:
    # top_k, top_p and min_p off: llama-server's defaults (40, 0.95, 0.05) would sample another distribution
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                       "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, chunks, usage = None, [], 0, None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("text") or ""
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
                    chunks += 1
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - t0, "seconds": end - t0, "tokens": tokens, "text": "".join(text)}


def run_clients(port: int, clients: int, per_client: int, max_tokens: int, temperature: float,
                start: int = 0, extra: dict | None = None) -> dict:
    """`clients` threads send the prompts from the `start`-th on, `per_client` each, as fast as answered."""
    work = list(enumerate(prompts(clients * per_client, start)))
    results: dict[int, dict] = {}
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not work:
                    return
                i, prompt = work.pop(0)
            results[i] = one_request(port, prompt, max_tokens, temperature, 1000 + i, extra)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rs = [results[i] for i in sorted(results)]
    ttft = sorted(r["ttft"] for r in rs)
    tokens = sum(r["tokens"] for r in rs)
    return {"clients": clients, "requests": len(rs), "tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2),
            "ttft_p50": round(statistics.median(ttft), 3), "ttft_p95": round(ttft[math.ceil(0.95 * (len(ttft) - 1))], 3),
            "req_tok_s_median": round(statistics.median(r["tokens"] / r["seconds"] for r in rs), 2),
            "texts": [r["text"] for r in rs]}


def emit(row: dict, out) -> None:
    """One result: printed without its texts, appended whole to `out` (a file or None)."""
    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=COMMAND with {port}")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every answer runs to -n tokens (llama-server's ignore_eos): sampled runs of equal lengths")
    ap.add_argument("--interleave", action="store_true",
                    help="run every server at once, each round's prompts to each in turn (steadier ratios)")
    ap.add_argument("-o", "--output", default=None, help="append the JSON lines here too")
    a = ap.parse_args()
    levels = [int(x) for x in a.clients.split(",")]
    extra = {"ignore_eos": True} if a.ignore_eos else {}
    out = open(a.output, "a") if a.output else None
    servers = [(name, command) for name, _, command in (s.partition("=") for s in a.server)]
    if a.interleave:
        interleaved(a, servers, levels, extra, out)
        return
    for name, command in servers:
        port, proc = start_server(command)
        try:
            start = 0  # every run gets prompts of its own: none finds its prompt cached by an earlier run
            for r in range(a.rounds):
                for c in (levels if r % 2 == 0 else levels[::-1]):
                    emit(row(a, name, r, run_clients(port, c, a.requests_per_client, a.max_tokens, a.temperature,
                                                     start, extra)), out)
                    start += c * a.requests_per_client
        finally:
            stop(proc)


def start_server(command: str) -> tuple[int, subprocess.Popen]:
    """The server `command` ({port} filled in) on a free port, healthy and warmed up (the cost model's first
    measurement, caches)."""
    port = free_port()
    proc = subprocess.Popen(shlex.split(command.format(port=port)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        one_request(port, "Hello", 8, 0.0, 0)
    except BaseException:
        stop(proc)
        raise
    return port, proc


def row(a: argparse.Namespace, name: str, r: int, result: dict) -> dict:
    return {"server": name, "round": r, "temperature": a.temperature, "max_tokens": a.max_tokens,
            "ignore_eos": a.ignore_eos, **result}


def interleaved(a: argparse.Namespace, servers: list[tuple[str, str]], levels: list[int], extra: dict, out) -> None:
    """--interleave: every server started, then each round's prompts sent to each in turn (the order rotated);
    per client count, one summary line a server: its total tok/s and its rounds' tok/s over the first server's."""
    procs: list[tuple[str, int, subprocess.Popen]] = []
    try:
        for name, command in servers:
            procs.append((name, *start_server(command)))
        runs: dict[tuple[str, int], list[dict]] = {}
        start = 0
        for r in range(a.rounds):
            for c in (levels if r % 2 == 0 else levels[::-1]):
                for name, port, _ in procs[r % len(procs):] + procs[: r % len(procs)]:
                    result = run_clients(port, c, a.requests_per_client, a.max_tokens, a.temperature, start, extra)
                    runs.setdefault((name, c), []).append(result)
                    emit(row(a, name, r, result), out)
                start += c * a.requests_per_client
        first = procs[0][0]
        for c in levels:
            for name, _, _ in procs:
                mine, base = runs[name, c], runs[first, c]
                ratios = sorted(m["tok_s"] / b["tok_s"] for m, b in zip(mine, base))
                emit({"server": name, "clients": c, "rounds": a.rounds,
                      "tok_s": round(sum(m["tokens"] for m in mine) / sum(m["wall_s"] for m in mine), 2),
                      **({f"vs_{first}": round(statistics.median(ratios), 4),
                          "rounds_vs": [round(x, 3) for x in ratios]} if name != first else {})}, out)
    finally:
        for _, _, proc in procs:
            stop(proc)


if __name__ == "__main__":
    main()
