"""`ggufspec serve` against hostile and careless clients, over real loopback connections: the work a request may cost
is bounded before any expensive step, web pages cannot drive the server, slow or idle connections are dropped, client
input never causes a 500, and a signal ends every stream properly."""

from __future__ import annotations

import http.client
import json
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import TINY
from test_server import QUESTION, Server
from tiny_models import write_tiny_gguf

GROWTH_KB = 100_000  # the most a refused request may add to the server's resident memory


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = Server("-m", str(smollm2_path), "-c", "1024", "--queue", "2")
    yield s
    err = s.stop()
    assert "Traceback" not in err and "Exception" not in err, err


@pytest.fixture(scope="module")
def roomy(smollm2_path):
    """A server that reads bodies up to 64 MiB: the bounds after the body is read."""
    s = Server("-m", str(smollm2_path), "-c", "1024", "--max-body", "64M")
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def connect(port: int, timeout: float = 30) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def response_of(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on `sock` (read until the server closes or the body is complete)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.strip() else {}


def _length(data: bytes) -> int:
    m = re.search(rb"content-length: (\d+)", data.split(b"\r\n\r\n", 1)[0], re.I)
    return int(m.group(1)) if m else 1 << 62


def head(path: str, port: int, extra: str = "", content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n{extra}\r\n").encode()


# --- bounded work before any expensive step ---------------------------------------------------------------------

def test_a_body_over_the_limit_is_refused_from_its_length_before_it_is_read(server) -> None:
    before = server.rss_kb()
    with connect(server.port) as sock:
        sock.sendall(head("/v1/completions", server.port, "Content-Length: 50000000\r\n"))  # and no body at all
        status, out = response_of(sock)
    assert status == 413 and out["error"]["code"] == "request_too_large", out
    assert server.rss_kb() - before < GROWTH_KB


def test_a_chunked_body_over_the_limit_is_refused_as_it_grows(server) -> None:
    before = server.rss_kb()
    chunk = b"x" * (1 << 20)
    sent = 0
    with connect(server.port) as sock:
        sock.sendall(head("/v1/completions", server.port, "Transfer-Encoding: chunked\r\n"))
        try:
            while sent < 50 << 20 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, out = response_of(sock)
    assert status == 413 and out["error"]["code"] == "request_too_large", out
    assert sent < 50 << 20, "the server read the whole 50 MB body"
    assert server.rss_kb() - before < GROWTH_KB


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_the_limit_is_read_and_one_byte_more_refused(server, chunked) -> None:
    """--max-body is exact: a body of that many bytes is answered, one byte more is refused with 413, from its
    Content-Length or as it streams."""
    from ggufspec.server.boundary import default_max_body

    limit = default_max_body(1024)  # the fixture's: -c 1024, no --max-body
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    for size, want in ((limit, 200), (limit + 1, 413)):
        data = body + b" " * (size - len(body))
        with connect(server.port) as sock:
            sock.sendall(head("/v1/completions", server.port,
                              "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n"))
            try:
                sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (size, data) if chunked else data)
            except (BrokenPipeError, ConnectionResetError):  # refused before the body was all sent
                pass
            status, out = response_of(sock)
        assert status == want, (size, chunked, out)


def post_json(s: Server, path: str, body: dict) -> tuple[int, dict, float]:
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    code, _, out = s.request("POST", path, data)
    return code, out, time.perf_counter() - t0


def test_a_20_mb_one_word_prompt_is_refused_without_tokenizing_it(roomy) -> None:
    before = roomy.rss_kb()
    code, out, seconds = post_json(roomy, "/v1/completions", {"prompt": "x" * 20_000_000, "max_tokens": 4})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert "at least" in out["error"]["message"], out  # decided from its length, before llama.cpp's tokenizer
    assert roomy.rss_kb() - before < GROWTH_KB
    print(f"20 MB one-word prompt: {code} in {seconds:.2f} s")


def test_100000_messages_are_refused_before_rendering(roomy) -> None:
    before = roomy.rss_kb()
    code, out, seconds = post_json(roomy, "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 4})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert roomy.rss_kb() - before < GROWTH_KB
    print(f"100,000 messages: {code} in {seconds:.2f} s")


def test_a_conversation_rendered_longer_than_the_context_can_hold_is_refused(roomy) -> None:
    code, out, _ = post_json(roomy, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "word " * 400_000}], "max_tokens": 4})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded", out
    code, _, out = roomy.request("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
    assert code == 200 and out["usage"]["completion_tokens"] == 2


# --- client input never causes a 500 ----------------------------------------------------------------------------

ODD = [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400),
    ('{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}', 400),
    ('{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400),
    ('{"prompt": "\\ud83d\\ude00 a pair is fine", "max_tokens": 2}', 200),
    ('{"prompt": "Hi", "max_tokens": 2, "seed": -1, "temperature": 0.8}', 200),
    ('{"prompt": "Hi", "max_tokens": 2, "seed": -5}', 200),
    ('{"prompt": "Hi", "max_tokens": 2, "seed": 18446744073709551615}', 200),
]


@pytest.mark.parametrize("body,status", ODD, ids=["deep", "surrogate", "low-surrogate", "pair", "seed-1", "seed-5", "seed-big"])
def test_odd_json_gets_a_4xx_or_an_answer_never_a_500(server, body, status) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, _, out = server.request("POST", path, body)
    assert code == status, out
    if status == 400:
        assert out["error"]["type"] == "invalid_request_error", out


def test_a_streamed_seed_of_minus_one_streams(server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3, "seed": -1, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert r.status == 200 and events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events


def test_a_client_that_drops_mid_upload_leaves_no_trace(server) -> None:
    with connect(server.port) as sock:
        sock.sendall(head("/v1/completions", server.port, "Content-Length: 1000\r\n") + b'{"prompt": "He')
    time.sleep(0.3)
    assert server.request("GET", "/health")[0] == 200  # and the fixture finds no traceback in the log


# --- the browser boundary -----------------------------------------------------------------------------------------

def test_a_cross_origin_text_plain_post_is_refused(server) -> None:
    # what a web page can send without a CORS preflight: text/plain, with its Origin
    code, _, out = server.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                                  headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert code in (403, 415), out
    code, _, out = server.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                                  headers={"Content-Type": "text/plain"})
    assert code == 415 and "application/json" in out["error"]["message"], out
    code, _, out = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2},
                                  headers={"Origin": "http://evil.example"})
    assert code == 403 and out["error"]["code"] == "origin_not_allowed", out


