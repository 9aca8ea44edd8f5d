"""`ggufspec serve` over real HTTP on 127.0.0.1, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from ggufspec.engine import GenerationSettings, SpeculativeEngine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    """A `ggufspec serve` child process on a free loopback port (or `command`, which serves as it does); its stderr,
    the server's log, is read as it comes (so that the log never fills the pipe) into `log_lines`."""

    def __init__(self, *args: str, command: list[str] | None = None, **popen) -> None:
        command = command or [sys.executable, "-m", "ggufspec.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.log_lines: list[str] = []
        m = None
        for line in self.proc.stderr:  # the listening line, after whatever loading printed
            self.log_lines.append(line)
            if m := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                break
        if not m:
            self.proc.kill()
            raise AssertionError(f"no listening line: {''.join(self.log_lines)}")
        self.reader = threading.Thread(target=self.read_log, daemon=True)
        self.reader.start()
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}/v1"
        for _ in range(100):
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the server never answered /health")

    def read_log(self) -> None:
        for line in self.proc.stderr:
            self.log_lines.append(line)

    def log(self) -> str:
        return "".join(self.log_lines)

    def wait_for_log(self, pattern: str, since: int = 0, timeout: float = 10) -> re.Match:
        """The first match of `pattern` in the server's log from character `since` on, once it is there."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.log()[since:])):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in the server's log:\n{self.log()}")
            time.sleep(0.05)
        return m

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = json.dumps(body) if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), json.loads(raw) if raw else {}

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))

    def wait(self, timeout: float = 30) -> str:
        """Wait for the process to exit; its whole log."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)
        self.proc.stdout.close()
        return self.log()

    def stop(self) -> str:
        self.proc.terminate()
        return self.wait()


def serving(*args: str):
    """A module's server fixture: the server, then stopped with no traceback in its log."""
    s = Server(*args)
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(smollm2_path):
    yield from serving("-m", str(smollm2_path), "-d", str(smollm2_path), "-c", "1024", "--queue", "2")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def test_chat_at_temperature_0_equals_generate(server, client, smollm2_path) -> None:
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION, max_tokens=24,
                                       temperature=0)
    cli = subprocess.run([sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "-d", str(smollm2_path),
                          "--method", "auto", "-c", "1024", "-n", "24", "--json", QUESTION[0]["content"]],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert r.choices[0].message.content == json.loads(cli.stdout)["text"]
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens == len(json.loads(cli.stdout)["tokens"])
    timings = r.model_extra["timings"]
    assert timings["method"] == "auto" and timings["predicted_n"] == r.usage.completion_tokens
    assert {"prompt_n", "prompt_per_second", "predicted_per_second", "draft_n", "draft_n_accepted", "cache_n",
            "tokens_per_pass"} <= set(timings)


def test_streaming_chat_gives_the_same_text_then_usage(client) -> None:
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION, max_tokens=24,
                                          temperature=0)
    chunks = list(client.chat.completions.create(messages=QUESTION, model="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["timings"]["predicted_n"] == full.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_streaming_and_not(server, client, smollm2_path) -> None:
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    with SpeculativeEngine.load(smollm2_path) as engine:
        ref = engine.generate("The capital of France is", GenerationSettings(max_tokens=8))
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == ref.stats.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True))
    assert streamed == ref.text
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_speculation_per_request_and_sampling(client) -> None:
    def run(**spec):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION, max_tokens=24,
                                           temperature=0, extra_body={"speculative": spec} if spec else None)
        return r.choices[0].message.content, r.model_extra["timings"]

    plain, t0 = run(method="autoregressive")
    vanilla, t1 = run(method="vanilla", draft_max=3)
    assert t0["method"] == "autoregressive" and t0["draft_n"] == 0
    # the draft is the target itself: every draft token is kept, and the text is the target's
    assert t1["method"] == "vanilla" and t1["draft_n"] > 0 and t1["draft_n_accepted"] == t1["draft_n"]
    assert vanilla == plain and t1["tokens_per_pass"] > 2
    # a fixed method: `auto` learns from each request, and where it drafts otherwise the next time, its draws
    # follow another path (docs/exactness.md, "Seeds"); on an AMX Xeon two requests here then differed
    sampled = [client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION, max_tokens=16,
                                              temperature=0.9, top_p=0.95, seed=s,
                                              extra_body={"top_k": 40, "min_p": 0.05,
                                                          "speculative": {"method": "vanilla", "draft_max": 3}},
                                              ).choices[0].message.content
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # same seed, same text


