"""The generation worker: one thread decoding the admitted requests together, off the event loop.

Requests wait in a bounded FIFO queue (full -> 429 with Retry-After) and are admitted in arrival order into one
`Batch` (one forward per round for all of them), as long as the batch has room and their KV cache fits. Each
job's events go back to its event loop through `Job.events`, ending with END.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from swiftdecode.apps.server.heap import release_free_memory
from swiftdecode.apps.server.jobs import END, MAX_UNREAD, Job, Prompt
from swiftdecode.apps.server.metrics import Metrics
from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.apps.server.reservations import Reservations
from swiftdecode.base.errors import UserError
from swiftdecode.decoding.request import GenerationResult, GenerationStats, StreamEvent
from swiftdecode.kernels.openmp import release_thread_pool

if TYPE_CHECKING:
    from swiftdecode.engine.generator import Generator

log = logging.getLogger(__name__)

IDLE_S = 0.01  # how long the worker sleeps when every running request waits for its reader
DEFAULT_MAX_BATCH = 8  # requests decoding together; see README (Serving) for the measured throughput curve
DEFAULT_KV_GB = 4.0  # KV cache the running requests may reserve (each: prompt + max tokens + a round's slack)
DEFAULT_TIMEOUT_S = 600.0  # a request still queued or generating this long after submission ends with HTTP 504
JOIN_S = 30  # on close, how long to wait for the worker thread to finish its round


def fail(jobs: list[Job], error: ApiError, metrics: Metrics, outcome: str = "error") -> None:
    """End each job with `error` (none of them is running)."""
    for job in jobs:
        metrics.add_streamed(job.streamed)
        job.emit(error)
        job.emit(END)
        metrics.count(outcome)


def encoded(gen: Generator, prompt: Prompt) -> list[int]:
    """The prompt's ids, encoded by the first of its choices to start (the tokenizer: the worker thread only)."""
    if prompt.ids is None:
        given = prompt.given
        prompt.ids = gen.chat_ids(given, prompt.tools) if prompt.chat else gen.encode(given)
    return prompt.ids


def score(gen: Generator, job: Job, metrics: Metrics) -> bool | None:
    """Echo with logprobs: the prompt's entries, scored once for all its choices, one chunk a call so that a long
    prompt is scored between the others' rounds (None: chunks remain). Once scored, its cache goes to the prefix
    store under the request's salt, so its prefill copies it. A job that asks for no new tokens is answered here
    (True)."""
    prompt, k = job.prompt, job.params["params"].logprobs
    if k is not None and prompt.logprobs is None:
        prompt.scorer = prompt.scorer or gen.prompt_scorer(prompt.ids, k)
        prompt.scorer.step()
        if not prompt.scorer.done:
            return None
        prompt.logprobs, cache, prompt.scorer = prompt.scorer.entries, prompt.scorer.cache, None
        gen.save_prefix(prompt.ids, cache, job.request.salt)
    if job.params["params"].max_new_tokens:
        return False
    n, lps = len(prompt.ids), [] if k is not None else None
    job.emit(StreamEvent("", [], GenerationResult("", [], n, "length", GenerationStats(prompt_tokens=n), lps)))
    job.emit(END)
    metrics.count("length")
    return True


def deliver(job: Job, event, metrics: Metrics) -> None:
    """Stream one of a running request's events to its job; the first text and the final result are metered."""
    if event.text and not job.answered:
        job.answered = True
        metrics.observe(metrics.first_token, time.perf_counter() - job.submitted)
    job.streamed += len(event.token_ids)
    job.emit(event)
    if event.result is not None:
        job.streamed = len(event.result.token_ids)
        metrics.record(event.result.prompt_tokens, event.result.stats.to_dict())


def timeout_error(timeout_s: float) -> ApiError:
    return ApiError(504, f"generation exceeded the server's request timeout ({timeout_s:g} s)", None, "timeout")