@pytest.mark.parametrize("host,status", [("evil.example:{port}", 403), ("evil.example", 403), ("localhost:{port}", 200),
                                         ("127.0.0.1:{port}", 200), ("app.localhost:{port}", 200), ("[::1]:{port}", 200)])
def test_the_host_header_must_name_this_machine(server, host, status) -> None:
    # a DNS rebinding page reaches 127.0.0.1 under its own domain name, which its requests carry in Host
    code, _, out = server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                  headers={"Host": host.format(port=server.port)})
    assert code == status, out
    if status == 403:
        assert out["error"]["code"] == "host_not_allowed" and "--allowed-host" in out["error"]["message"], out


def test_allowed_hosts_and_cors_origins_are_opt_in(smollm2_path) -> None:
    s = Server("-m", str(smollm2_path), "-c", "512", "--allowed-host", "box.lan", "--cors-origin", "http://localhost:3000")
    try:
        assert s.request("GET", "/v1/models", headers={"Host": "box.lan"})[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and r.getheader("access-control-allow-origin") == "http://localhost:3000"
        code, headers, _ = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                     headers={"Origin": "http://localhost:3000"})
        assert code == 200 and headers.get("access-control-allow-origin") == "http://localhost:3000"
        assert s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                         headers={"Origin": "http://localhost:4000"})[0] == 403
    finally:
        assert "Traceback" not in s.stop()


# --- connections ----------------------------------------------------------------------------------------------------

def test_slow_and_idle_connections_are_dropped_after_the_timeout(smollm2_path) -> None:
    s = Server("-m", str(smollm2_path), "-c", "512", "--timeout", "1")
    try:
        idle, partial_head, partial_body = (connect(s.port, timeout=20) for _ in range(3))
        partial_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        partial_body.sendall(head("/v1/completions", s.port, "Content-Length: 100\r\n") + b'{"prompt"')
        for sock in (idle, partial_head, partial_body):
            with sock:
                data = b""
                while chunk := sock.recv(4096):  # a socket.timeout here: the server kept it open
                    data += chunk
        assert s.request("GET", "/health")[0] == 200
    finally:
        assert "Traceback" not in s.stop()


def test_a_connection_that_never_sends_a_byte_is_closed_as_idle(server) -> None:
    # README: idle connections close after 5 s; one that never sent a byte stayed for --timeout (60 s)
    with connect(server.port, timeout=30) as sock:
        t0 = time.monotonic()
        assert sock.recv(4096) == b""  # a socket.timeout here: the server kept it open 30 s
        closed = time.monotonic() - t0
    assert closed < 20, closed
    print(f"a silent connection closed after {closed:.1f} s")


