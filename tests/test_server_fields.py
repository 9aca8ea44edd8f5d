"""`ggufspec serve` as llama-server and OpenAI clients use it, over real HTTP on 127.0.0.1: random seeds, the request
fields it refuses rather than ignore, llama-server's `n_predict`, any model name, the request log, and errors that
reach the log with an id, streaming or not."""

from __future__ import annotations

import http.client
import json
import re
import sys

import pytest

from ggufspec.server.api import REFUSED
from test_server import QUESTION, Server, client  # noqa: F401  (client: test_server's fixture, on this module's server)

ALIAS = "smol"
DEFAULT_MAX = 6  # the server's -n: what a request without a limit gets


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = Server("-m", str(smollm2_path), "-c", "1024", "-n", str(DEFAULT_MAX), "--alias", ALIAS)
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def post(server: Server, path: str, body: dict) -> tuple[int, dict, dict | list[dict]]:
    """Status, headers and the JSON body; for a stream, its events (`[DONE]` as the string)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read().decode()
    conn.close()
    if r.status == 200 and body.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        return r.status, dict(r.getheaders()), [e if e == "[DONE]" else json.loads(e) for e in events]
    return r.status, dict(r.getheaders()), json.loads(raw)


def streamed_text(events: list) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in events if isinstance(c, dict) and c.get("choices"))


def request(endpoint: str, **fields) -> tuple[str, dict]:
    if endpoint == "chat":
        return "/v1/chat/completions", {"messages": QUESTION, **fields}
    return "/v1/completions", {"prompt": "The capital of France is", **fields}


# --- seeds -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("temperature", [0, 0.9])
@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_a_negative_seed_is_a_random_seed(server, endpoint, temperature, stream) -> None:
    path, body = request(endpoint, max_tokens=4, temperature=temperature, stream=stream)
    code, _, out = post(server, path, {**body, "seed": -1})
    assert code == 200, out
    if stream:
        assert out[-1] == "[DONE]" and not any("error" in e for e in out[:-1] if isinstance(e, dict)), out
        text, finals = streamed_text(out), [e for e in out[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["timings"]["predicted_n"] >= 1, out
    else:
        text = out["choices"][0].get("text") or out["choices"][0].get("message", {}).get("content")
        assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["usage"]["completion_tokens"] >= 1
    assert text
    if temperature == 0:  # greedy: the seed changes nothing
        code, _, plain = post(server, path, {**body, "stream": False, "seed": -7})
        assert code == 200 and text == (plain["choices"][0].get("text") or plain["choices"][0]["message"]["content"])


def test_seed_minus_one_through_the_openai_client_differs_between_requests(client) -> None:
    texts = {client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=12, temperature=2.0,
                                       seed=-1).choices[0].text for _ in range(4)}
    assert len(texts) > 1, texts  # not one fixed seed
    same = {client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=12, temperature=2.0,
                                      seed=3).choices[0].text for _ in range(2)}
    assert len(same) == 1


# --- temperatures: the greedy limit, and numbers that are not finite ------------------------------------------------

@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_a_temperature_too_small_for_float32_gives_the_greedy_text(server, endpoint) -> None:
    # 1/T overflowed float32: every probability was NaN and the answer junk, with a 200
    path, body = request(endpoint, max_tokens=8, seed=1, speculative={"method": "lookup"})
    code, _, greedy = post(server, path, {**body, "temperature": 0})
    assert code == 200, greedy
    for temperature in (1e-38, 1e-45, 5e-324):
        code, _, out = post(server, path, {**body, "temperature": temperature})
        assert code == 200 and out["choices"] == greedy["choices"], (temperature, out)


@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_each_sampling_filter_of_a_request_takes_effect(server, endpoint) -> None:
    """top_k 1, top_p near 0 and min_p 1 each leave the likeliest token alone: at temperature 1.5 the answer is then
    the greedy one, which the same request without them is not (a field ignored would draw from the whole row)."""
    path, body = request(endpoint, max_tokens=12, seed=5, temperature=1.5)
    _, _, greedy = post(server, path, {**body, "temperature": 0})
    code, _, drawn = post(server, path, body)
    assert code == 200 and drawn["choices"] != greedy["choices"]  # (what the test tells apart)
    for field in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        code, _, out = post(server, path, {**body, **field})
        assert code == 200 and out["choices"] == greedy["choices"], (field, out)


def test_a_request_holds_at_most_16_stop_strings(server) -> None:
    """OpenAI's bound (4) raised to 16, each stop string a scan of the text at every token: 17 is a 400 naming
    `stop`; 16 are taken, the one that comes ending the answer before it."""
    path, body = request("text", max_tokens=12, temperature=0)
    _, _, whole = post(server, path, body)
    text = whole["choices"][0]["text"]
    stops = [f"never said {i}" for i in range(15)] + [text[3:6]]
    code, _, out = post(server, path, {**body, "stop": stops})
    cut = text[: text.index(stops[-1])]
    assert code == 200 and out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop", out
    code, _, out = post(server, path, {**body, "stop": stops + ["one more"]})
    assert code == 400 and out["error"]["param"] == "stop", out


def test_a_requests_draft_max_bounds_each_pass(server) -> None:
    """speculative.draft_max: lookup guesses at most that many tokens a pass (its timings say so), where the
    server's default lets it guess more on text that repeats itself."""
    body = {"prompt": "1 2 3 4 5 " * 6, "max_tokens": 24, "temperature": 0}
    timings = {}
    for draft_max in (None, 1):
        spec = {"method": "lookup", **({"draft_max": draft_max} if draft_max else {})}
        code, _, out = post(server, "/v1/completions", {**body, "speculative": spec})
        assert code == 200, out
        timings[draft_max] = out["timings"]
    assert timings[None]["draft_n"] > timings[None]["target_passes"]  # (what the test tells apart)
    assert 0 < timings[1]["draft_n"] <= timings[1]["target_passes"], timings


