"""The ingress of `serve --ray`: one FastAPI app in front of the replicas, forwarding each request as it came.

Before a request is routed the ingress checks it as the single server would (its `Gate`): the API key first (in
constant time, before the body is read), the server's body limit (the replicas' own, from the board), and a
completion's parameters (400s never reach a replica). Routing is Ray Serve's: the replicas' request router is
Ray's PrefixCacheAffinityRouter (deploy.py), which reads the routing text each call carries (`routing_text`: the
tenant, then the prompt, at most MAX_ROUTING_CHARS) and sends a request to the replica that saw the longest part
of it while that replica is not overloaded, else to the less loaded of two. A replica takes a few requests beyond
its batch and queue, and answers them with its server's 429 (deploy.OVERFLOW_SLOTS); no answer within the
request timeout: 504.

Failover: a replica that dies before answering costs a retry on another one. Every replica computes the same
bits (batch-invariant kernels, the same seeds), so a retried request gets the answer the first would have given.
A stream cut after its first part ends with an error event (`replica_lost`), not with a different text.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from swiftdecode.apps.cluster.asgi import Call
from swiftdecode.apps.cluster.board import merge
from swiftdecode.apps.cluster.routing import routing_text
from swiftdecode.apps.server import protocol, responses
from swiftdecode.apps.server.app import BODY_TIMEOUT_S, PROMETHEUS_TYPE, check_key, error_response, read_body
from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.apps.server.running import timeout_error

log = logging.getLogger(__name__)

ATTEMPTS = 4  # tries of a request whose replica died before answering, each after Ray has had time to notice
RETRY_WAIT_S = 0.5  # the first wait before a retry, doubling after each
MAX_BODY = 16 * 2**20  # a body's bound until a replica has told the board its own (per its model's context)
# Characters of a request's routing text at most: the router's tree matches beginnings (a conversation's turns
# share theirs), and the text is ~50 bytes per token id of a prompt given as ids.
MAX_ROUTING_CHARS = 32_768
DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection"}  # recomputed by the ingress's response
OPEN_PATHS = ("/health",)  # as the single server: no key asked
GENERATING = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


@dataclass(frozen=True)
class Gate:
    """What the ingress checks before routing, as each replica's server does: the API keys (None: open),
    /metrics's key, the served model's name and the request timeout."""

    api_keys: tuple[str, ...] | None
    metrics_key: str | None
    model_id: str
    timeout_s: float

    def admit(self, request: Request) -> None:
        """401 unless the request sent a key its path takes (/metrics: the metrics key or an API key; the
        replica then applies its own rule)."""
        path = request.url.path
        keys = (*(self.api_keys or ()), *([self.metrics_key] if path == "/metrics" and self.metrics_key else []))
        if keys and path not in OPEN_PATHS:
            check_key(request, keys)


app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


def parse(path: str, authorization: str, body: bytes, model_id: str) -> tuple[Any, str]:
    """The body as JSON (None where it is none: the replica answers that with its own 400) and its routing text;
    a completion's body checked as the server checks it (ApiError)."""
    if path in GENERATING:
        protocol.parse_request(body, GENERATING[path], model_id)
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, RecursionError):
        parsed = None
    return parsed, routing_text(authorization, parsed)[:MAX_ROUTING_CHARS]


def kept(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in headers if k.lower() not in DROPPED_HEADERS}


def unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"no replica could answer ({type(e).__name__}); retry later", None, "replica_unavailable")


@serve.ingress(app)
class Ingress:
    """Forwards every route to a replica (`replicas`: their handle); /metrics merges the board's texts."""

    def __init__(self, replicas, board, gate: Gate):
        self.replicas, self.board, self.gate = replicas, board, gate
        self.max_body: int | None = None  # the replicas' body limit, once one has told the board

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        try:
            self.gate.admit(request)
            self.max_body = self.max_body or await self.board.max_body.remote()
            body = await read_body(request, self.max_body or MAX_BODY, BODY_TIMEOUT_S)
            auth, model = request.headers.get("authorization", ""), self.gate.model_id
            parsed, route = await asyncio.to_thread(parse, request.url.path, auth, body, model)  # off the loop
            query = f"?{request.url.query}" if request.url.query else ""
            call = Call(request.method, request.url.path + query, tuple(request.headers.items()), body, route)
            async with asyncio.timeout(self.gate.timeout_s):
                if isinstance(parsed, dict) and parsed.get("stream") is True:
                    return await self.stream(call)
                status, headers, content = await self.respond(call)
        except ApiError as e:
            return error_response(e)
        except TimeoutError:
            return error_response(timeout_error(self.gate.timeout_s))

        if call.path == "/metrics" and status == 200:  # the replica checked the key; the text is everyone's
            return Response(merge(await self.board.get.remote()), 200, media_type=PROMETHEUS_TYPE)
        return Response(content, status, headers=kept(headers))

    async def respond(self, call: Call) -> tuple[int, list, bytes]:
        """A replica's whole response, retried on another replica if the one asked died meanwhile."""
        for attempt in range(ATTEMPTS):
            try:
                return await self.replicas.respond.remote(call)
            except RayActorError as e:
                log.warning("replica lost (%r), retrying", e)
                if attempt == ATTEMPTS - 1:
                    raise unavailable(e) from None
                await asyncio.sleep(RETRY_WAIT_S * 2**attempt)
        raise AssertionError("unreachable")

    async def stream(self, call: Call) -> Response:
        """A replica's streamed response; until its first part arrives, a lost replica costs a retry."""
        for attempt in range(ATTEMPTS):
            parts = self.replicas.options(stream=True).stream.remote(call)
            try:
                status, headers, first = await anext(parts)
                break
            except RayActorError as e:
                log.warning("replica lost before streaming (%r), retrying", e)
                if attempt == ATTEMPTS - 1:
                    raise unavailable(e) from None
                await asyncio.sleep(RETRY_WAIT_S * 2**attempt)
        return StreamingResponse(self.rest(first, parts), status, headers=kept(headers))

    @staticmethod
    async def rest(first: bytes, parts) -> AsyncIterator[bytes]:
        """A stream's parts from its first on; a replica lost mid-stream ends it with a `replica_lost` error event."""
        try:
            yield first
            async for part in parts:
                yield part
        except RayActorError:
            error = ApiError(503, "the replica serving this stream stopped; retry the request", None, "replica_lost")
            yield (responses.sse(error.body()) + responses.SSE_DONE).encode()
        finally:
            parts.cancel()
