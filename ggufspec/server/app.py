"""The FastAPI app: OpenAI's endpoints as a thin layer over the engine's worker, behind the boundary's checks."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive

from ..engine import GenerationResponse, GenerationSettings, Prompt
from ..errors import Cancelled, ContextLengthError, GGUFSpecError, RPCError
from ..sampling import DistributionError, SamplingParams
from .api import (CHAT, FINISH_REASONS, TEXT, APIError, ChatRequest, CommonRequest, CompletionRequest, Shape,
                  Speculative, refused_field, timings, usage)
from .boundary import Boundary, Limits, note_of, read_json, server_error
from .worker import STALL_SECONDS, Admitted, Job, Worker


def create_app(worker: Worker, settings: GenerationSettings, model_id: str, limits: Limits,
               api_key: str | None = None) -> Boundary:
    """The ASGI app serving the worker's engine pool, behind the boundary (and CORS when origins are allowed);
    `settings` are the defaults each request may override."""
    app = FastAPI(title="ggufspec", docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    key = _Key(api_key)
    _open_routes(app, worker, key)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(key.authorized)])
    _v1_routes(v1, _Requests(worker, settings, model_id), limits)
    app.include_router(v1)
    inner = app if not limits.cors_origins else CORSMiddleware(
        app, allow_origins=list(limits.cors_origins), allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type"])
    return Boundary(inner, limits)


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours as they are, HTTP's (404, 405) named, anything else a 500 with a request
    id, logged once."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        note_of(request.scope)["error"] = e
        return e.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        """What no handler expected: a 500 in OpenAI's shape with a request id, logged once (Starlette raises the
        exception again after this answer: the boundary sees that it is logged)."""
        note_of(request.scope)["logged"] = e
        return await _api_error(request, server_error(e, f"{request.method} {request.url.path}"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await _api_error(request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                  code=code))


class _Key:
    """--api-key: what /v1, /slots and /openapi.json want; /health stays open, as in llama-server."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key

    def given(self, request: Request) -> bool:
        """No --api-key, or the request sends `Authorization: Bearer KEY` (the scheme in any case, RFC 9110)."""
        if not self.api_key:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())

    def authorized(self, request: Request) -> None:
        """A dependency: 401 without the key."""
        if not self.given(request):
            raise APIError(401, "invalid or missing API key: send Authorization: Bearer KEY", code="invalid_api_key")


def _open_routes(app: FastAPI, worker: Worker, key: _Key) -> None:
    """/health (open), /openapi.json and /slots (with the key)."""

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        failure = worker.remote_failure()
        if failure is not None:
            # the details (the servers' addresses, llama.cpp's words) are for clients with the key: /health is open
            if not key.given(request):
                failure = "the model's RPC servers are unavailable; reconnecting as soon as they answer again"
            return JSONResponse({"status": "error", "error": failure}, status_code=503)
        stalled = worker.stalled_for()
        if stalled > STALL_SECONDS:
            return JSONResponse({"status": "error", "error": f"the engine has made no progress for {stalled:.0f} s"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/openapi.json", dependencies=[Depends(key.authorized)], include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/slots", dependencies=[Depends(key.authorized)])
    async def slots() -> list[dict[str, Any]]:
        """One entry per slot (--parallel), after llama-server's /slots: id, n_ctx, is_processing, state (idle,
        prompt: rendering and tokenizing, generating), the tokens of its current or last request (n_prompt_tokens,
        n_decoded, n_drafts_kept); and in each, the server's queue and what became of past requests."""
        shared = {"n_queued": worker.n_queued, "n_completed": worker.n_completed, "n_cancelled": worker.n_cancelled}
        return [{**entry, **shared} for entry in worker.slots()]


def _v1_routes(v1: APIRouter, requests: _Requests, limits: Limits) -> None:
    """/v1/models, /v1/chat/completions and /v1/completions."""

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return requests.models()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = parse(await read_json(request, limits.max_body), ChatRequest)
        messages = [m.as_message() for m in body.messages]
        return await requests.respond(request, CHAT, body, messages, "messages")

    @v1.post("/completions")
    async def completions(request: Request):
        body = parse(await read_json(request, limits.max_body), CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of several is not supported)", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt: empty", param="prompt")
        return await requests.respond(request, TEXT, body, prompt, "prompt")


