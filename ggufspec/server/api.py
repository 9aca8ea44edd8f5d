"""OpenAI's shapes: the request bodies ggufspec accepts, its error object, and the objects it answers with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..methods import METHODS
from ..stats import Stats

# A generation cut short by the server's shutdown ends as an answer cut by a length limit does: incomplete.
FINISH_REASONS = {"stop": "stop", "max_tokens": "length", "length": "length", "interrupted": "length"}


# --- requests (unknown fields are accepted and ignored, as OpenAI's own server does; see REFUSED) ---------

class Speculative(BaseModel):
    """ggufspec's extra body field: how this request speculates."""

    model_config = ConfigDict(extra="forbid")
    method: Literal[tuple(METHODS)] | None = None  # type: ignore[valid-type]
    draft_max: int | None = Field(None, ge=1, le=64)
    draft_p_min: float | None = Field(None, ge=0, le=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None  # any name: the server answers with its one model, as llama-server does
    max_tokens: int | None = Field(None, ge=1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's max_tokens; -1: until the context is full
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None  # negative: random, as llama-server's -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # llama-server's: never pick an end-of-generation token (None: the server's)
    speculative: Speculative | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str]


# --- fields that would change the output, which ggufspec does not implement: refused, not ignored ---------------
#
# Each maps to (harmless, why): `harmless(value, fields)` is true when the value changes nothing (the field's off
# value, or a value that only matters when another field turns its sampler on, which that field's own entry
# refuses); `why` ends the 400's message. Fields not named here and not implemented are accepted and ignored
# (clients send all sorts of things: `user`, `store`, `cache_prompt`, ...).

Harmless = Callable[[Any, dict[str, Any]], bool]


def _default(*values: Any) -> Harmless:
    """Harmless when absent (null) or equal to one of `values`."""
    return lambda v, fields: v is None or v in values


_OFF = _default(0, "", [], {})  # also false, 0.0


def _at_least(bound: float) -> Harmless:
    """Harmless when null or a number >= `bound` (llama.cpp's typical_p and tfs_z do nothing from 1 up)."""
    return lambda v, fields: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= bound)


def _no_bias(v: Any, fields: dict[str, Any]) -> bool:
    """logit_bias that biases nothing: off (null, empty, false), or every bias 0, in OpenAI's shape {"token": bias}
    or llama-server's [[token, bias], ...] (where a bias `false` bans the token: not 0)."""
    if _OFF(v, fields):
        return True
    if isinstance(v, dict):
        biases = list(v.values())
    elif isinstance(v, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in v):
        biases = [pair[1] for pair in v]
    else:
        return False
    return all(isinstance(b, (int, float)) and not isinstance(b, bool) and b == 0 for b in biases)


def _unused_unless(*governing: str) -> Harmless:
    """A parameter of a sampler that the `governing` fields turn on: harmless while they leave it off."""
    return lambda v, fields: all(REFUSED[g][0](fields.get(g), fields) for g in governing)


PENALTIES = ("repeat_penalty", "presence_penalty", "frequency_penalty", "repetition_penalty")

# llama.cpp's sampler names (arrays; its alternative names too) and letters (a string); ggufspec's own order; the
# samplers that do nothing while the fields above are refused unless off.
_SAMPLER_NAMES = {"top_k": "top_k", "top-k": "top_k", "k": "top_k", "top_p": "top_p", "top-p": "top_p",
                  "nucleus": "top_p", "p": "top_p", "min_p": "min_p", "min-p": "min_p", "m": "min_p",
                  "temperature": "temperature", "temp": "temperature", "t": "temperature",
                  "dry": "dry", "d": "dry", "typ_p": "typ_p", "typ-p": "typ_p", "typical_p": "typ_p",
                  "typical-p": "typ_p", "typical": "typ_p", "typ": "typ_p", "y": "typ_p", "xtc": "xtc", "x": "xtc",
                  "penalties": "penalties", "e": "penalties", "top_n_sigma": "top_n_sigma",
                  "top-n-sigma": "top_n_sigma", "s": "top_n_sigma"}
SAMPLER_ORDER = ["temperature", "top_k", "top_p", "min_p"]  # as sampling.probabilities applies them
_IDLE_SAMPLERS = {"dry", "typ_p", "xtc", "penalties", "top_n_sigma"}


def _samplers(v: Any, fields: dict[str, Any]) -> bool:
    """llama-server's sampler chain: harmless when it is ggufspec's (the idle samplers anywhere in it)."""
    if v is None:
        return True
    if isinstance(v, str):
        names = [_SAMPLER_NAMES.get(c) for c in v]
    elif isinstance(v, list) and all(isinstance(x, str) for x in v):
        names = [_SAMPLER_NAMES.get(x.lower()) for x in v]
    else:
        return False
    return [n for n in names if n not in _IDLE_SAMPLERS] == SAMPLER_ORDER


