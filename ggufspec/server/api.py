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


# --- requests (unknown fields are accepted and ignored, as OpenAI's own server does) -------------------------

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
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None  # negative: random, as llama-server's -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    speculative: Speculative | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None


# Parameters that would change what the model produces, which ggufspec does not implement: refused, not ignored.
UNSUPPORTED: list[tuple[str, Callable[[Any], bool]]] = [
    ("n", lambda r: r.n != 1),
    ("presence_penalty", lambda r: r.presence_penalty != 0),
    ("frequency_penalty", lambda r: r.frequency_penalty != 0),
    ("logit_bias", lambda r: bool(r.logit_bias)),
    ("logprobs", lambda r: bool(r.logprobs)),
    ("tools", lambda r: bool(getattr(r, "tools", None))),
    ("response_format", lambda r: (getattr(r, "response_format", None) or {}).get("type", "text") != "text"),
    ("echo", lambda r: getattr(r, "echo", False)),
    ("suffix", lambda r: getattr(r, "suffix", None) is not None),
]


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
