"""A replica of `serve --ray`: one engine process running the single-machine server (apps/server) for the ingress.

It is the `swiftdecode serve` app itself — same routes, limits, keys, queue, batch and prefix cache — reached
through in-process ASGI calls (asgi.exchange) instead of a socket. Ray reserves `--threads` CPUs for it, and its
kernels use that many threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from swiftdecode.apps.cluster.asgi import Call, coalesced, exchange
from swiftdecode.apps.cluster.routing import answer_of, answered_text

log = logging.getLogger(__name__)

METRICS_PUSH_S = 2.0  # how often a replica sends its metrics to the board: /metrics lags by at most this
TREE_ACTOR = "LlmPrefixTreeActor"  # the prefix tree of Ray's PrefixCacheAffinityRouter (in the deployment's namespace)
# A stream's parts are sent on at most this often: each part costs CPU at every hop (replica -> ingress -> proxy),
# and at a few ms a token a part per token took 12% of two cores; 50 ms is below what a reader notices.
STREAM_WINDOW_S = 0.05
GENERATING = ("/v1/chat/completions", "/v1/completions")


REPLICA_HEADER = "x-swiftdecode-replica"  # each response says which replica answered it


def head_of(message: dict, replica: str) -> tuple[int, list[tuple[str, str]]]:
    """An `http.response.start` message's status and headers as text, with the replica's id added."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
    return message["status"], [*headers, (REPLICA_HEADER, replica)]


class Replica:
    """One engine: the server app over a Generator built from `serve`'s own arguments (`args`). `board`: the
    metrics board's handle."""

    async def __init__(self, args: argparse.Namespace, board):
        from ray import serve

        from swiftdecode.apps.server.app import create_app
        from swiftdecode.apps.server.options import app_options, engine, model_id

        self.app = create_app(engine(args), model_id(args), **app_options(args))
        self.api = self.app.state.api
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # the worker thread starts and warms up
        context = serve.get_replica_context()
        self.id, self.tenant = context.replica_id.unique_id, context.replica_id.to_full_id_str()
        self.tree_namespace = f"serve::{context.app_name}::{context.deployment}"
        self.tree = None  # the router's prefix tree actor, once found
        self.board = board
        self.pushing = asyncio.create_task(self.push_metrics())

    async def respond(self, call: Call) -> tuple[int, list[tuple[str, str]], bytes]:
        """The whole response to `call`: status, headers, body."""
        status, headers, body = 500, [], bytearray()
        async for message in exchange(self.app, call):
            if message["type"] == "http.response.start":
                status, headers = head_of(message, self.id)
            else:
                body += message.get("body", b"")
        await asyncio.to_thread(self.learn, call, status, body, False)
        return status, headers, bytes(body)

    async def stream(self, call: Call) -> AsyncIterator:
        """The response to `call` as it is sent: first (status, headers, first body part), then the body's later
        parts, joined over STREAM_WINDOW_S."""
        head, sent = (500, []), bytearray()

        async def bodies() -> AsyncIterator[bytes]:
            nonlocal head
            async for message in exchange(self.app, call):
                if message["type"] == "http.response.start":
                    head = head_of(message, self.id)
                else:
                    sent.extend(message.get("body", b""))
                    yield message.get("body", b"")

        parts = bodies()
        first = await anext(parts, b"")
        yield (*head, first)
        async for part in coalesced(parts, STREAM_WINDOW_S):
            yield part
        await asyncio.to_thread(self.learn, call, head[0], bytes(sent), True)

    def learn(self, call: Call, status: int, body: bytes, streamed: bool) -> None:
        """After an answer (in a thread: it parses JSON): tell the router's prefix tree that this replica's cache
        holds prompt and answer (see routing.py), without waiting for the tree."""
        if status != 200 or call.path not in GENERATING or (answer := answer_of(body, streamed)) is None:
            return
        text = answered_text(dict(call.headers).get("authorization", ""), json.loads(call.body), answer)
        if text is None:
            return
        if self.tree is None:
            import ray

            try:
                self.tree = ray.get_actor(TREE_ACTOR, namespace=self.tree_namespace)
            except ValueError as e:  # no tree yet (no request routed by it): nothing to add to
                log.debug("prefix tree not updated: %r", e)
                return
        self.tree.insert.remote(text, self.tenant, time.time())

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose generation worker stopped is replaced."""
        if not self.api.worker.alive:
            raise RuntimeError("the generation worker has stopped")

    async def push_metrics(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.id, self.api.metrics_text(), self.api.max_body)
            except Exception as e:  # the board restarting: the next push goes through
                log.warning("metrics push failed: %r", e)
            await asyncio.sleep(METRICS_PUSH_S)