@pytest.mark.parametrize("fields,param", [
    ('"temperature": Infinity', "temperature"), ('"temperature": NaN', "temperature"), ('"top_p": -Infinity', "top_p"),
    ('"temperature": 1e999', "temperature"), ('"speculative": {"draft_p_min": NaN}', "speculative.draft_p_min"),
    ('"logit_bias": {"42": NaN}', "logit_bias.42"), ('"stop": ["x"], "weights": [1.5, -1e400]', "weights.1"),
], ids=["inf", "nan", "-inf", "overflow", "nested", "refused-field", "unknown-field"])
def test_a_number_that_is_not_finite_is_a_400_naming_its_field(server, fields, param) -> None:
    # Python's JSON parser takes NaN and Infinity; "temperature": Infinity drew random tokens with a 200
    body = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, %s}' % fields
    code, _, out = server.request("POST", "/v1/chat/completions", body)
    assert code == 400 and out["error"]["param"] == param, out
    assert out["error"]["message"].startswith(f"{param}: ") and "not a finite number" in out["error"]["message"], out


# --- fields that would change the output are refused, by name --------------------------------------------------------

CHANGING = [
    ("grammar", 'root ::= "yes"'), ("json_schema", {"type": "object"}), ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("repeat_penalty", 1.1), ("repeat_penalty", 0.9), ("presence_penalty", 0.5), ("frequency_penalty", -0.2),
    ("repetition_penalty", 1.2), ("mirostat", 2), ("typical_p", 0.5), ("tfs_z", 0.9), ("top_n_sigma", 1.0),
    ("min_keep", 5), ("dynatemp_range", 0.5), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
    ("logit_bias", {"42": -100}), ("logit_bias", [[42, False]]), ("n_probs", 3), ("logprobs", True),
    ("top_logprobs", 2), ("n", 2), ("best_of", 3), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"), ("samplers", ["top_k", "top_p", "min_p", "temperature"]),
    ("samplers", "edkypmxt"), ("samplers", ["temperature"]), ("samplers", 7), ("n_keep", 10), ("n_keep", -1),
    ("t_max_predict_ms", 500), ("lora", [{"id": 0, "scale": 1.0}]), ("chat_template_kwargs", {"enable_thinking": True}),
    ("echo", True), ("suffix", "end"), ("min_tokens", 4), ("stop_token_ids", [2]), ("guided_regex", "[0-9]+"),
    ("modalities", ["text", "audio"]), ("image_data", [{"data": "", "id": 1}]), ("n", "many"),
]


@pytest.mark.parametrize("field,value", CHANGING, ids=[f"{f}={json.dumps(v)[:20]}" for f, v in CHANGING])
def test_a_field_that_would_change_the_output_is_refused_by_name(server, field, value) -> None:
    for endpoint, stream in (("chat", False), ("text", True)):
        path, body = request(endpoint, max_tokens=2, stream=stream)
        code, _, out = post(server, path, {**body, field: value})
        assert code == 400, out
        error = out["error"]
        assert error["param"] == field and error["code"] == "unsupported_parameter", out
        assert error["message"].startswith(f"{field}: ") and "not supported" in error["message"], out


