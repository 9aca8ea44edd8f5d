"""`ggufspec serve --parallel 4` over real HTTP on 127.0.0.1: requests answered side by side (continuous batching)
get the text each gets alone, /slots shows the slots at work, admission is N + queue, and a mixed load of 8 clients
(streaming and not, some leaving mid-stream) completes correctly without errors or a leak."""

from __future__ import annotations

import http.client
import json
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from ggufspec.decoder import DecoderOptions
from ggufspec.pool import EnginePool
from test_server import Server, openai_client, serving
from test_server_load import KINDS, call, run_clients

PARALLEL, QUEUE = 4, 8
CHATS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.", "Count to five."]
TEXTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are"]
LONG = "Write a very long story about a dragon named {}."  # runs long: holds its slot until its client leaves


@pytest.fixture(scope="module")
def server(smollm2_path):
    # -c is the whole cache, as llama-server's: 4 slots of 512 tokens
    yield from serving("-m", str(smollm2_path), "-d", str(smollm2_path), "-c", "2048", "-np", str(PARALLEL),
                       "--queue", str(QUEUE))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def explain(smollm2_path):
    """explain(kind, prompt, alone, together): where two answers of the same greedy request part, as tokens, and
    the target's top-2 logit gap there (decoded alone in a slot of a pool like the server's, so with its KV cache
    types): what an assertion's message shows. Diagnosis only: the tests ask for equal texts (the API gives no token
    ids, so the tokens are found again from the texts)."""
    pool = EnginePool.load(smollm2_path, None, DecoderOptions(n_ctx=2048), parallel=PARALLEL)
    engine = pool.engine

    def parting(kind: str, prompt: str, alone: str, together: str) -> str:
        tokens = engine.encode([{"role": "user", "content": prompt}] if kind == "chat" else prompt)
        d, vocab = engine.target, engine.target.vocab
        texts, logits = [alone.encode(), together.encode()], d.sync(tokens)[-1]
        for i in range(64):
            ranked = np.argsort(logits)[::-1][:200]
            pieces = [(int(t), vocab.piece(int(t))) for t in ranked]
            picks = [next((t for t, p in pieces if p and text.startswith(p)), None) for text in texts]
            if picks[0] != picks[1] or picks[0] is None:
                top2 = np.sort(logits)[-2:]
                return (f"they part at token {i}: {[vocab.piece(t) if t is not None else None for t in picks]}, "
                        f"logits {[float(logits[t]) if t is not None else None for t in picks]}, the target's top-2 "
                        f"gap there {float(top2[1] - top2[0]):.4f}")
            texts = [text[len(vocab.piece(picks[0])):] for text in texts]
            logits = d.feed([picks[0]])[-1]
        return "no parting found"

    yield parting
    pool.close()


def slots(server: Server) -> list[dict]:
    return server.request("GET", "/slots")[2]


def wait_idle(server: Server, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        state = slots(server)
        if not any(s["is_processing"] for s in state) and state[0]["n_queued"] == 0:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def chat(client: openai.OpenAI, prompt: str, max_tokens: int = 16) -> str:
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].message.content


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 16) -> str:
    return client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_slots_describe_each_slot_and_the_context_per_slot(server) -> None:
    state = wait_idle(server)
    assert [s["id"] for s in state] == list(range(PARALLEL))
    for s in state:
        assert s["n_ctx"] == 2048 // PARALLEL and s["state"] == "idle" and not s["is_processing"], s
        assert {"n_prompt_tokens", "n_decoded", "n_drafts_kept", "n_queued", "n_completed", "n_cancelled"} <= set(s)
    models = server.request("GET", "/v1/models")[2]["data"][0]["meta"]
    assert models["n_ctx"] == 2048 // PARALLEL and models["parallel"] == PARALLEL


def test_greedy_requests_together_get_the_text_each_gets_alone(server, client, explain) -> None:
    alone = {("chat", p): chat(client, p) for p in CHATS} | {("text", p): complete(client, p) for p in TEXTS}
    completed = slots(server)[0]["n_completed"]
    jobs = [("chat", p) for p in CHATS] + [("text", p) for p in TEXTS]  # 8 at once: 4 slots, 4 queued
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(chat if job[0] == "chat" else complete, client, job[1]) for job in jobs}
        together = {job: f.result(timeout=120) for job, f in futures.items()}
    parted = [(job, alone[job], together[job], explain(*job, alone[job], together[job]))
              for job in jobs if together[job] != alone[job]]
    assert not parted, parted
    assert slots(server)[0]["n_completed"] == completed + len(jobs)


