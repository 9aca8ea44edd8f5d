"""`ggufspec serve`: an OpenAI-compatible HTTP server, a thin layer over `SpeculativeEngine.stream` (FastAPI, uvicorn).

One engine serves one request at a time, in one worker thread; up to `queue` more wait in FIFO order, and past
that a request gets HTTP 429 with Retry-After. A client that goes away (streaming or not) stops its generation at
the next committed token, within one target pass, and frees the engine for the next request. Responses carry
llama-server's `timings` (prompt_n, cache_n, draft_n, draft_n_accepted, ...) plus what speculation did.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from .engine import GenerationResponse, GenerationSettings, Prompt, SpeculativeEngine
from .errors import GGUFSpecError
from .methods import METHODS
from .sampling import SamplingParams
from .stats import Stats

FINISH_REASONS = {"stop": "stop", "max_tokens": "length", "length": "length", "interrupted": "stop"}
RETRY_AFTER_SECONDS = 1


# --- requests (OpenAI's shapes; unknown fields are accepted and ignored, as OpenAI's own server does) ----------

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
    seed: int | None = None
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


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --- the engine's worker ----------------------------------------------------------------------------------

@dataclass(eq=False)
class Job:
    """One request's generation: its events (responses, then an error or nothing) cross to the event loop."""

    prompt: Prompt
    settings: GenerationSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, item: GenerationResponse | Exception | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    """Runs jobs on the engine one at a time, in arrival order; admits at most 1 + `queue` at once."""

    def __init__(self, engine: SpeculativeEngine, queue: int) -> None:
        self.engine = engine
        self.capacity = 1 + queue
        self.active = 0  # admitted and not finished; changed on the event loop only
        self.jobs: set[Job] = set()
        self.running: Job | None = None
        self.n_decoded = 0  # tokens the running (or last) job committed
        self.n_completed = self.n_cancelled = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ggufspec-engine")

    def submit(self, prompt: Prompt, settings: GenerationSettings) -> Job:
        if self.active >= self.capacity:
            raise APIError(429, f"the server is busy: {self.active} requests are running or queued "
                                f"(--queue {self.capacity - 1}); retry later", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        loop = asyncio.get_running_loop()
        job = Job(prompt, settings, loop)
        self.active += 1
        self.jobs.add(job)
        future = loop.run_in_executor(self._executor, self._run, job)
        future.add_done_callback(lambda _: self._done(job))
        return job

    def _done(self, job: Job) -> None:
        self.active -= 1
        self.jobs.discard(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # its client left while it waited
            self.n_cancelled += 1
            job.put(None)
            return
        self.running, self.n_decoded = job, 0
        stream = self.engine.stream(job.prompt, job.settings)
        try:
            for r in stream:
                job.put(r)
                self.n_decoded += r.token is not None
                if job.cancelled.is_set():
                    self.n_cancelled += r.finish_reason is None
                    break
                self.n_completed += r.finish_reason is not None
        except Exception as e:  # GGUFSpecError: the request's fault; anything else is answered as a server error
            job.put(e)
        finally:
            stream.close()
            self.running = None
        job.put(None)

    def shutdown(self) -> None:
        """Stop every job (the running one at its next token) and wait for the worker thread."""
        for job in list(self.jobs):
            job.cancelled.set()
        self._executor.shutdown(wait=True)


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


# --- the app -----------------------------------------------------------------------------------------------

def create_app(engine: SpeculativeEngine, settings: GenerationSettings, model_id: str, queue: int = 16,
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; `settings` are the defaults each request may override."""
    app = FastAPI(title="ggufspec", docs_url=None, redoc_url=None)
    worker = Worker(engine, queue)
    app.state.worker = worker
    created = int(time.time())
    names = {model_id, engine.target.path.name, engine.target.path.stem, str(engine.target.path)}

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error ({type(e).__name__})", kind="server_error").response()

    def authorized(request: Request) -> None:
        """With --api-key, /v1 wants `Authorization: Bearer KEY` (/health stays open, as in llama-server)."""
        given = request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key: send Authorization: Bearer KEY", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/slots", dependencies=[Depends(authorized)])
    async def slots() -> list[dict[str, Any]]:
        """The one engine's state, after llama-server's /slots; plus the queue and what became of past requests."""
        return [{"id": 0, "is_processing": worker.running is not None, "n_decoded": worker.n_decoded,
                 "n_queued": max(0, worker.active - 1), "n_completed": worker.n_completed,
                 "n_cancelled": worker.n_cancelled}]

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "ggufspec",
                                            "meta": {"target": str(engine.target.path), "n_ctx": engine.n_ctx,
                                                     "draft": str(engine.draft.path) if engine.draft else None,
                                                     "medusa": engine.medusa is not None}}]}

    def request_settings(body: CommonRequest, max_tokens: int | None) -> GenerationSettings:
        if body.model not in (None, "") and body.model not in names:
            raise APIError(404, f"the model {body.model!r} does not exist: this server serves {model_id!r}",
                           param="model", code="model_not_found")
        for name, refused in UNSUPPORTED:
            if refused(body):
                raise APIError(400, f"{name}: not supported by ggufspec (it would change the output, and ggufspec "
                                    "does not implement it)", param=name, code="unsupported_parameter")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > 16:
            raise APIError(400, "stop: at most 16 stop strings", param="stop")
        d, sp = settings, settings.sampling
        spec = body.speculative or Speculative()
        try:
            sampling = SamplingParams(
                temperature=sp.temperature if body.temperature is None else body.temperature,
                top_k=sp.top_k if body.top_k is None else body.top_k,
                top_p=sp.top_p if body.top_p is None else body.top_p,
                min_p=sp.min_p if body.min_p is None else body.min_p,
            )
            s = replace(d, max_tokens=max_tokens or d.max_tokens, sampling=sampling,
                        seed=d.seed if body.seed is None else body.seed, stop=tuple(stops),
                        method=spec.method or d.method, draft_max=spec.draft_max or d.draft_max,
                        draft_p_min=d.draft_p_min if spec.draft_p_min is None else spec.draft_p_min)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        try:
            engine.method_for(s)
        except GGUFSpecError as e:
            raise APIError(400, str(e), param="speculative") from None
        return s

    async def start(prompt: Prompt, s: GenerationSettings) -> tuple[Job, int]:
        try:
            tokens = await asyncio.to_thread(engine.encode, prompt)
        except GGUFSpecError as e:
            raise APIError(400, str(e)) from None
        if len(tokens) >= engine.n_ctx:
            raise APIError(400, f"the prompt has {len(tokens)} tokens and the context holds {engine.n_ctx}: "
                                "shorten it, or start the server with a larger --n-ctx", param="messages",
                           code="context_length_exceeded")
        return worker.submit(tokens, s), len(tokens)

    async def respond(request: Request, shape: Shape, body: CommonRequest, prompt: Prompt, max_tokens: int | None):
        s = request_settings(body, max_tokens)
        job, _ = await start(prompt, s)
        ident = f"{shape.prefix}-{uuid.uuid4().hex[:24]}"
        head = {"id": ident, "created": int(time.time()), "model": model_id}
        if body.stream:
            usage_chunk = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(sse(job, shape, head, usage_chunk), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = await collect(job, request)
        if final is None:  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        result = final.result
        return {**head, "object": shape.object,
                "choices": [shape.choice(result.text, FINISH_REASONS[result.stop_reason], delta=False)],
                "usage": usage(result.stats), "timings": timings(result.stats)}

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        messages = [m.as_message() for m in body.messages]
        return await respond(request, CHAT, body, messages, body.max_completion_tokens or body.max_tokens)

    @v1.post("/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of several is not supported)", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt: empty", param="prompt")
        return await respond(request, TEXT, body, prompt, body.max_tokens)

    app.include_router(v1)
    return app


async def collect(job: Job, request: Request) -> GenerationResponse | None:
    """Wait for the job's final response; None when the client disconnects first (the job is cancelled)."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return None
                continue
            if isinstance(item, Exception):
                raise as_api_error(item)
            if item is None:
                raise APIError(500, "the generation ended without a result", kind="server_error")
            if item.finish_reason is not None:
                return item
    finally:
        job.cancelled.set()  # no-op after the end; stops the job if this handler was cancelled


async def parse(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as `model` (whatever the Content-Type, as llama-server), or a 400 naming the first problem."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request needs a JSON body")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def as_api_error(e: Exception) -> APIError:
    if isinstance(e, GGUFSpecError):
        return APIError(400, str(e))
    return APIError(500, f"internal error ({type(e).__name__})", kind="server_error")


async def sse(job: Job, shape: Shape, head: dict[str, Any], usage_chunk: bool) -> AsyncIterator[str]:
    """Server-sent events: chunks, the final chunk with finish_reason and timings, usage if asked, [DONE]. Starlette
    cancels this generator when the client disconnects; `finally` then stops the job."""

    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return event({**head, "object": shape.chunk_object, "choices": choices, **extra})

    try:
        if shape is CHAT:
            yield chunk([shape.choice(None, None, delta=True, first=True)])
        while True:
            item = await job.events.get()
            if isinstance(item, Exception):
                e = as_api_error(item)
                yield event({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
                break
            if item is None:
                break
            if item.text:
                yield chunk([shape.choice(item.text, None, delta=True)])
            if item.finish_reason is not None:
                stats = item.result.stats
                yield chunk([shape.choice(None, FINISH_REASONS[item.finish_reason], delta=True)], timings=timings(stats))
                if usage_chunk:
                    yield chunk([], usage=usage(stats))
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def serve(engine: SpeculativeEngine, settings: GenerationSettings, model_id: str, host: str, port: int, queue: int,
          api_key: str | None, announce: Callable[[str], None]) -> None:
    """Run the server until Ctrl-C / SIGTERM; then stop generation and free the engine's worker."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise GGUFSpecError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    app = create_app(engine, settings, model_id, queue, api_key)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    announce(f"ggufspec: serving {model_id} on http://{host}:{port}/v1 (method {engine.method_for(settings)}); "
             "Ctrl-C stops")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.worker.shutdown()
        sock.close()