@pytest.mark.parametrize("fields,param", [
    ({"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2}, "mirostat"),
    ({"mirostat_tau": 4.0, "mirostat": 1}, "mirostat"),
    ({"repeat_last_n": 64, "repeat_penalty": 1.3}, "repeat_penalty"),
    ({"penalize_nl": True, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"dry_base": 2.0, "dry_multiplier": 0.5}, "dry_multiplier"),
    ({"xtc_threshold": 0.2, "xtc_probability": 0.5}, "xtc_probability"),
    ({"dynatemp_exponent": 2.0, "dynatemp_range": 1.0}, "dynatemp_range"),
])
def test_a_samplers_parameters_are_refused_under_the_name_that_turns_it_on(server, fields, param) -> None:
    code, _, out = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, **fields})
    assert code == 400 and out["error"]["param"] == param, out


# What llama.cpp's web UI and OpenAI clients send by default, plus fields ggufspec does not know: all harmless.
HARMLESS = {
    "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False,
    "top_logprobs": 0, "tools": [], "tool_choice": "auto", "response_format": {"type": "text"}, "grammar": "",
    "json_schema": None, "repeat_penalty": 1.0, "repeat_last_n": 64, "penalize_nl": False, "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0, "tfs_z": 1.0, "top_n_sigma": -1, "min_keep": 0,
    "dynatemp_range": 0, "dynatemp_exponent": 1.0, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":"], "xtc_probability": 0, "xtc_threshold": 0.1,
    "samplers": ["dry", "temperature", "top_k", "typ_p", "top_p", "min_p", "xtc"], "n_probs": 0, "ignore_eos": False,
    "n_keep": 0, "t_max_predict_ms": 0, "lora": [], "chat_template_kwargs": {}, "repetition_penalty": 1,
    "modalities": ["text"], "parallel_tool_calls": True,
    # not ggufspec's: accepted and ignored
    "user": "someone", "store": False, "cache_prompt": True, "timings_per_token": False, "id_slot": -1,
    "metadata": {"a": "b"}, "some_future_field": {"x": [1, 2]},
}


@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_harmless_values_and_unknown_fields_are_accepted_and_change_nothing(server, endpoint) -> None:
    path, body = request(endpoint, max_tokens=5, temperature=0)
    code, _, plain = post(server, path, body)
    code2, _, out = post(server, path, {**body, **HARMLESS, "echo": False, "suffix": None})
    assert code == code2 == 200, out
    assert out["choices"] == plain["choices"]
    code, _, out = post(server, path, {**body, "stream": True, **HARMLESS, "samplers": "dtkypmx"})
    assert code == 200 and streamed_text(out) == (plain["choices"][0].get("text")
                                                  or plain["choices"][0]["message"]["content"]), out


@pytest.mark.parametrize("bias", [{"42": 0}, {"42": 0.0, "7": -0.0}, [[42, 0]], {}, None])
def test_a_logit_bias_that_biases_nothing_is_accepted(server, bias) -> None:
    path, body = request("chat", max_tokens=5, temperature=0)
    plain = post(server, path, body)[2]
    code, _, out = post(server, path, {**body, "logit_bias": bias})
    assert code == 200 and out["choices"] == plain["choices"], out


def test_the_refusal_table_covers_llama_servers_and_openais_fields() -> None:
    for field in ("grammar", "json_schema", "response_format", "repeat_penalty", "repeat_last_n", "presence_penalty",
                  "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "typical_p", "tfs_z",
                  "dry_multiplier", "xtc_probability", "logit_bias", "n_probs", "logprobs", "top_logprobs", "n",
                  "tools", "tool_choice", "penalize_nl", "samplers", "dynatemp_range", "n_keep"):
        assert field in REFUSED, field


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ignore_eos_runs_an_answer_that_would_end_to_max_tokens(server, stream) -> None:
    """llama-server's ignore_eos: the end-of-generation token is never picked (what the text is, test_equivalence)."""
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 24, "temperature": 0,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    runs = {}
    for ignore in (False, True):
        code, _, out = post(server, "/v1/chat/completions", {**body, "ignore_eos": ignore})
        assert code == 200, out
        last = [c for c in out if isinstance(c, dict)][-1] if stream else out
        finish = [c["choices"][0]["finish_reason"] for c in out if isinstance(c, dict) and c.get("choices")][-1] \
            if stream else out["choices"][0]["finish_reason"]
        runs[ignore] = (finish, last["usage"]["completion_tokens"],
                        streamed_text(out) if stream else out["choices"][0]["message"]["content"])
    assert runs[False][0] == "stop" and runs[False][1] < 24
    assert runs[True][:2] == ("length", 24)
    assert runs[True][2].startswith(runs[False][2])
    code, _, out = post(server, "/v1/chat/completions", {**body, "ignore_eos": "sometimes"})
    assert code == 400 and out["error"]["param"] == "ignore_eos", out