class _Requests:
    """A request's settings and answer: the worker's engine pool generates, with `settings` as the defaults each
    request may override. `engine` is slot 0's, for what the slots share (n_ctx is a slot's: the longest prompt plus
    answer)."""

    def __init__(self, worker: Worker, settings: GenerationSettings, model_id: str) -> None:
        self.worker, self.settings, self.model_id = worker, settings, model_id
        self.engine = worker.engine
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        """/v1/models: the one model, under its id, with what it runs."""
        e = self.engine
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "ggufspec",
                                            "meta": {"target": str(e.target.path), "n_ctx": e.n_ctx,
                                                     "parallel": self.worker.parallel,
                                                     "draft": str(e.draft.path) if e.draft else None,
                                                     "medusa": e.medusa is not None}}]}

    def token_limit(self, body: CommonRequest) -> int | None:
        """The request's max_tokens (max_completion_tokens, or llama-server's n_predict, -1 to the end of the
        context); None: the server's."""
        given = {name: value for name in ("max_completion_tokens", "max_tokens")
                 if (value := getattr(body, name, None)) is not None}
        if body.n_predict is None:
            return next(iter(given.values()), None)
        if body.n_predict == 0:
            raise APIError(400, "n_predict: 0 is not supported (ggufspec generates at least one token; -1: until "
                                "the context is full)", param="n_predict")
        for name, value in given.items():
            if value != body.n_predict:
                raise APIError(400, f"n_predict ({body.n_predict}) and {name} ({value}) disagree: send one of them",
                               param="n_predict")
        return self.engine.n_ctx if body.n_predict == -1 else body.n_predict

    def settings_of(self, body: CommonRequest) -> GenerationSettings:
        """The request's GenerationSettings: its fields over the server's; 400 for a refused field, a bad value or a
        method this engine cannot run. `model` is not checked: the one model answers to any name, as llama-server."""
        refused = refused_field(body.model_extra or {})
        if refused is not None:
            name, why = refused
            shown = json.dumps((body.model_extra or {})[name], ensure_ascii=False)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise APIError(400, f"{name}: {shown} is not supported by ggufspec ({why}); it would change the output, "
                                "so it is refused rather than ignored", param=name, code="unsupported_parameter")
        max_tokens = self.token_limit(body)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > 16:
            raise APIError(400, "stop: at most 16 stop strings", param="stop")
        d, sp = self.settings, self.settings.sampling
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
                        ignore_eos=d.ignore_eos if body.ignore_eos is None else body.ignore_eos,
                        draft_p_min=d.draft_p_min if spec.draft_p_min is None else spec.draft_p_min)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        try:
            self.engine.method_for(s)
        except GGUFSpecError as e:
            raise APIError(400, str(e), param="speculative") from None
        return s

    async def respond(self, request: Request, shape: Shape, body: CommonRequest, prompt: Prompt, param: str):
        """The request's job: queued, admitted (its prompt fits) or refused, then answered as one object or a stream;
        a client that leaves cancels it (499)."""
        note = note_of(request.scope)
        job = self.worker.submit(prompt, self.settings_of(body))
        watch = asyncio.create_task(_cancel_on_disconnect(request.receive, job, self.worker))
        streaming = False
        try:
            first = await job.events.get()  # the prompt rendered, tokenized and found to fit, or why not
            if first is None:  # the client left while the job waited or rendered
                note["left"] = True
                return JSONResponse({}, status_code=499)
            if isinstance(first, Exception):
                raise as_api_error(first, param)
            assert isinstance(first, Admitted)
            note["prompt_tokens"] = first.prompt_tokens
            head = {"id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.model_id}
            if body.stream:
                streaming = True  # the watch goes on until the stream has ended, or never started: `sse` stops it
                usage_chunk = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(sse(job, shape, head, usage_chunk, watch, note),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self._answer(job, shape, head, note, param)
        finally:
            if not streaming:
                watch.cancel()
                job.cancelled.set()  # no-op after the end; stops the job if this handler was cancelled

    @staticmethod
    async def _answer(job: Job, shape: Shape, head: dict[str, Any], note: dict[str, Any], param: str):
        """A request answered as one object, once its job has finished; 499 where its client left."""
        final = await collect(job, param)
        if final is None:  # the client left; nobody reads this
            note["left"] = True
            return JSONResponse({}, status_code=499)
        result = final.result
        note["stats"] = result.stats
        return {**head, "object": shape.object,
                "choices": [shape.choice(result.text, FINISH_REASONS[result.stop_reason], delta=False)],
                "usage": usage(result.stats), "timings": timings(result.stats)}


def parse(data: Any, model: type[BaseModel]) -> Any:
    """The parsed JSON body as `model`, or a 400 naming the first problem."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


async def _cancel_on_disconnect(receive: Receive, job: Job, worker: Worker) -> None:
    """Cancel `job` the moment its client disconnects (the body is read: the next message is the disconnect); a
    job still queued leaves the queue then, so its place is free and its 499 logged at once."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
    worker.abandon(job)


async def collect(job: Job, param: str) -> GenerationResponse | None:
    """The job's final response; None when it ended without one (its client left)."""
    while True:
        item = await job.events.get()
        if item is None:
            return None
        if isinstance(item, Exception):
            raise as_api_error(item, param)
        if isinstance(item, GenerationResponse) and item.finish_reason is not None:
            return item


def as_api_error(e: Exception, param: str | None = None) -> APIError:
    """What a job's error is answered with: the request's fault (4xx), or a server error with an id, logged once."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, Cancelled):
        return APIError(499, str(e))
    if isinstance(e, RPCError):  # not the request's fault: the server's RPC servers failed (/health says so)
        return APIError(503, str(e), code="rpc_server_unavailable", kind="server_error",
                        headers={"Retry-After": "5"})
    if isinstance(e, GGUFSpecError) and not isinstance(e, DistributionError):  # that one is the model's fault
        return APIError(400, str(e), param=param)
    return server_error(e)


async def sse(job: Job, shape: Shape, head: dict[str, Any], usage_chunk: bool, watch: asyncio.Task,
              note: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events: chunks, the final chunk with finish_reason and timings, usage if asked, [DONE]. An error
    (the job's, or this generator's own) ends the stream with OpenAI's error object and [DONE]: a 4xx's reason, or
    a 500's request id, logged once. Starlette cancels this generator when the client disconnects; `finally` then
    stops the job. `watch` cancels the job on a disconnect until then (even one before this generator starts), and
    is stopped at the end. `note` gets what the request log reports: the stats, the error, or that the client
    left."""

    def event(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return event({**head, "object": shape.chunk_object, "choices": choices, **extra})

    try:
        try:
            if shape is CHAT:
                yield chunk([shape.choice(None, None, delta=True, first=True)])
            while True:
                item = await job.events.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    break
                if item.text:
                    yield chunk([shape.choice(item.text, None, delta=True)])
                if item.finish_reason is not None:
                    stats = note["stats"] = item.result.stats
                    yield chunk([shape.choice(None, FINISH_REASONS[item.finish_reason], delta=True)],
                                timings=timings(stats))
                    if usage_chunk:
                        yield chunk([], usage=usage(stats))
                    break
        except Exception as e:  # the headers are sent: the error goes in the stream
            error = note["error"] = as_api_error(e)
            yield event(error.body())
        yield "data: [DONE]\n\n"
    finally:
        if "stats" not in note and "error" not in note:
            note["left"] = True
        watch.cancel()
        job.cancelled.set()