def request_error(e: Exception) -> ApiError:
    """The ApiError ending a request whose own work raised `e`: the engine's UserError with its status, else 500."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, UserError):
        return ApiError(e.status, str(e), getattr(e, "field", None))
    log.error("generation failed", exc_info=e)
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
        self.failure: Exception | None = None  # what stopped the thread (warm-up included), if anything did
        self.thread = threading.Thread(target=self._loop, name="swiftdecode-worker", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.failure is None and self.thread.is_alive()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closed or not self.alive:
                raise ApiError(503, "server shutting down" if self.closed else "the generation worker has stopped")
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

    def depth(self) -> tuple[int, int, int, dict[str, int]]:
        """(jobs queued, jobs running or starting, KV cache bytes the running ones have reserved, the engine's
        bytes kept across requests: `Generator.memory`)."""
        with self.cond:
            reserved = self.running.reserved.bytes
            return len(self.pending), len(self.running) + self.starting, reserved, self.running.gen.memory()

    def close(self) -> None:
        self._stop(ApiError(503, "server shutting down"))
        self.thread.join(timeout=JOIN_S)

    def _stop(self, error: ApiError) -> None:
        """No more jobs: running ones are cancelled, waiting ones end with `error`."""
        with self.cond:
            self.closed = True
            for job in self.running.jobs.values():
                job.cancelled.set()
            for job in self.pending:
                job.cancelled.set()
                job.emit(error)
                job.emit(END)
            self.pending.clear()
            self.cond.notify()

    def _loop(self) -> None:
        try:  # this thread runs the forwards: its first one is not a request's (see warm_up)
            self.running.gen.warm_up()
            self.warm.set()
            self._serve()
        except Exception as e:  # a bug: /health says so, new requests get 503, the waiting ones end
            log.exception("the generation worker stopped")
            self.failure = e
            self._stop(ApiError(503, "the generation worker has stopped"))
            self.running.cancel_all()
        finally:
            self.warm.set()

    def _serve(self) -> None:
        """Admit, drop and decode until closed."""
        while True:
            with self.cond:
                idle = not self.pending and not self.running and not self.closed
            if idle:  # once per busy -> idle turn: what the finished requests freed goes back to the system
                release_free_memory()
            with self.cond:
                while not self.pending and not self.running and not self.closed:
                    self.cond.wait()
                if self.closed:
                    break
                late = [j for j in self.pending if time.perf_counter() - j.submitted > self.timeout_s]
                for job in late:
                    self.pending.remove(job)
            for job in late:
                self.running.release(job)
            if late:
                fail(late, timeout_error(self.timeout_s), self.metrics, "timeout")
            self._admit()
            self.running.drop_cancelled()
            self.running.drop_late()
            if preempted := self.running.round():
                with self.cond:
                    self.pending.extendleft(reversed(preempted))
            if self.running.idle():  # every running job waits for its reader: wait for one to read
                time.sleep(IDLE_S)
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
        from swiftdecode.engine.batch import Batch

        self.gen, self.metrics, self.lock, self.timeout_s = gen, metrics, lock, timeout_s
        self.jobs: dict[object, Job] = {}  # Request -> its job, in the order they started
        per_token, exact = gen.kv_cost()  # exact: a dropped cache is recomputed exactly, so reservations may grow
        self.reserved = Reservations(int(kv_gb * 2**30), per_token, exact, lock)
        self.batch = Batch(gen)
        self.starved: set = set()  # requests that could not grow their KV reservation in the last round
        self.waiting: set = set()  # requests that sat out the last round (starved, or their reader lags)

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, job: Job) -> bool:
        """Validate and prefill a job; it joins the batch (or fails alone, with an ApiError). False: it must wait
        for KV memory, or (echo) more of its prompt is to be scored after the others' next round; the request is
        kept on the job. With echo the prompt is scored first, a chunk a call, inside the request's KV
        reservation."""
        if job.cancelled.is_set():
            self.release(job)
            job.emit(END)
            self.metrics.count("cancelled")
            return True
        try:
            if job.request is None:
                self.metrics.observe(self.metrics.queue_wait, time.perf_counter() - job.submitted)
                params = job.params["params"]  # echo may ask for no new tokens: then the request takes one
                at_least_one = {"params": replace(params, max_new_tokens=max(params.max_new_tokens, 1))}
                job.request = self.gen.request(encoded(self.gen, job.prompt), **job.params | at_least_one)
            req, entries = job.request, self.reserved.first(job.request)
            self.release(job)  # a prompt being scored held its entries since the last call
            if self.reserved and (entries > self.reserved.free() or self.starved):  # the running ones grow first
                return False
            if job.echo and (answered := score(self.gen, job, self.metrics)) is not False:
                if answered is None:  # more to score after the others' next round: it keeps its entries meanwhile
                    self.reserved.take(req, entries)
                    return False
                return True
            with self.lock:
                self.jobs[req] = job
            self.reserved.take(req, entries)
            self._deliver(req, self.batch.add(req))
        except Exception as e:  # never let one request take the server down
            self.fail([job], request_error(e))
        return True

    def release(self, job: Job) -> None:
        """Drop the KV entries a queued job holds (an echo prompt between two of its scored chunks)."""
        if job.request is not None and job.request not in self.jobs:
            self.reserved.drop(job.request)

    def round(self) -> list[Job]:
        """One decoding round of the batch, if it has requests. A request whose own part of the round raised fails
        alone; if the shared forward crashes, the batch's requests fail and the server lives. Returns the jobs
        preempted for KV memory (see `preempt`), for the queue."""
        size = len(self.batch)
        self.starved = self.reserved.grow(list(self.jobs))
        self.waiting = self.held() | self.starved  # these sit out the round
        if not size:
            return []
        if preempted := self.preempt():
            return preempted
        try:
            for req, event in self.batch.step(self.waiting):
                if isinstance(event, Exception):
                    self.fail([self.jobs[req]], request_error(event))
                else:
                    self._deliver(req, event)
            with self.metrics.lock:
                self.metrics.batch_size, self.metrics.forward_rows = size, self.batch.rows
        except Exception as e:
            reqs = self.batch.active + self.batch.joining
            jobs = [self.jobs[r] for r in reqs if r in self.jobs]
            for req in reqs:
                self.batch.remove(req)
            self.fail(jobs, request_error(e))
        return []

    def held(self) -> set:
        """Requests whose readers have fallen MAX_UNREAD events behind: they sit out this round."""
        with self.lock:
            return {req for req, job in self.jobs.items() if job.unread > MAX_UNREAD}

    def preempt(self) -> list[Job]:
        """When every decoding request sits out and some wait for KV memory, nothing would ever free it: the one
        that started last among those leaves the batch, its cache is dropped (the others may grow into it), and
        its job goes back to the queue (returned), to prefill its context again when there is room. Lossless: the
        same entries are recomputed."""
        if not self.starved or self.batch.joining or any(r not in self.waiting for r in self.batch.active):
            return []
        req = [r for r in self.jobs if r in self.starved][-1]
        self.batch.remove(req)
        with self.lock:
            job = self.jobs.pop(req)
        self.reserved.drop(req)
        req.evict()
        with self.metrics.lock:
            self.metrics.preemptions += 1
        return [job]

    def idle(self) -> bool:
        """Whether every running request sat out the last round (nothing was decoded: the worker would spin)."""
        return bool(self.jobs) and not self.batch.joining and self.waiting >= set(self.batch.active)

    def _deliver(self, req, event) -> None:
        if event is not None:
            deliver(self.jobs[req], event, self.metrics)
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
        self.reserved.drop(req)
        self.metrics.add_streamed(job.streamed)
        self.metrics.count(outcome)
        job.emit(END)

    def fail(self, jobs: list[Job], error: ApiError, outcome: str = "error") -> None:
        """Take the jobs out of the running set and end them with `error`."""
        with self.lock:
            for req in [r for r, j in self.jobs.items() if j in jobs]:
                del self.jobs[req]
                self.reserved.drop(req)
        fail(jobs, error, self.metrics, outcome)
