"""The FastAPI app: routes, authentication, error responses, and the bridge from a request to its worker job.

Every request is a `gen.stream(...)` call run by the worker thread: a client that goes away is noticed between
tokens, its job is cancelled and the worker moves on. /health and /metrics never wait for the worker.
"""

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from swiftdecode.server import protocol
from swiftdecode.server.metrics import Metrics
from swiftdecode.server.protocol import ApiError, check, take
from swiftdecode.server.worker import DEFAULT_KV_GB, DEFAULT_MAX_BATCH, DEFAULT_TIMEOUT_S, END, Job, Worker

if TYPE_CHECKING:
    from swiftdecode.engine import Generator

log = logging.getLogger(__name__)

MAX_BODY = 16 * 2**20  # bytes
POLL_S = 0.25  # while waiting for a job's next event, how often to check that the client is still there
CLIENT_GONE = 499  # nginx's status for a request the client abandoned (nobody is left to read it)
KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


@dataclass(frozen=True)
class Limits:
    """The serving limits (see `swiftdecode serve --help`)."""

    max_queue: int = 64
    max_batch: int = DEFAULT_MAX_BATCH
    timeout_s: float = DEFAULT_TIMEOUT_S
    kv_gb: float = DEFAULT_KV_GB
    api_key: str | None = None


def create_app(
    gen: "Generator",
    model_id: str,
    *,
    max_queue: int = 64,
    max_batch: int = DEFAULT_MAX_BATCH,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kv_gb: float = DEFAULT_KV_GB,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `gen` as model `model_id`; the worker thread stops on app shutdown."""
    api = Api(gen, model_id, Limits(max_queue, max_batch, timeout_s, kv_gb, api_key))
    app = FastAPI(title="swiftdecode", lifespan=api.lifespan)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, crash)
    app.add_middleware(StatusCounter, metrics=api.metrics)
    app.get("/health")(api.health)
    app.get("/metrics")(api.prometheus)
    app.get("/v1/models")(api.list_models)
    app.get("/v1/models/{name:path}")(api.get_model)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


# ---------------------------------------------------------------- errors and status counting


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    return error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))


async def crash(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(ApiError(500, f"internal server error: {type(e).__name__}"))


class StatusCounter:
    """Pure ASGI middleware counting responses by (path, status) for /metrics; unknown paths count as "other"."""

    def __init__(self, app: Callable, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(scope["path"] if scope["path"] in KNOWN_PATHS else "other", message["status"])
            await send(message)

        await self.app(scope, receive, send_counted if scope["type"] == "http" else send)


# ---------------------------------------------------------------- routes


class Disconnected(Exception):
    """The client went away while we waited for its job."""


class Api:
    """The route handlers over one Generator: its worker (started by `lifespan`), metrics and limits."""

    def __init__(self, gen: "Generator", model_id: str, limits: Limits):
        self.gen, self.model_id, self.limits = gen, model_id, limits
        self.metrics = Metrics()
        self.worker: Worker | None = None
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        lim = self.limits
        self.worker = Worker(self.gen, lim.max_queue, self.metrics, lim.max_batch, lim.timeout_s, lim.kv_gb)
        yield
        await asyncio.to_thread(self.worker.close)

    async def health(self) -> dict:
        queued, running, *_ = self.worker.depth()
        return {"status": "ok", "model": self.model_id, "queued": queued, "running": running}

    async def prometheus(self) -> PlainTextResponse:
        text = self.metrics.render(*self.worker.depth(), model=self.model_id, method=self.gen.method)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def list_models(self, request: Request) -> dict:
        self.authorize(request)
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, name: str, request: Request) -> dict:
        self.authorize(request)
        if name != self.model_id:
            raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")
        return self.model_card()

    async def completions(self, request: Request) -> Any:
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Any:
        return await self.complete(request, chat=True)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "swiftdecode"}

    def authorize(self, request: Request) -> None:
        key = self.limits.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                401, "invalid or missing API key (send 'Authorization: Bearer KEY')", None, "invalid_api_key"
            )

    async def read_request(self, request: Request) -> dict:
        """The authorized request's JSON body (at most MAX_BODY bytes), naming the served model."""
        self.authorize(request)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"request body exceeds {MAX_BODY // 2**20} MiB")
        body = protocol.parse_body(bytes(raw))
        model = take(body, "model", "str")
        check(model is not None, "missing required field 'model'", "model")
        if model != self.model_id:
            message = f"The model '{model}' does not exist; this server serves '{self.model_id}'"
            raise ApiError(404, message, "model", "model_not_found")
        return body

    async def complete(self, request: Request, chat: bool) -> Any:
        """/v1/completions and /v1/chat/completions: the whole response, or its stream of chunks."""
        body = await self.read_request(request)
        prompt = protocol.parse_messages(body) if chat else protocol.parse_prompt(body)
        params = protocol.parse_sampling(body, chat)
        stream = take(body, "stream", "bool", False)
        include_usage = take(take(body, "stream_options", "dict", {}), "include_usage", "bool", False)
        head = protocol.response_head(chat, self.model_id)
        events = self.run_job(request, Job(prompt, chat, params, asyncio.get_running_loop()))
        try:
            first = await anext(events)  # surfaces queue/parameter errors as a proper HTTP status
            if stream:
                text_of = self.token_text if params["logprobs"] is not None else None
                head = protocol.chunk_head(head, chat)
                sse = sse_chunks(head, chat, include_usage, params["stop"], first, events, text_of)
                return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            res = first.result
            async for ev in events:
                res = ev.result
        except Disconnected:
            return PlainTextResponse("", status_code=CLIENT_GONE)
        return protocol.completion(head, chat, res, self.token_text)

    def token_text(self, token: int) -> str:
        """A token's text, as a response's logprobs show it."""
        return self.gen.prompts.decode([token])

    async def run_job(self, request: Request, job: Job) -> AsyncIterator[Any]:
        """Queue the job and yield its engine events; cancels the job if the client leaves or we stop early."""
        self.worker.submit(job)
        try:
            while (item := await next_event(job, request)) is not END:
                if isinstance(item, ApiError):
                    raise item
                yield item
        finally:
            self.worker.cancel(job)