def _open_stream(port: int, prompt: str, max_tokens: int = 400) -> http.client.HTTPConnection:
    """A streaming request sent, its answer not read (so it never waits for its response's head)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
         "stream": True}))
    return conn


def test_slots_show_several_requests_at_once_and_admission_is_parallel_plus_queue(server) -> None:
    wait_idle(server)
    cancelled = slots(server)[0]["n_cancelled"]
    streams = [_open_stream(server.port, LONG.format(name)) for name in ("Ada", "Bo", "Cy", "Di")]
    conns = list(streams)
    try:
        responses = [c.getresponse() for c in streams]
        assert [r.status for r in responses] == [200] * PARALLEL
        for r in responses:
            assert r.readline().startswith(b"data: ")  # each has started: it holds a slot
        deadline = time.monotonic() + 30
        while True:
            state = slots(server)
            busy = [s for s in state if s["state"] == "generating"]
            if len(busy) == PARALLEL and all(s["n_decoded"] > 0 for s in busy):
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert all(s["is_processing"] and s["n_prompt_tokens"] > 0 for s in busy), state
        assert state[0]["n_queued"] == 0, state
        # the queue takes QUEUE more; the next one is refused
        conns += [_open_stream(server.port, LONG.format(f"Queued{i}")) for i in range(QUEUE)]
        deadline = time.monotonic() + 10
        while slots(server)[0]["n_queued"] < QUEUE:
            assert time.monotonic() < deadline, slots(server)
            time.sleep(0.05)
        code, headers, out = server.request("POST", "/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert code == 429 and headers.get("retry-after") == "1" and out["error"]["type"] == "rate_limit_error", out
        assert "--parallel 4, --queue 8" in out["error"]["message"], out
    finally:
        for c in conns:  # every client leaves: each request stops at its next token, or before it starts
            if c.sock is not None:
                c.sock.shutdown(2)
            c.close()
    state = wait_idle(server)
    assert state[0]["n_cancelled"] == cancelled + PARALLEL + QUEUE, state
    assert all(s["n_decoded"] < 400 for s in state), state
    code, _, out = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert code == 200 and out["usage"]["completion_tokens"] == 3


# --- load: 8 clients x 5 requests ---------------------------------------------------------------------------------

CLIENTS, REQUESTS = 8, 5  # with test_server_load's KINDS: request j of every client


def _body(kind: str, prompt: str) -> tuple[str, dict]:
    if kind == "completion":
        return "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    b = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400 if kind == "disconnect" else 12,
         "temperature": 0}
    return "/v1/chat/completions", {**b, "stream": kind != "chat"}


def _call(port: int, kind: str, prompt: str) -> tuple[int, str | None]:
    """(HTTP status, the text) of a request of this file's shapes; text None for a deliberate disconnect."""
    return call(port, kind, prompt, make_body=_body)


def test_load_of_8_clients_on_4_slots(server, explain) -> None:
    prompts = CHATS + [LONG.format("Eve")]
    reference = {(k, p): _call(server.port, k, p)[1] for p in prompts for k in ("chat", "completion")}
    with ThreadPoolExecutor(CLIENTS) as pool:  # warm-up: every slot used, every kind, side by side
        list(pool.map(lambda i: _call(server.port, KINDS[i % len(KINDS)], prompts[i % len(prompts)]), range(CLIENTS)))
    wait_idle(server)
    rss0 = server.rss_kb()
    results, wall = run_clients(_call, server.port, prompts, CLIENTS, REQUESTS, timeout=240)
    # at most 8 requests in flight (a little more while a request that just ended or left is being cleaned up), and
    # the server admits 4 + 8: nothing is refused, nothing fails
    assert [r for r in results if r[1] != 200] == []
    parted = {}
    for kind, _, text, prompt, _ in results:
        ref_kind = "completion" if kind == "completion" else "chat"
        if kind != "disconnect" and text != reference[ref_kind, prompt]:
            parted[kind, prompt, text] = explain(ref_kind, prompt, reference[ref_kind, prompt], text)
    assert not parted, (len(parted), parted)
    done = [r[4] for r in results if r[0] != "disconnect"]
    state = wait_idle(server)
    growth_mb = (server.rss_kb() - rss0) / 1024
    print(f"load on {PARALLEL} slots: {len(results)} requests in {wall:.1f} s, {len(done)} completed "
          f"({len(done) / wall:.2f}/s), latency p50 {statistics.median(done):.2f} s, "
          f"p95 {statistics.quantiles(done, n=20)[-1]:.2f} s; RSS growth {growth_mb:+.1f} MB")
    assert growth_mb < 20
    assert all(s["n_decoded"] < 400 for s in state), state  # the disconnected ones stopped
    assert _call(server.port, "chat", prompts[0]) == (200, reference["chat", prompts[0]])  # normal afterwards


def test_sigterm_ends_every_stream_on_every_slot_with_a_final_chunk(smollm2_path) -> None:
    from test_server_boundary import stream_lines

    s = Server("-m", str(smollm2_path), "-c", "2048", "-np", str(PARALLEL), "--queue", "2")
    n = PARALLEL + 2
    lines: list[list[str]] = [[] for _ in range(n)]
    statuses: list[list[int]] = [[] for _ in range(n)]
    threads = [threading.Thread(target=stream_lines, args=(s.port, lines[i], statuses[i])) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:
        state = slots(s)
        if sum(x["state"] == "generating" for x in state) == PARALLEL and state[0]["n_queued"] == 2:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    err = s.wait(timeout=30)
    assert s.proc.returncode == 0 and "Traceback" not in err, err
    streamed = [i for i in range(n) if statuses[i] == [200]]
    assert len(streamed) >= PARALLEL and all(statuses[i] in ([200], [503]) for i in range(n)), statuses
    for i in streamed:  # each ends with its final chunk (cut: "length", with timings) and [DONE]
        events = [json.loads(x[6:]) for x in lines[i] if x.startswith("data: {")]
        assert [x for x in lines[i] if x.strip()][-1] == "data: [DONE]\n", lines[i][-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "length" and "timings" in events[-1], events[-1]
