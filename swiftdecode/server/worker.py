"""The generation worker: one thread decoding the admitted requests together, off the event loop.

Requests wait in a bounded FIFO queue (full -> 429 with Retry-After) and are admitted in arrival order into one
`Batch` (one forward per round for all of them), as long as the batch has room and their KV cache fits. Each
job's events go back to its event loop through `Job.events`, ending with END.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swiftdecode.errors import UserError
from swiftdecode.kernels.openmp import release_thread_pool
from swiftdecode.logprobs import prompt_logprobs
from swiftdecode.model import warm_up
from swiftdecode.request import GenerationResult, GenerationStats, StreamEvent
from swiftdecode.server.metrics import Metrics
from swiftdecode.server.protocol import ApiError

if TYPE_CHECKING:
    from swiftdecode.engine import Generator

log = logging.getLogger(__name__)

END = object()  # last item of every job's event queue
DEFAULT_MAX_BATCH = 8  # requests decoding together; see README (Serving) for the measured throughput curve
DEFAULT_KV_GB = 4.0  # KV cache the running requests may reserve (each: prompt + max tokens + a round's slack)
DEFAULT_TIMEOUT_S = 600.0  # a request still queued or generating this long after submission ends with HTTP 504
JOIN_S = 30  # on close, how long to wait for the worker thread to finish its round


@dataclass(eq=False)
class Job:
    """One request: its prompt (str, token ids, or chat messages), engine kwargs, and the channel back."""

    prompt: str | list[int] | list[dict]
    chat: bool
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    streamed: int = 0  # tokens sent so far
    submitted: float = field(default_factory=time.perf_counter)
    request: Any = None  # the engine's Request, once validated
    answered: bool = False  # some text was streamed
    echo: bool = False  # the response begins with the prompt: its ids (and entries, with logprobs) are set here
    prompt_ids: list[int] | None = None
    prompt_logprobs: list | None = None

    def emit(self, item: object) -> None:
        """Thread-safe put into `events` (no-op once the event loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()


def fail(jobs: list[Job], error: ApiError, metrics: Metrics, outcome: str = "error") -> None:
    """End each job with `error` (none of them is running)."""
    for job in jobs:
        metrics.add_streamed(job.streamed)
        job.emit(error)
        job.emit(END)
        metrics.count(outcome)


def timeout_error(timeout_s: float) -> ApiError:
    return ApiError(504, f"generation exceeded the server's request timeout ({timeout_s:g} s)", None, "timeout")


def internal_error(e: Exception) -> ApiError:
    log.exception("generation failed")
    return ApiError(500, f"internal error during generation: {type(e).__name__}")


class Worker:
    """One daemon thread decoding up to `max_batch` jobs together, admitted in arrival order; at most
    `max_queue` more wait, beyond that 429. A cancelled job (client gone) leaves the batch before the next
    round. `submit`, `cancel`, `depth` and `close` are called from the event loop."""

    def __init__(
        self,
        gen: Generator,
        max_queue: int,
        metrics: Metrics,
        max_batch: int = DEFAULT_MAX_BATCH,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_gb: float = DEFAULT_KV_GB,
    ):
        self.max_queue, self.metrics, self.max_batch, self.timeout_s = max_queue, metrics, max_batch, timeout_s
        self.cond = threading.Condition()  # guards pending, starting, closed and the running set's jobs
        self.running = Running(gen, metrics, self.cond, timeout_s, kv_gb)
        self.pending: deque[Job] = deque()
        self.starting = 0  # jobs taken from the queue, being validated and prefilled
        self.closed = False
        release_thread_pool()  # the worker thread runs the kernels from now on: one OpenMP pool, not two
        self.warm = threading.Event()  # set once the worker's warm-up forward is done (the server is ready then)
        self.thread = threading.Thread(target=self._loop, name="swiftdecode-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closed:
                raise ApiError(503, "server shutting down")
            free = max(self.max_batch - len(self.running) - self.starting, 0)
            if len(self.pending) >= self.max_queue + free:
                waiting = len(self.pending) - free + 1
                wait = max(1, round(self.metrics.mean_seconds() * waiting / self.max_batch))
                raise ApiError(
                    429,
                    f"server busy: {len(self.running)} requests running, {len(self.pending)} queued, retry later",
                    None,
                    "queue_full",
                    {"Retry-After": str(wait)},
                )
            self.pending.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or take a running one out of the batch before its next round."""
        job.cancelled.set()
        with self.cond:
            if job in self.pending:
                self.pending.remove(job)
                self.metrics.count("cancelled")
            self.cond.notify()

    def depth(self) -> tuple[int, int, int, int]:
        """(jobs queued, jobs running or starting, KV cache bytes the running ones have reserved, bytes of the
        prefix cache)."""
        with self.cond:
            reserved = sum(self.running.reserved.values())
            return len(self.pending), len(self.running) + self.starting, reserved, self.running.gen.prefixes.bytes

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for job in self.running.jobs.values():
                job.cancelled.set()
            for job in self.pending:
                job.cancelled.set()
                job.emit(ApiError(503, "server shutting down"))
                job.emit(END)
            self.pending.clear()
            self.cond.notify()
        self.thread.join(timeout=JOIN_S)

    def _loop(self) -> None:
        try:  # this thread runs the forwards: its first one is not a request's (see warm_up)
            warm_up(self.running.gen.sm)
        finally:
            self.warm.set()
        while True:
            with self.cond:
                while not self.pending and not self.running and not self.closed:
                    self.cond.wait()
                if self.closed:
                    break
                late = [j for j in self.pending if time.perf_counter() - j.submitted > self.timeout_s]
                for job in late:
                    self.pending.remove(job)
            if late:
                fail(late, timeout_error(self.timeout_s), self.metrics, "timeout")
            self._admit()
            self.running.drop_cancelled()
            self.running.drop_late()
            self.running.round()
        self.running.cancel_all()

    def _admit(self) -> None:
        """Start waiting jobs while the batch has room; one that must wait for KV memory goes back to the
        queue's front with those behind it, in order."""
        with self.cond:
            admit = []
            while self.pending and len(self.running) + len(admit) < self.max_batch:
                admit.append(self.pending.popleft())
            self.starting = len(admit)
        for k, job in enumerate(admit):
            started = self.running.start(job)
            with self.cond:
                self.starting -= 1
                if not started:
                    self.pending.extendleft(reversed(admit[k:]))
                    self.starting = 0
            if not started:
                break


class Running:
    """The jobs being decoded: the engine's `Batch`, each request's job and its KV reservation. Only the worker
    thread calls these methods; it changes `jobs` and `reserved` under `lock`, which the event loop reads under."""

    def __init__(self, gen: Generator, metrics: Metrics, lock: threading.Condition, timeout_s: float, kv_gb: float):
        from swiftdecode.batch import Batch

        self.gen, self.metrics, self.lock, self.timeout_s = gen, metrics, lock, timeout_s
        self.kv_bytes, self.per_token = int(kv_gb * 2**30), gen.sm.kv_bytes_per_token()
        self.jobs: dict[object, Job] = {}  # Request -> its job
        self.reserved: dict[object, int] = {}  # Request -> KV bytes it may grow to
        self.batch = Batch(gen)

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, job: Job) -> bool:
        """Validate and prefill a job; it joins the batch (or fails alone, with an ApiError). False: it must wait
        for KV memory (the request is kept on the job)."""
        if job.cancelled.is_set():
            job.emit(END)
            self.metrics.count("cancelled")
            return True
        try:
            if job.request is None:
                self.metrics.observe(self.metrics.queue_wait, time.perf_counter() - job.submitted)
                prompt = self.gen.chat_ids(job.prompt) if job.chat else job.prompt  # tokenizer: this thread only
                if job.echo and self.score(job, prompt):
                    return True
                prompt = job.prompt_ids if job.echo else prompt  # encoded once
                job.request = self.gen.request(prompt, **job.params)  # validates (UserError) before any work
            req, need = job.request, job.request.capacity * self.per_token
            if need > self.kv_bytes:
                raise ApiError(
                    413,
                    f"prompt and max_tokens need {need / 2**30:.2f} GB of KV cache; this server allows "
                    f"{self.kv_bytes / 2**30:.2f} GB (--max-kv-gb)",
                )
            if self.reserved and need > self.kv_bytes - sum(self.reserved.values()):
                return False
            with self.lock:
                self.jobs[req] = job
                self.reserved[req] = need
            self._deliver(req, self.batch.add(req))
        except ApiError as e:
            self.fail([job], e)
        except UserError as e:
            self.fail([job], ApiError(e.status, str(e), getattr(e, "field", None)))
        except Exception as e:  # never let one request take the server down
            self.fail([job], internal_error(e))
        return True

    def score(self, job: Job, prompt: str | list[int]) -> bool:
        """Echo: the prompt's ids and, with logprobs, its tokens' entries (its cache then goes to the prefix store,
        so the request's prefill copies it). A job that asks for no new tokens is answered here (True)."""
        job.prompt_ids, k = self.gen.prompts.encode(prompt, False), job.params["logprobs"]
        if k is not None:
            job.prompt_logprobs, cache = prompt_logprobs(self.gen.sm, job.prompt_ids, k)
            self.gen.prefixes.save(job.prompt_ids, cache)
        if job.params["max_new_tokens"]:
            return False
        n, lps = len(job.prompt_ids), [] if k is not None else None
        job.emit(StreamEvent("", [], GenerationResult("", [], n, "length", GenerationStats(prompt_tokens=n), lps)))
        job.emit(END)
        self.metrics.count("length")
        return True

    def round(self) -> None:
        """One decoding round of the batch, if it has requests; on a crash its requests fail, the server lives."""
        size = len(self.batch)
        if not size:
            return
        try:
            for req, event in self.batch.step():
                self._deliver(req, event)
            with self.metrics.lock:
                self.metrics.batch_size, self.metrics.forward_rows = size, self.batch.rows
        except Exception as e:
            reqs = self.batch.active + self.batch.joining
            jobs = [self.jobs[r] for r in reqs if r in self.jobs]
            for req in reqs:
                self.batch.remove(req)
            self.fail(jobs, internal_error(e))

    def _deliver(self, req, event) -> None:
        job = self.jobs[req]
        if event is not None:
            if event.text and not job.answered:
                job.answered = True
                self.metrics.observe(self.metrics.first_token, time.perf_counter() - job.submitted)
            job.streamed += len(event.token_ids)
            job.emit(event)
            if event.result is not None:
                job.streamed = len(event.result.token_ids)
                self.metrics.record(event.result.prompt_tokens, event.result.stats.to_dict())
        if req.done:
            self.finish(req, req.finish)

    def drop_cancelled(self) -> None:
        for req, job in list(self.jobs.items()):
            if job.cancelled.is_set():
                self.batch.remove(req)
                self.finish(req, "cancelled")

    def drop_late(self) -> None:
        now = time.perf_counter()
        late = [(r, j) for r, j in list(self.jobs.items()) if now - j.submitted > self.timeout_s]
        for req, _ in late:
            self.batch.remove(req)
        if late:
            self.fail([j for _, j in late], timeout_error(self.timeout_s), "timeout")

    def cancel_all(self) -> None:
        for req in list(self.jobs):
            self.finish(req, "cancelled")

    def finish(self, req, outcome: str) -> None:
        """End a running request's job normally (`outcome`: its finish reason, or cancelled)."""
        with self.lock:
            job = self.jobs.pop(req)
            self.reserved.pop(req, None)
        self.metrics.add_streamed(job.streamed)
        self.metrics.count(outcome)
        job.emit(END)

    def fail(self, jobs: list[Job], error: ApiError, outcome: str = "error") -> None:
        """Take the jobs out of the running set and end them with `error`."""
        with self.lock:
            for req in [r for r, j in self.jobs.items() if j in jobs]:
                del self.jobs[req]
                self.reserved.pop(req, None)
        fail(jobs, error, self.metrics, outcome)
