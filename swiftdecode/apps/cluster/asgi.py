"""One HTTP exchange with an ASGI app inside this process: what a replica does with a request the ingress sent.

The replica hosts the single-machine server's FastAPI app unchanged (same routes, errors, keys, streaming), so the
cluster adds no second implementation of the API: the ingress forwards the request as it came, and the app's
response messages come back as they are sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

DONE = object()  # end of an exchange's messages


@dataclass(frozen=True)
class Call:
    """A request as the ingress received it, and its routing text. `prompt` is what the prefix-affinity router
    reads (Ray's PrefixCacheAffinityRouter matches an argument's `.prompt`): the tenant, then the prompt's text,
    never empty."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prompt: str


def scope(call: Call) -> dict:
    """The ASGI HTTP scope of `call` (its query string split off the path)."""
    path, _, query = call.path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
        "client": ("ray-ingress", 0),
        "server": ("swiftdecode-replica", 0),
    }


async def exchange(app: Callable, call: Call) -> AsyncIterator[dict]:
    """The app's response messages for `call` (`http.response.start`, then `http.response.body` ones). Closing the
    iterator early is the client going away: the app is told (`http.disconnect`) and its task cancelled (its
    request's jobs leave the batch)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(scope(call), receive, send)
        finally:
            await out.put(DONE)

    task = asyncio.create_task(run())
    try:
        while (message := await out.get()) is not DONE:
            yield message
        await task  # surfaces an error the app raised instead of answering
    finally:
        gone.set()
        task.cancel()


async def coalesced(parts: AsyncIterator[bytes], window_s: float) -> AsyncIterator[bytes]:
    """`parts` joined in batches, each what came within `window_s` of its first part. Every part forwarded
    between processes costs CPU at each hop, which on a few cores is taken from decoding."""
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(anext(parts, DONE))
    batch, deadline = bytearray(), None
    try:
        while True:
            timeout = None if deadline is None else max(deadline - loop.time(), 0)
            done, _ = await asyncio.wait({waiting}, timeout=timeout)
            part = waiting.result() if done else None
            if part is not None and part is not DONE:
                batch += part
                deadline = deadline or loop.time() + window_s
                waiting = asyncio.ensure_future(anext(parts, DONE))
                continue
            if batch:
                yield bytes(batch)
                batch, deadline = bytearray(), None
            if part is DONE:
                return
    finally:
        waiting.cancel()