# --- n_predict ----------------------------------------------------------------------------------------------------------

def test_n_predict_is_max_tokens(server) -> None:
    path, body = request("text", temperature=0)
    code, _, by_max = post(server, path, {**body, "max_tokens": 3})
    code2, _, by_n = post(server, path, {**body, "n_predict": 3})
    code3, _, both = post(server, path, {**body, "n_predict": 3, "max_tokens": 3})
    assert code == code2 == code3 == 200, (by_max, by_n, both)
    assert by_n["usage"]["completion_tokens"] == 3 and by_n["choices"] == by_max["choices"] == both["choices"]
    code, _, out = post(server, path, {**body, "n_predict": 2, "stream": True})
    assert code == 200 and [e for e in out if e != "[DONE]" and e["choices"][0]["finish_reason"]][0][
        "timings"]["predicted_n"] == 2, out


def test_n_predict_minus_one_generates_until_the_context_is_full(server) -> None:
    prompt = [1000] * 1010  # the context holds 1024 tokens; the server's own limit (-n) is DEFAULT_MAX
    code, _, default = post(server, "/v1/completions", {"prompt": prompt, "temperature": 0})
    assert code == 200 and default["usage"]["completion_tokens"] == DEFAULT_MAX, default
    code, _, out = post(server, "/v1/completions", {"prompt": prompt, "temperature": 0, "n_predict": -1})
    assert code == 200, out
    assert out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] == 1024, out["usage"]


@pytest.mark.parametrize("fields", [{"n_predict": 4, "max_tokens": 5}, {"n_predict": -1, "max_tokens": 8},
                                    {"n_predict": 4, "max_completion_tokens": 3}, {"n_predict": 0},
                                    {"n_predict": -2}, {"n_predict": "many"}])
def test_a_bad_or_contradicted_n_predict_is_a_400(server, fields) -> None:
    code, _, out = post(server, "/v1/chat/completions", {"messages": QUESTION, **fields})
    assert code == 400 and out["error"]["param"] == "n_predict", out


# --- one model answers to any name ---------------------------------------------------------------------------------------

def test_the_served_model_answers_to_any_name_and_reports_its_own(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [ALIAS]
    for name in ("target.gguf", "gpt-4o", "SmolLM2-135M-Instruct.Q4_1.gguf", ""):
        code, _, out = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "model": name})
        assert code == 200 and out["model"] == ALIAS, out
    r = client.chat.completions.create(model="target.gguf", messages=QUESTION, max_tokens=2)
    assert r.model == ALIAS and r.choices[0].message.content
    chunks = list(client.completions.create(model="llama", prompt="Hi", max_tokens=2, stream=True))
    assert chunks and all(c.model == ALIAS for c in chunks)


def test_the_banner_names_the_models_and_the_method(smollm2_path) -> None:
    s = Server("-m", str(smollm2_path), "-d", str(smollm2_path), "-c", "512")
    try:
        banner = next(line for line in s.log_lines if "serving" in line)
    finally:
        s.stop()
    name = smollm2_path.name
    assert f"({name} + {name}, method auto)" in banner and "Method(" not in banner, banner


# --- the request log ------------------------------------------------------------------------------------------------------