NOT_PENALTIES = "penalties are not implemented"
REFUSED: dict[str, tuple[Harmless, str]] = {
    # OpenAI
    "n": (_default(1), "one choice per request"),
    "best_of": (_default(1), "one choice per request"),
    "presence_penalty": (_default(0), NOT_PENALTIES),
    "frequency_penalty": (_default(0), NOT_PENALTIES),
    "logit_bias": (_no_bias, "logit biases are not implemented"),
    "logprobs": (_OFF, "log-probabilities are not implemented"),
    "top_logprobs": (_OFF, "log-probabilities are not implemented"),
    "tools": (_OFF, "tool calls are not implemented"),
    "tool_choice": (_default("none", "auto"), "tool calls are not implemented"),
    "functions": (_OFF, "tool calls are not implemented"),
    "function_call": (_default("none", "auto"), "tool calls are not implemented"),
    "response_format": (lambda v, f: v in (None, {}, {"type": "text"}), "JSON mode and schemas are not implemented"),
    "modalities": (lambda v, f: v in (None, [], ["text"]), "ggufspec answers with text only"),
    "audio": (_OFF, "ggufspec answers with text only"),
    "echo": (_OFF, "the prompt is not echoed"),
    "suffix": (_OFF, "insertion (a suffix) is not implemented"),
    # llama-server
    "grammar": (_OFF, "grammars are not implemented"),
    "json_schema": (_OFF, "JSON schemas are not implemented"),
    "repeat_penalty": (_default(1), NOT_PENALTIES),
    "repeat_last_n": (_unused_unless(*PENALTIES), NOT_PENALTIES),
    "penalize_nl": (_unused_unless(*PENALTIES), NOT_PENALTIES),
    "mirostat": (_default(0), "mirostat is not implemented"),
    "mirostat_tau": (_unused_unless("mirostat"), "mirostat is not implemented"),
    "mirostat_eta": (_unused_unless("mirostat"), "mirostat is not implemented"),
    "typical_p": (_at_least(1), "typical sampling is not implemented"),
    "tfs_z": (_at_least(1), "tail-free sampling is not implemented"),
    "top_n_sigma": (lambda v, f: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0),
                    "top-n-sigma sampling is not implemented"),
    "min_keep": (_default(0), "top_k, top_p and min_p keep at least one token"),
    "dynatemp_range": (_default(0), "dynamic temperature is not implemented"),
    "dynatemp_exponent": (_unused_unless("dynatemp_range"), "dynamic temperature is not implemented"),
    "dry_multiplier": (_default(0), "DRY is not implemented"),
    **{f"dry_{name}": (_unused_unless("dry_multiplier"), "DRY is not implemented")
       for name in ("base", "allowed_length", "penalty_last_n", "sequence_breakers")},
    "xtc_probability": (_default(0), "XTC is not implemented"),
    "xtc_threshold": (_unused_unless("xtc_probability"), "XTC is not implemented"),
    "samplers": (_samplers, f"ggufspec samples with {', '.join(SAMPLER_ORDER)}, in that order"),
    "n_probs": (_OFF, "probabilities are not implemented"),
    "n_keep": (_OFF, "the tokens a context shift keeps are not chosen per request"),
    "t_max_predict_ms": (_OFF, "time limits are not implemented"),
    "lora": (_OFF, "LoRA adapters are not implemented"),
    "image_data": (_OFF, "images are not implemented"),
    "chat_template_kwargs": (_OFF, "the chat template takes no extra arguments"),
    # vLLM's names that clients send
    "repetition_penalty": (_default(1), NOT_PENALTIES),
    "min_tokens": (_OFF, "min_tokens is not implemented"),
    "stop_token_ids": (_OFF, "stop_token_ids is not implemented"),
    **{f"guided_{name}": (_OFF, "guided decoding is not implemented")
       for name in ("json", "regex", "choice", "grammar")},
}


def refused_field(fields: dict[str, Any]) -> tuple[str, str] | None:
    """The first field of `fields` (a request's undeclared ones) that ggufspec refuses, with why; None if none."""
    for name, (harmless, why) in REFUSED.items():  # in the table's order: a sampler's switch before its parameters
        if name in fields and not harmless(fields[name], fields):
            return name, why
    return None


# --- errors ------------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --- responses ---------------------------------------------------------------------------------------------

def timings(s: Stats) -> dict[str, Any]:
    """llama-server's `timings` names where they exist, then what speculation did."""
    prompt_ms, predicted_ms = s.prefill_seconds * 1e3, s.generation_seconds * 1e3
    return {
        "prompt_n": s.prefill_tokens, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / s.prefill_tokens if s.prefill_tokens else 0.0,
        "prompt_per_second": s.prefill_tps, "cache_n": s.cached_tokens,
        "predicted_n": s.generated_tokens, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / s.generated_tokens if s.generated_tokens else 0.0,
        "predicted_per_second": s.generation_tps,
        "draft_n": s.drafted, "draft_n_accepted": s.accepted,
        "method": s.method, "target_passes": s.target_passes, "tokens_per_pass": s.mean_accepted_length,
        **({"rpc_round_trip_ms": s.rpc_round_trip_ms} if s.rpc_round_trip_ms else {}),
    }


def usage(s: Stats) -> dict[str, Any]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


@dataclass
class Shape:
    """How one endpoint spells its objects: chat completions or text completions."""

    prefix: str
    object: str
    chunk_object: str

    def choice(self, text: str | None, finish: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
        if self.object == "text_completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}


CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk")
TEXT = Shape("cmpl", "text_completion", "text_completion")
