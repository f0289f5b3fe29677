"""A request's events, from its worker jobs to the client: the first events (errors surface as HTTP statuses), the
last result, and the stream of server-sent chunks, the choices' interleaved as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from swiftdecode.apps.server import responses
from swiftdecode.apps.server.jobs import END, Job
from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.decoding.tools import finish_reason as tool_finish

POLL_S = 0.25  # while waiting for a job's next event, how often to check that the client is still there


class Disconnected(Exception):
    """The client went away while we waited for its job."""


async def next_event(job: Job, request: Request) -> object:
    """Next item of the job's channel; raises Disconnected if the client hangs up meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.next(), timeout=POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise Disconnected from None


async def first_events(jobs: list[AsyncIterator]) -> list[Any]:
    """Each job's first event; if any job fails (a full queue, a bad parameter), all are closed (cancelled) and
    its error raised."""
    firsts = await asyncio.gather(*(anext(events) for events in jobs), return_exceptions=True)
    if errors := [e for e in firsts if isinstance(e, BaseException)]:
        await asyncio.gather(*(events.aclose() for events in jobs))
        raise errors[0]
    return firsts


async def last_result(first: Any, events: AsyncIterator) -> Any:
    """A job's GenerationResult, from its first event on."""
    res = first.result
    async for ev in events:
        res = ev.result
    return res


async def sse_chunks(
    head: dict,
    chat: bool,
    include_usage: bool,
    parts: list[tuple[Any, AsyncIterator]],
    text_of: Callable[[int], str] | None = None,
    echo: tuple | None = None,
    tools: bool = False,
) -> AsyncIterator[str]:
    """OpenAI streaming chunks as server-sent events, ending with `data: [DONE]`; `head` from chunk_head; `parts`
    the choices' (first event, events), their chunks interleaved as they come. With `text_of` (a token's text) each
    chunk carries the logprobs of the tokens the engine released up to it; `echo`: responses.echo_head's; `tools`
    as responses.completion's."""
    results: list = []
    streams = [
        choice_chunks(head, chat, first, events, text_of, i, results, echo, tools)
        for i, (first, events) in enumerate(parts)
    ]
    try:
        async for item in streams[0] if len(streams) == 1 else interleaved(streams):
            yield item
    except Disconnected:
        return  # client gone: the jobs are cancelled by run_job
    finally:
        await asyncio.gather(*(stream.aclose() for stream in streams))
    if include_usage and len(results) == len(parts):
        yield responses.sse({**head, "choices": [], "usage": responses.usage(results)})
    yield responses.SSE_DONE


async def interleaved(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several async iterators as each comes; ends when all have."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(END)
        except Exception as e:  # the consumer raises it (Disconnected: the client left)
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        for _ in streams:
            while (item := await queue.get()) is not END:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def choice_chunks(
    head: dict,
    chat: bool,
    first: Any,
    events: AsyncIterator,
    text_of,
    index: int,
    results: list,
    echo: tuple | None = None,
    tools: bool = False,
) -> AsyncIterator[str]:
    """One choice's chunks (see sse_chunks); its GenerationResult is appended to `results` at the end. With
    `echo` (responses.echo_head: built once for all choices) the first chunk holds the prompt and its entries; with
    `tools` the text goes out as content and tool-call deltas (responses.ToolDeltas)."""
    if chat:
        yield responses.chunk(head, chat, "", None, role=True, index=index)
    ev, sent, pending = first, 0, []  # sent: characters of text that went out (the engine holds back stop strings)
    before = [0]  # characters of the tokens whose entries went out: the next entry's text_offset
    if echo is not None:
        said, lps, before[0] = echo
        yield responses.chunk(head, chat, said, None, logprobs=lps, index=index)
    split = responses.ToolDeltas() if tools else None

    def logprobs() -> dict | None:
        entries, pending[:] = list(pending), []
        if not (text_of and entries):
            return None
        out = responses.logprobs_json(entries, chat, text_of, before[0])
        before[0] += sum(len(text_of(e.token)) for e in entries)
        return out

    def pieces(text: str, last: bool = False) -> list[str]:
        deltas = (split.feed(text) + (split.close() if last else [])) if split else [None] * bool(text)
        return [responses.chunk(head, chat, text, None, logprobs=logprobs(), index=index, delta=d) for d in deltas]

    try:
        while ev.result is None:
            pending += ev.logprobs
            for piece in pieces(ev.text):
                yield piece
            sent += len(ev.text)
            ev = await anext(events)
        res = ev.result
        pending += ev.logprobs
        for piece in pieces(res.text[sent:], last=True):
            yield piece
        finish = tool_finish(res.finish_reason, split.parser.calls) if split else res.finish_reason
        yield responses.chunk(head, chat, None, finish, logprobs=logprobs(), index=index)
        results.append(res)
    except ApiError as e:
        yield responses.sse(e.body())
    except StopAsyncIteration:
        return  # the job ended without a result
    finally:
        await events.aclose()