def test_each_request_is_one_line_of_the_servers_log(server) -> None:
    since = len(server.log())
    code, _, out = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 5, "temperature": 0})
    assert code == 200
    # its line gives its usage (an earlier request's line may come after `since`: each is written once its response
    # has gone)
    usage = out["usage"]
    server.wait_for_log(rf"ggufspec: POST /v1/chat/completions 200: prompt {usage['prompt_tokens']} tokens "
                        rf"\(\d+ cached\), {usage['completion_tokens']} generated at [\d.]+ tok/s, \d+ ms\n", since)
    code, _, _ = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True, "logprobs": 0})
    assert code == 200
    server.wait_for_log(r"POST /v1/completions 200: prompt \d+ tokens \(\d+ cached\), 3 generated at [\d.]+ tok/s, "
                        r"\d+ ms\n", since)
    assert post(server, "/v1/chat/completions", {"messages": QUESTION, "n": 2})[0] == 400
    server.wait_for_log(r"POST /v1/chat/completions 400: unsupported_parameter \(n\), \d+ ms\n", since)
    assert server.request("GET", "/v1/nothing")[0] == 404
    server.wait_for_log(r"GET /v1/nothing 404: not_found, \d+ ms\n", since)
    assert server.request("POST", "/v1/completions", "{", headers={"Origin": "http://evil.example"})[0] == 403
    server.wait_for_log(r"POST /v1/completions 403: origin_not_allowed, \d+ ms\n", since)
    for _ in range(3):
        assert server.request("GET", "/health")[0] == 200 and server.request("GET", "/slots")[0] == 200
    assert server.request("GET", "/v1/models")[0] == 200
    server.wait_for_log(r"GET /v1/models 200: \d+ ms\n", since)
    assert "/health" not in server.log() and "/slots" not in server.log()  # polls are not logged
    requests = [line for line in server.log().splitlines() if re.match(r"ggufspec: (GET|POST) /", line)]
    assert all(len(line) < 160 for line in requests), requests


# --- errors: a 4xx with its reason, or a 500 with an id that the log gives, streaming or not ------------------------------

FAULTY = r"""
import sys

import ggufspec.server.app as app
from ggufspec.decoder import DecoderOptions
from ggufspec.engine import GenerationSettings, SpeculativeEngine
from ggufspec.server import Limits, serve

real_timings = app.timings


def timings(stats):  # a response with 5 tokens fails as it is answered
    if stats.generated_tokens == 5:
        raise RuntimeError("injected response failure")
    return real_timings(stats)


app.timings = timings
with SpeculativeEngine.load(sys.argv[1], options=DecoderOptions(n_ctx=512)) as engine:
    real_steps = engine.steps

    def steps(tokens, settings):  # a request for 3 tokens fails in the engine after its second (the pool runs steps)
        inner = real_steps(tokens, settings)
        try:
            for i, r in enumerate(inner):
                if settings.max_tokens == 3 and i == 2:
                    raise RuntimeError("injected engine failure")
                yield r
        finally:
            inner.close()

    engine.steps = steps
    serve(engine, GenerationSettings(max_tokens=16), "faulty", "127.0.0.1", 0, 2, None,
          Limits(max_body=1 << 20, timeout=60, max_connections=64), lambda line: print(line, file=sys.stderr, flush=True))
"""


@pytest.fixture(scope="module")
def faulty(smollm2_path):
    s = Server(command=[sys.executable, "-c", FAULTY, str(smollm2_path)])
    yield s
    s.stop()


@pytest.mark.parametrize("max_tokens,failure", [(3, "injected engine failure"), (5, "injected response failure")])
def test_a_server_error_is_a_500_with_an_id_that_the_log_gives(faulty, max_tokens, failure) -> None:
    code, headers, out = post(faulty, "/v1/completions", {"prompt": "Hi", "max_tokens": max_tokens, "temperature": 0})
    assert code == 500 and out["error"]["type"] == "server_error", out
    ident = headers["x-request-id"]
    assert ident in out["error"]["message"] and failure not in out["error"]["message"], out  # details in the log only
    faulty.wait_for_log(rf"request {ident} (\(POST /v1/completions\) )?failed: {failure}\nTraceback")
    faulty.wait_for_log(rf"POST /v1/completions 500: internal_error, request {ident}, [^\n]*\d+ ms\n")
    assert faulty.log().count(ident) == 2  # the details once, the request's line once


@pytest.mark.parametrize("max_tokens,failure", [(3, "injected engine failure"), (5, "injected response failure")])
def test_a_stream_that_fails_ends_with_the_error_and_done_and_is_logged(faulty, max_tokens, failure) -> None:
    code, _, events = post(faulty, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": max_tokens,
                                                            "temperature": 0, "stream": True})
    assert code == 200 and events[-1] == "[DONE]", events
    error = events[-2]["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error", events
    ident = re.search(r"request ([0-9a-f]{12})", error["message"]).group(1)
    faulty.wait_for_log(rf"request {ident} failed: {failure}\nTraceback")
    faulty.wait_for_log(rf"POST /v1/chat/completions 200: the stream failed with 500 internal_error, request {ident}, "
                        r"prompt \d+ tokens[^\n]*, \d+ ms\n")
    # and the server goes on
    code, _, out = post(faulty, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert code == 200 and out["usage"]["completion_tokens"] == 2