def test_300_idle_connections_under_a_256_descriptor_limit_do_not_starve_a_new_request(smollm2_path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip("this test needs 400 file descriptors for its own connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 400) if hard == resource.RLIM_INFINITY else min(max(soft, 400), hard), hard))
    s = Server("-m", str(smollm2_path), "-c", "512",
               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    idle = []
    try:
        for _ in range(300):
            idle.append(connect(s.port, timeout=10))
        code, _, out = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert code == 200 and out["usage"]["completion_tokens"] == 2
    finally:
        for sock in idle:
            sock.close()
        err = s.stop()
    assert "Traceback" not in err and err.count("\n") < 10, err[-3000:]  # no storm of accept() errors


def test_a_non_streaming_client_that_disconnects_stops_its_generation_at_once(server) -> None:
    before = server.request("GET", "/slots")[2][0]
    with connect(server.port) as sock:
        body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                           "max_tokens": 900, "temperature": 0}).encode()
        sock.sendall(head("/v1/chat/completions", server.port, f"Content-Length: {len(body)}\r\n") + body)
        for _ in range(600):  # until it generates
            if server.request("GET", "/slots")[2][0]["n_decoded"] > 10:
                break
            time.sleep(0.02)
    at_close = server.request("GET", "/slots")[2][0]["n_decoded"]
    for _ in range(300):
        state = server.request("GET", "/slots")[2][0]
        if not state["is_processing"]:
            break
        time.sleep(0.02)
    assert not state["is_processing"] and state["n_cancelled"] == before["n_cancelled"] + 1, state
    # one target pass commits one token here (no draft): it stops within a few, not tens or all 900
    assert state["n_decoded"] - at_close <= 8, (at_close, state)
    print(f"non-streaming disconnect: {state['n_decoded'] - at_close} tokens after the client left")


def _send_chat(port: int, content: str, max_tokens: int) -> socket.socket:
    """A chat request sent on a raw connection whose answer is never read (the caller closes it: its client leaves)."""
    sock = connect(port)
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    sock.sendall(head("/v1/chat/completions", port, f"Content-Length: {len(body)}\r\n") + body)
    return sock


def _wait_for(server: Server, ready, timeout: float = 60) -> dict:
    """Slot 0's /slots entry once `ready(entry)` holds (AssertionError after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not ready(state := server.request("GET", "/slots")[2][0]):
        assert time.monotonic() < deadline, state
        time.sleep(0.01)
    return state


def test_a_queued_request_whose_client_left_gives_its_place_back_at_once(server) -> None:
    # -np 1 --queue 2: one request holds the slot, two wait; when their clients give up, their places were kept (new
    # requests got 429) and their 499s logged only once the slot was free
    before = server.request("GET", "/slots")[2][0]
    holder = _send_chat(server.port, "Write a very long story about a dragon.", 900)
    try:
        _wait_for(server, lambda s: s["n_decoded"] > 2)
        waiting = [_send_chat(server.port, "Hi", 2) for _ in range(2)]
        _wait_for(server, lambda s: s["n_queued"] == 2)
        assert server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 429
        since = len(server.log())
        for sock in waiting:
            sock.close()
        state = _wait_for(server, lambda s: s["n_queued"] == 0, timeout=10)
        assert state["is_processing"] and state["n_cancelled"] == before["n_cancelled"] + 2, state
        for _ in range(2):
            since += server.wait_for_log(r"POST /v1/chat/completions 499: [^\n]*the client left", since).end()
        late = _send_chat(server.port, "Hi", 2)  # admitted: it waits in the queue again, not a 429
        _wait_for(server, lambda s: s["n_queued"] == 1 and s["is_processing"], timeout=10)
        late.close()
        _wait_for(server, lambda s: s["n_queued"] == 0, timeout=10)
    finally:
        holder.close()
    state = _wait_for(server, lambda s: not s["is_processing"])
    assert state["n_cancelled"] == before["n_cancelled"] + 4 and state["n_completed"] == before["n_completed"], state


def test_slots_count_every_completion(server) -> None:
    before = server.request("GET", "/slots")[2][0]["n_completed"]
    for _ in range(12):
        assert server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200
    assert server.request("GET", "/slots")[2][0]["n_completed"] == before + 12


# --- chat templates from the model file ------------------------------------------------------------------------------

TEMPLATES = {
    "loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "did not finish"),
    "raise": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "type": ("{{ messages + 1 }}", "TypeError"),
    "recursion": ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "recurses"),
    "empty": ("{% if false %}never{% endif %}", "empty prompt"),
    "memory": ("{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
               "{{ ns.s }}", "memory"),
}


@pytest.fixture(scope="module")
def template_models(tmp_path_factory, tokenizer_fields, tiny_weights):
    folder = tmp_path_factory.mktemp("templates")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", tokenizer_fields, tiny_weights, TINY, chat_template=t)
            for name, (t, _) in TEMPLATES.items()}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_bad_chat_template_is_one_clear_error_in_the_cli(template_models, name) -> None:
    r = subprocess.run([sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(template_models[name]), "-n", "4",
                        "Hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "chat template" in r.stderr and TEMPLATES[name][1] in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["raise", "empty", "loop"])
def test_a_bad_chat_template_is_a_400_and_the_server_goes_on(template_models, name) -> None:
    s = Server("-m", str(template_models[name]), "-c", "512", "--queue", "0")
    try:
        code, _, out = s.request("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
        assert code == 400 and "chat template" in out["error"]["message"], out
        assert TEMPLATES[name][1] in out["error"]["message"], out
        code, _, out = s.request("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert code == 200 and out["usage"]["completion_tokens"] == 2
        assert s.request("GET", "/health")[2] == {"status": "ok"}
    finally:
        assert "Traceback" not in s.stop()


def test_rendering_is_queued_shown_and_cancelled_with_its_request(template_models) -> None:
    s = Server("-m", str(template_models["loop"]), "-c", "512", "--queue", "0")
    try:
        sock = connect(s.port)
        body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
        sock.sendall(head("/v1/chat/completions", s.port, f"Content-Length: {len(body)}\r\n") + body)
        for _ in range(200):
            state = s.request("GET", "/slots")[2][0]
            if state["is_processing"]:
                break
            time.sleep(0.02)
        assert state["is_processing"] and state["state"] == "prompt", state
        code, _, out = s.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert code == 429, out  # --queue 0: the rendering holds the engine
        sock.close()  # its client leaves: the rendering is stopped, long before its 5 s limit
        t0 = time.perf_counter()
        while s.request("GET", "/slots")[2][0]["is_processing"]:
            time.sleep(0.02)
        stopped = time.perf_counter() - t0
        state = s.request("GET", "/slots")[2][0]
        assert state["n_cancelled"] == 1, state
        assert s.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})[0] == 200
        print(f"rendering stopped {stopped:.2f} s after its client left")
    finally:
        assert "Traceback" not in s.stop()


# --- signals ------------------------------------------------------------------------------------------------------

def stream_lines(port: int, out: list[str], status: list[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "max_tokens": 900,
         "stream": True}))
    r = conn.getresponse()
    status.append(r.status)
    for line in r:
        out.append(line.decode())


@pytest.mark.parametrize("sig,exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_ends_the_streams_in_flight_with_a_final_chunk_and_exits_cleanly(smollm2_path, sig, exit_code) -> None:
    s = Server("-m", str(smollm2_path), "-c", "1024", "--queue", "2")
    lines: list[list[str]] = [[], []]
    statuses: list[list[int]] = [[], []]
    threads = [threading.Thread(target=stream_lines, args=(s.port, lines[i], statuses[i])) for i in range(2)]
    threads[0].start()
    while len(lines[0]) < 10:
        time.sleep(0.02)
    threads[1].start()  # waits in the queue
    time.sleep(0.3)
    s.proc.send_signal(sig)
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=30)
    err = s.wait(timeout=30)
    print(f"{signal.Signals(sig).name}: streams ended and the server exited {time.perf_counter() - t0:.2f} s later")
    assert s.proc.returncode == exit_code, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    events = [json.loads(x[6:]) for x in lines[0] if x.startswith("data: {")]
    assert lines[0][-2:] == ["data: [DONE]\n", "\n"] or [x for x in lines[0] if x.strip()][-1] == "data: [DONE]\n"
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "timings" in events[-1], events[-1]
    # the queued request never started: it is told why, as a server error it may retry elsewhere
    assert statuses[1] == [503] or [x for x in lines[1] if x.strip()][-1] == "data: [DONE]\n", (statuses, lines[1])


def test_the_worker_reports_a_rendering_that_makes_no_progress(template_models) -> None:
    # /health answers 503 past STALL_SECONDS of this; here the template's 5 s limit ends the stall first
    import asyncio

    from ggufspec.engine import GenerationSettings, SpeculativeEngine
    from ggufspec.errors import GGUFSpecError
    from ggufspec.server.worker import Worker

    async def run(worker: Worker) -> tuple[float, float, object, float]:
        idle = worker.stalled_for()
        job = worker.submit(QUESTION, GenerationSettings(max_tokens=2))
        await asyncio.sleep(1.5)
        stalled = worker.stalled_for()
        first = await job.events.get()
        while await job.events.get() is not None:
            pass
        return idle, stalled, first, worker.stalled_for()

    with SpeculativeEngine.load(template_models["loop"]) as engine:
        worker = Worker(engine, 0)
        try:
            idle, stalled, first, after = asyncio.run(run(worker))
        finally:
            worker.shutdown()
    assert idle == 0 and stalled > 1.0 and after == 0
    assert isinstance(first, GGUFSpecError) and "did not finish" in str(first)
