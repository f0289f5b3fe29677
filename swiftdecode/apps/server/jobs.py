"""A request's jobs: one per choice, each with its channel of engine events back to the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

END = object()  # last item of every job's event queue
# Events a job may have waiting unread (a stream whose client does not read): beyond, its request sits out the
# rounds until the reader catches up, so a reader that never reads holds a bounded buffer (and its slot until the
# request timeout). A round is one event; a reading client keeps up with any round rate.
MAX_UNREAD = 64


@dataclass(eq=False)
class Prompt:
    """A request's prompt, shared by its choices' jobs: as given (text, token ids, or chat messages) and, once the
    worker has encoded it (with its tools), its ids, its compiled grammar and (echo with logprobs) the entries of
    ids[1:]: each once per request."""

    given: str | list[int] | list[dict]
    chat: bool
    tools: Any = None  # chat: the request's tools.Tools, which the prompt tells the model of
    ids: list[int] | None = None
    logprobs: list | None = None
    scorer: Any = None  # echo with logprobs: the logprobs.PromptScorer while its chunks are being scored
    holder: Any = None  # ... and the one of its choices' jobs whose KV reservation covers the scorer's cache
    queued: bool = False  # the request has its place in the worker's queue: its other choices join it there

    def left(self, job: Job, batch: Any) -> None:
        """A cancelled choice's `job` has left: it holds no reservation for the scorer, and `batch` (an
        engine.batch.Batch) stops scoring the prompt (a choice still waiting takes it up again)."""
        self.holder = None if self.holder is job else self.holder
        if self.scorer is not None and batch.scorer is self.scorer:
            batch.scorer = None

    grammar: Any = None  # the request's grammar, compiled once for its choices (grammar.Compiled)


@dataclass(eq=False)
class Job:
    """One choice of a request: its prompt, engine kwargs, and the channel back."""

    prompt: Prompt
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    streamed: int = 0  # tokens sent so far
    submitted: float = field(default_factory=time.perf_counter)
    request: Any = None  # the engine's Request, once validated
    answered: bool = False  # some text was streamed
    echo: bool = False  # the response begins with the prompt (its ids and entries are the Prompt's)
    emitted: int = 0  # events put (by the worker thread)
    taken: int = 0  # ... and taken by the reader (on the event loop): `unread` needs no lock

    def emit(self, item: object) -> None:
        """Thread-safe put into `events` (no-op once the event loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
            self.emitted += 1
        except RuntimeError:
            self.cancelled.set()

    async def next(self) -> object:
        """The next event (on the job's event loop)."""
        item = await self.events.get()
        self.taken += 1
        return item

    @property
    def unread(self) -> int:
        return self.emitted - self.taken
