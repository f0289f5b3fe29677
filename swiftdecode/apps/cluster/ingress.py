"""The ingress of `serve --ray`: one FastAPI app in front of the replicas, forwarding each request as it came.

Routing is Ray Serve's: the replicas' request router is Ray's PrefixCacheAffinityRouter (deploy.py), which reads
the routing text each call carries (`routing_text`: the tenant, then the prompt) and sends a request to the
replica that saw the longest part of it while that replica is not overloaded, else to the less loaded of two.

Failover: a replica that dies before answering costs a retry on another one. Every replica computes the same
bits (batch-invariant kernels, the same seeds), so a retried request gets the answer the first would have given.
A stream cut after its first part ends with an error event (`replica_lost`), not with a different text.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from swiftdecode.apps.cluster.asgi import Call
from swiftdecode.apps.cluster.board import merge
from swiftdecode.apps.cluster.routing import routing_text
from swiftdecode.apps.server import responses
from swiftdecode.apps.server.app import BODY_TIMEOUT_S, PROMETHEUS_TYPE, error_response, read_body
from swiftdecode.apps.server.protocol import ApiError

log = logging.getLogger(__name__)

ATTEMPTS = 4  # tries of a request whose replica died before answering, each after Ray has had time to notice
RETRY_WAIT_S = 0.5  # the first wait before a retry, doubling after each
MAX_BODY = 16 * 2**20  # the ingress's bound on a body; each replica applies its own (smaller, per its context)
DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection"}  # recomputed by the ingress's response

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


def parse(authorization: str, body: bytes) -> tuple[Any, str]:
    """The body as JSON (None where it is none: the replica answers that with its own 400) and its routing text."""
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    return parsed, routing_text(authorization, parsed)


def kept(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in headers if k.lower() not in DROPPED_HEADERS}


def unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"no replica could answer ({type(e).__name__}); retry later", None, "replica_unavailable")


@serve.ingress(app)
class Ingress:
    """Forwards every route to a replica (`replicas`: their handle); /metrics merges the board's texts."""

    def __init__(self, replicas, board):
        self.replicas, self.board = replicas, board

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = await read_body(request, MAX_BODY, BODY_TIMEOUT_S)
            auth = request.headers.get("authorization", "")
            parsed, route = await asyncio.to_thread(parse, auth, body)  # off the event loop, as the server parses
            query = f"?{request.url.query}" if request.url.query else ""
            call = Call(request.method, request.url.path + query, tuple(request.headers.items()), body, route)
            if isinstance(parsed, dict) and parsed.get("stream") is True:
                return await self.stream(call)
            status, headers, content = await self.respond(call)
        except ApiError as e:
            return error_response(e)
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
