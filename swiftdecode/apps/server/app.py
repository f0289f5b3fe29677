"""The FastAPI app: routes, authentication, error responses, and the bridge from a request to its worker job.

Every request is a `gen.stream(...)` call run by the worker thread: a client that goes away is noticed between
tokens, its job is cancelled and the worker moves on. /health and /metrics never wait for the worker.
"""

import asyncio
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from swiftdecode.apps.server import protocol, responses
from swiftdecode.apps.server.jobs import END, Job, Prompt
from swiftdecode.apps.server.metrics import Metrics
from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.apps.server.streaming import Disconnected, first_events, last_result, next_event, sse_chunks
from swiftdecode.apps.server.tokens import Tokens
from swiftdecode.apps.server.worker import DEFAULT_KV_GB, DEFAULT_MAX_BATCH, DEFAULT_TIMEOUT_S, Worker
from swiftdecode.base.errors import UserError

if TYPE_CHECKING:
    from swiftdecode.engine.generator import Generator

log = logging.getLogger(__name__)

# A request body's size at most: BODY_PER_TOKEN bytes for each token of the model's context, at least MIN_BODY.
# A token of a prompt is ~7 bytes as a JSON id and ~4 characters of text on average (up to 6 bytes each as JSON
# escapes), so this leaves room for any prompt the context can take. The bound is the event loop's: parsing runs
# in a thread but holds the interpreter lock, and 10 MiB of logit_bias entries took 1.0 s to parse.
MIN_BODY, BODY_PER_TOKEN = 2**20, 32
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (else 408): a client trickling bytes holds a socket
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_GONE = 499  # nginx's status for a request the client abandoned (nobody is left to read it)
KNOWN_PATHS = {
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
}


@dataclass(frozen=True)
class Limits:
    """The serving limits and access (see `swiftdecode serve --help`). `api_keys`: the keys a request may send
    (None: open); each is a tenant: what is learned from its text serves only its requests. `metrics_key`:
    /metrics's own key (default: the API key, if only one). `response_stats`: responses carry the engine's
    statistics (`swiftdecode`)."""

    max_queue: int = 64
    max_batch: int = DEFAULT_MAX_BATCH
    timeout_s: float = DEFAULT_TIMEOUT_S
    kv_gb: float = DEFAULT_KV_GB
    api_keys: tuple[str, ...] | None = None
    metrics_key: str | None = None
    body_timeout_s: float = BODY_TIMEOUT_S
    response_stats: bool = False


def create_app(
    gen: "Generator",
    model_id: str,
    *,
    max_queue: int = 64,
    max_batch: int = DEFAULT_MAX_BATCH,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kv_gb: float = DEFAULT_KV_GB,
    api_key: str | list[str] | None = None,
    metrics_key: str | None = None,
    docs: bool = False,
    body_timeout_s: float = BODY_TIMEOUT_S,
    response_stats: bool = False,
) -> FastAPI:
    """The FastAPI app serving `gen` as model `model_id`; the worker thread stops on app shutdown. `api_key`: one
    key or several; `docs`: serve FastAPI's /docs, /redoc and /openapi.json (open to all); see Limits."""
    keys = [api_key] if isinstance(api_key, str) else api_key
    protocol.check_keys([*(keys or ()), *([metrics_key] if metrics_key is not None else [])])
    keys = tuple(keys) if keys else None
    limits = Limits(max_queue, max_batch, timeout_s, kv_gb, keys, metrics_key, body_timeout_s, response_stats)
    api = Api(gen, model_id, limits)
    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="swiftdecode", lifespan=api.lifespan, **pages)
    app.state.api = api  # its worker, metrics and limits, for whoever holds the app
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RecursionError, too_deep)
    app.add_exception_handler(Exception, api.crash)
    app.add_middleware(StatusCounter, metrics=api.metrics)
    app.get("/health")(api.health)
    app.get("/metrics")(api.prometheus)
    app.get("/v1/models")(api.list_models)
    app.get("/v1/models/{name:path}")(api.get_model)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    for path, call in (("/tokenize", api.tokens.tokenize), ("/detokenize", api.tokens.detokenize)):
        app.post(path)(tokens_route(api, call))
    return app