def test_the_common_prefix_of_a_conversation_comes_from_the_cache(client) -> None:
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION, max_tokens=16,
                                           temperature=0)
    history = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=history, max_tokens=16,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - cached


BAD = [
    ("POST", "/v1/chat/completions", "{not json", 400, None),
    ("POST", "/v1/chat/completions", "", 400, None),
    ("POST", "/v1/chat/completions", {"model": "x"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": "many"}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": -5}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "temperature": -0.5}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "n": 3}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "speculative": {"method": "warp"}}, 400, "speculative.method"),
    ("POST", "/v1/chat/completions", {"messages": QUESTION, "speculative": {"method": "medusa"}}, 400, "speculative"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("GET", "/v1/nothing", None, 404, None),
]


@pytest.mark.parametrize("method,path,body,status,param", BAD)
def test_bad_requests_get_openai_errors(server, method, path, body, status, param) -> None:
    code, _, out = server.request(method, path, body)
    assert code == status, out
    assert set(out) == {"error"} and out["error"]["message"] and out["error"]["type"], out
    if param:
        assert out["error"]["param"] == param, out


def test_a_prompt_longer_than_the_context_is_a_400_with_the_numbers(server) -> None:
    code, _, out = server.request("POST", "/v1/completions", {"prompt": "word " * 1500, "max_tokens": 4})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded"
    assert re.search(r"\d{4} tokens and the context holds 1024", out["error"]["message"]), out


def test_api_key(smollm2_path) -> None:
    s = Server("-m", str(smollm2_path), "-c", "512", "--api-key", "sekret")
    try:
        assert s.request("GET", "/health")[0] == 200  # open, as in llama-server
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}, {"Authorization": "Basic sekret"}):
            code, _, out = s.request("GET", "/v1/models", headers=headers)
            assert code == 401 and out["error"]["code"] == "invalid_api_key"
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
            assert s.request("GET", "/v1/models", headers={"Authorization": f"{scheme} sekret"})[0] == 200
        assert s.request("GET", "/openapi.json")[0] == 401  # the API's description is behind the key too
        assert s.request("GET", "/openapi.json", headers={"Authorization": "Bearer sekret"})[0] == 200
        ok = openai.OpenAI(base_url=s.url, api_key="sekret", max_retries=0)
        assert ok.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", prompt="Hi", max_tokens=2).usage
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="nope", max_retries=0).models.list()
    finally:
        s.stop()


def start_stream(server: Server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def slots(server: Server) -> dict:
    return server.request("GET", "/slots")[2][0]


def test_a_client_that_disconnects_mid_stream_stops_its_generation(server) -> None:
    before = slots(server)
    conn, r = start_stream(server, {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                                    "max_tokens": 900, "temperature": 0})
    assert r.status == 200
    for _ in range(8):
        assert r.readline()  # a few events: the generation is running
    conn.sock.shutdown(2)
    conn.close()
    for _ in range(300):
        state = slots(server)
        if not state["is_processing"]:
            break
        time.sleep(0.05)
    assert not state["is_processing"] and state["n_cancelled"] == before["n_cancelled"] + 1, state
    assert state["n_decoded"] < 900, state  # stopped long before its 900 tokens
    code, _, out = server.request("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
    assert code == 200 and out["usage"]["completion_tokens"] == 4