async def next_event(job: Job, request: Request) -> object:
    """Next item of the job's channel; raises Disconnected if the client hangs up meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise Disconnected from None


async def sse_chunks(
    head: dict, chat: bool, include_usage: bool, stop: list[str] | None, first: Any, events: AsyncIterator,
    text_of: Callable[[int], str] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """OpenAI streaming chunks as server-sent events, ending with `data: [DONE]`; `head` from chunk_head. With
    `text_of` (a token's text) each chunk carries the logprobs of the tokens the engine released up to it."""
    if chat:
        yield protocol.chunk(head, chat, "", None, role=True)
    ev, text, sent, pending = first, "", 0, []  # text streamed by the engine; sent: how much of it went out

    def logprobs() -> dict | None:
        entries, pending[:] = list(pending), []
        return protocol.logprobs_json(entries, chat, text_of, sent) if text_of and entries else None

    try:
        while ev.result is None:
            text += ev.text
            pending += ev.logprobs
            safe = len(text) - protocol.held_back(text, stop)  # never send what may turn out to be a stop string
            if safe > sent:
                yield protocol.chunk(head, chat, text[sent:safe], None, logprobs=logprobs())
                sent = safe
            ev = await anext(events)
        res = ev.result
        pending += ev.logprobs
        if len(res.text) > sent:
            yield protocol.chunk(head, chat, res.text[sent:], None, logprobs=logprobs())
        yield protocol.chunk(head, chat, None, res.finish_reason, logprobs=logprobs())
        if include_usage:
            yield protocol.sse({**head, "choices": [], "usage": protocol.usage(res)})
    except ApiError as e:
        yield protocol.sse(e.body())
    except (Disconnected, StopAsyncIteration):
        return  # client gone (the job is cancelled by run_job) or stream ended without a result
    finally:
        await events.aclose()
    yield protocol.SSE_DONE