def check_key(request: Request, keys: tuple[str, ...]) -> int:
    """The index of the key of `keys` the request sent as 'Authorization: Bearer KEY', else 401. Every key is
    compared, each in constant time: the time taken tells nothing of any key."""
    given = request.headers.get("authorization", "").encode("latin-1")
    found = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]
    if not any(found):
        message = "invalid or missing API key (send 'Authorization: Bearer KEY')"
        raise ApiError(401, message, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    return found.index(True)


def tokens_route(api: "Api", call: Callable[[bytes], dict]) -> Callable:
    """The handler of /tokenize or /detokenize (see `tokens`): `call` runs on the tokens' own thread; the
    engine's UserError is a 400."""

    async def route(request: Request) -> dict:
        api.authorize(request)
        raw = await api.read_body(request)
        try:
            return await asyncio.get_running_loop().run_in_executor(api.tokens.thread, call, raw)
        except UserError as e:
            raise ApiError(e.status, str(e)) from None

    return route


async def read_body(request: Request, max_body: int, timeout_s: float) -> bytes:
    """A request's body: at most `max_body` bytes (413), arriving within `timeout_s` (408)."""

    async def read() -> bytes:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > max_body:
                raise ApiError(413, f"request body exceeds {max_body} bytes")
        return bytes(raw)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None


# ---------------------------------------------------------------- errors and status counting


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    return error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))


async def too_deep(request: Request, e: RecursionError) -> JSONResponse:
    """A request whose JSON nests deeper than its checks could recurse: the request's fault, not the server's."""
    return error_response(protocol.too_deep())


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


