"""A bounded load test of `ggufspec serve` on 127.0.0.1: 8 concurrent clients x 5 requests, mixed streaming and not,
some disconnecting mid-stream, more than the queue holds. Correct texts, only 429s as errors, no leak."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time

from test_server import Server

CLIENTS, REQUESTS = 8, 5
PROMPTS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish."]
KINDS = ["chat", "stream", "disconnect", "completion", "stream"]  # request j of every client


def body(kind: str, prompt: str) -> tuple[str, dict]:
    if kind == "completion":
        return "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    b = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}
    if kind == "disconnect":
        b["max_tokens"] = 400
    return "/v1/chat/completions", {**b, "stream": kind != "chat"}


def call(port: int, kind: str, prompt: str, make_body=body) -> tuple[int, str | None]:
    """(HTTP status, the text) for a completed request (its path and JSON from `make_body`); text None for a
    deliberate disconnect."""
    path, b = make_body(kind, prompt)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(b), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200 or not b.get("stream"):
            out = json.loads(r.read())
            if r.status == 429:
                assert r.getheader("Retry-After") and out["error"]["type"] == "rate_limit_error", out
            if r.status != 200:
                return r.status, json.dumps(out)
            choice = out["choices"][0]
            return 200, choice.get("text", (choice.get("message") or {}).get("content"))
        text = ""
        for n, line in enumerate(r):
            if kind == "disconnect" and n >= 6:
                conn.sock.shutdown(2)
                return 200, None
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    text += (c.get("delta") or {}).get("content") or c.get("text") or ""
        return 200, text
    finally:
        conn.close()


Result = tuple[str, int, str | None, str, float]  # kind, status, text, prompt, seconds


def run_clients(call, port: int, prompts: list[str], clients: int = CLIENTS, requests: int = REQUESTS,
                timeout: float = 600) -> tuple[list[Result], float]:
    """`clients` threads, each sending `requests` requests one after another (request j of client i: KINDS[j] with
    prompt i + j); every request's result and the wall time. Asserts that all ended within `timeout`."""
    results: list[Result] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(requests):
            kind, prompt = KINDS[j], prompts[(i + j) % len(prompts)]
            t0 = time.perf_counter()
            status, text = call(port, kind, prompt)
            with lock:
                results.append((kind, status, text, prompt, time.perf_counter() - t0))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads) and len(results) == clients * requests
    return results, time.perf_counter() - t0


def test_concurrent_clients(smollm2_path) -> None:
    s = Server("-m", str(smollm2_path), "-d", str(smollm2_path), "-c", "1024", "--queue", "3")
    try:
        reference = {(k, p): call(s.port, k, p)[1] for p in PROMPTS for k in ("chat", "completion")}
        assert all(v is not None for v in reference.values()), reference
        rss0 = s.rss_kb()
        results, wall = run_clients(call, s.port, PROMPTS, timeout=600)
        statuses = [r[1] for r in results]
        assert set(statuses) <= {200, 429}, [r for r in results if r[1] not in (200, 429)]
        assert 429 in statuses and statuses.count(200) >= CLIENTS  # over the queue limit, and still serving
        for kind, status, text, prompt, _ in results:
            if status == 200 and kind != "disconnect":
                assert text == reference["completion" if kind == "completion" else "chat", prompt], (kind, prompt, text)
        done = [r[4] for r in results if r[1] == 200 and r[0] != "disconnect"]
        growth_mb = (s.rss_kb() - rss0) / 1024
        print(f"load: {len(results)} requests in {wall:.1f} s, {len(done)} completed ({len(done) / wall:.2f}/s), "
              f"{statuses.count(429)} refused with 429, {sum(r[0] == 'disconnect' and r[1] == 200 for r in results)} "
              f"disconnected; latency p50 {statistics.median(done):.2f} s, "
              f"p95 {statistics.quantiles(done, n=20)[-1]:.2f} s; RSS growth {growth_mb:+.1f} MB")
        assert growth_mb < 20
        assert call(s.port, "chat", PROMPTS[0]) == (200, reference["chat", PROMPTS[0]])  # normal afterwards
        state = s.request("GET", "/slots")[2][0]
        assert not state["is_processing"] and state["n_queued"] == 0, state
    finally:
        err = s.stop()
    assert "Traceback" not in err, err