class Api:
    """The route handlers over one Generator: its worker (started by `lifespan`), metrics and limits."""

    def __init__(self, gen: "Generator", model_id: str, limits: Limits):
        self.gen, self.model_id, self.limits = gen, model_id, limits
        self.metrics = Metrics()
        self.worker: Worker | None = None
        self.created = int(time.time())
        self.max_body = max(MIN_BODY, BODY_PER_TOKEN * gen.max_length)
        self.tokens = Tokens(gen.codec())
        # A token's text, as a response's logprobs show it: cached (at most the vocabulary), so that a long echoed
        # prompt's entries cost a lookup each, not a tokenizer call.
        self.token_text = functools.lru_cache(maxsize=None)(lambda token: gen.decode([token]))

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        lim = self.limits
        self.worker = Worker(self.gen, lim.max_queue, self.metrics, lim.max_batch, lim.timeout_s, lim.kv_gb)
        await asyncio.to_thread(self.worker.warm.wait)  # ready once warm: the warm-up borrows the model's cache
        if self.worker.failure is not None:  # the server does not start (uvicorn reports it and exits)
            raise RuntimeError(f"the generation worker failed to warm up: {self.worker.failure!r}")
        yield
        await asyncio.to_thread(self.worker.close)
        self.tokens.thread.shutdown(cancel_futures=True)

    def drain(self, seconds: float) -> None:
        """The server is stopping: see Worker.drain (from the signal handler, on the event loop's thread)."""
        if self.worker is not None:
            self.worker.drain(seconds)

    async def crash(self, request: Request, e: Exception) -> JSONResponse:
        """An unhandled error: 500, counted (the status counter does not see responses made out here)."""
        log.exception("unhandled error")
        self.metrics.count_http(request.url.path if request.url.path in KNOWN_PATHS else "other", 500)
        return error_response(ApiError(500, f"internal server error: {type(e).__name__}"))

    async def health(self) -> JSONResponse:
        """200 while the worker runs, else 503."""
        queued, running, *_ = self.worker.depth()
        status = "ok" if self.worker.alive else "error"
        body = {"status": status, "model": self.model_id, "queued": queued, "running": running}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def prometheus(self, request: Request) -> PlainTextResponse:
        """The metrics, for the metrics key or (without one) the API key. With several API keys each is a tenant,
        and the metrics sum all tenants' traffic: only a metrics key reads them (403 without one)."""
        keys = self.limits.api_keys
        if self.limits.metrics_key is not None:
            check_key(request, (self.limits.metrics_key,))
        elif keys is not None and len(keys) > 1:
            check_key(request, keys)
            raise ApiError(403, "with several API keys, /metrics reads only with --metrics-key (it sums all tenants)")
        else:
            self.authorize(request)
        return PlainTextResponse(self.metrics_text(), media_type=PROMETHEUS_TYPE)

    def metrics_text(self) -> str:
        """The metrics in Prometheus's text format."""
        return self.metrics.render(*self.worker.depth(), model=self.model_id, method=self.gen.method)

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

    def authorize(self, request: Request) -> int | None:
        """Which API key the request sent (its index), None on an open server; else 401."""
        return None if self.limits.api_keys is None else check_key(request, self.limits.api_keys)

    async def read_body(self, request: Request) -> bytes:
        """The request's body: at most `max_body` bytes (413), arriving within the body timeout (408)."""
        return await read_body(request, self.max_body, self.limits.body_timeout_s)

    async def complete(self, request: Request, chat: bool) -> Any:
        """/v1/completions and /v1/chat/completions: the whole response, or its stream of chunks. Each of the `n`
        choices is a job of its own (they decode together in the batch); the prefix cache's salt is the API key's
        and the request's cache_salt or user."""
        key = self.authorize(request)
        req = await asyncio.to_thread(protocol.parse_request, await self.read_body(request), chat, self.model_id)
        params, n, echo, stream, prompt = req.params, req.n, req.echo, req.stream, req.prompt
        params = params | {"cache_salt": json.dumps([key, req.salt])} if key is not None or req.salt else params
        head, loop = responses.response_head(chat, self.model_id), asyncio.get_running_loop()
        shared = Prompt(prompt, chat, req.tools)  # its choices' jobs encode it once
        choices = [Job(shared, protocol.choice_params(params, i), loop, echo=echo) for i in range(n)]
        jobs = [self.run_job(request, job) for job in choices]
        try:
            firsts = await first_events(jobs)  # surfaces queue/parameter errors as a proper HTTP status
            if stream:
                text_of = self.token_text if params["params"].logprobs is not None else None
                parts = [(first, events) for first, events in zip(firsts, jobs, strict=True)]
                said = await asyncio.to_thread(self.echo_head, prompt, choices[0], chat, text_of) if echo else None
                first = responses.chunk_head(head, chat)
                sse = sse_chunks(first, chat, req.include_usage, parts, text_of, said, req.tools is not None)
                return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            ends = [last_result(f, events) for f, events in zip(firsts, jobs, strict=True)]
            results = await asyncio.gather(*ends, return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise errors[0]  # a 504, or the client left
        except Disconnected:
            return PlainTextResponse("", status_code=CLIENT_GONE)
        finally:
            if not stream:
                await asyncio.gather(*(events.aclose() for events in jobs))
        body = await asyncio.to_thread(self.whole_response, head, chat, results, echo and (prompt, choices[0]), req)
        return Response(body, media_type="application/json")

    def whole_response(self, head: dict, chat: bool, results: list, echo: tuple | None, req) -> bytes:
        """A non-streamed response's JSON (off the event loop: an echoed prompt's logprobs are as long as it)."""
        said = self.echoed(*echo) if echo else None
        stats, tools = self.limits.response_stats, req.tools is not None
        body = responses.completion(head, chat, results, self.token_text, said, tools, stats)
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()  # as JSONResponse

    def echo_head(self, prompt: str | list[int], job: Job, chat: bool, text_of) -> tuple:
        """A stream's echoed prompt (responses.echo_head), built once for all choices, off the event loop."""
        return responses.echo_head(self.echoed(prompt, job), chat, text_of)

    def echoed(self, prompt: str | list[int], job: Job) -> tuple:
        """responses.completion's `echo` of a scored job: the prompt's text, ids and entries."""
        text = prompt if isinstance(prompt, str) else self.gen.decode(prompt)
        return text, job.prompt.ids, job.prompt.logprobs

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
