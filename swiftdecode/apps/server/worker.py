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
from typing import TYPE_CHECKING

from swiftdecode.apps.server.heap import release_free_memory
from swiftdecode.apps.server.jobs import END, Job
from swiftdecode.apps.server.metrics import Metrics
from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.apps.server.running import SCORING, Running, fail, timeout_error
from swiftdecode.kernels.openmp import release_thread_pool

if TYPE_CHECKING:
    from swiftdecode.engine.generator import Generator

log = logging.getLogger(__name__)

IDLE_S = 0.01  # how long the worker sleeps when every running request waits for its reader
DEFAULT_MAX_BATCH = 8  # requests decoding together; see README (Serving) for the measured throughput curve
DEFAULT_KV_GB = 4.0  # KV cache the running requests may reserve (each: prompt + max tokens + a round's slack)
DEFAULT_TIMEOUT_S = 600.0  # a request still queued or generating this long after submission ends with HTTP 504
JOIN_S = 30  # on close, how long to wait for the worker thread to finish its round
SHUTTING_DOWN = "server shutting down"


def take_late(pending: deque[Job], timeout_s: float) -> list[Job]:
    """The waiting jobs submitted more than `timeout_s` ago, taken out of `pending`."""
    late = [j for j in pending if time.perf_counter() - j.submitted > timeout_s]
    for job in late:
        pending.remove(job)
    return late


def expire(running: Running, late: list[Job], timeout_s: float, metrics: Metrics) -> None:
    """End queued jobs past the request timeout (504), with any KV entries they hold and any prompt they score."""
    for job in late:
        running.release(job)
        job.prompt.left(job, running.batch)
    if late:
        fail(late, timeout_error(timeout_s), metrics, "timeout")


def end_waiting(pending: deque[Job], error: ApiError) -> None:
    """End the waiting jobs with `error` and empty the queue (under the worker's `cond`)."""
    for job in pending:
        job.cancelled.set()
        job.emit(error)
        job.emit(END)
    pending.clear()


def requests_in(pending: deque[Job]) -> int:
    """Requests waiting (under the worker's `cond`): a request's choices take one place in the queue together."""
    return len({job.prompt for job in pending})


def queue_full(running: int, queued: int, wait_s: int) -> ApiError:
    message = f"server busy: {running} requests running, {queued} queued, retry later"
    return ApiError(429, message, None, "queue_full", {"Retry-After": str(wait_s)})


class Worker:
    """One daemon thread decoding up to `max_batch` jobs together, admitted in arrival order; at most `max_queue`
    more requests wait (see `requests_in`), beyond that 429. A cancelled job (client gone) leaves the batch before
    the next round. `submit`, `cancel`, `depth` and `close` are called from the event loop."""

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
        self.closed, self.draining = False, False  # draining: the server is stopping (see `drain`)
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
            if self.closed or self.draining or not self.alive:
                raise ApiError(503, "the generation worker has stopped" if not self.alive else SHUTTING_DOWN)
            free, queued = max(self.max_batch - len(self.running) - self.starting, 0), requests_in(self.pending)
            if not job.prompt.queued and queued >= self.max_queue + free:
                mean_s, ahead = self.metrics.mean_seconds(), queued - free + 1
                raise queue_full(len(self.running), queued, max(1, round(mean_s * ahead / self.max_batch)))
            job.prompt.queued = True
            self.pending.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or take a running one out of the batch before its next round. A waiting job that
        holds KV entries (an echo between its scored chunks) stays queued: the worker releases them as it ends it."""
        job.cancelled.set()
        with self.cond:
            if job in self.pending and job.request is None:
                self.pending.remove(job)
                self.metrics.count("cancelled")
            self.cond.notify()

    def depth(self) -> tuple[int, int, int, dict[str, int]]:
        """(requests queued, jobs running or starting, KV cache bytes the running ones have reserved, the engine's
        bytes kept across requests: `Generator.memory`)."""
        with self.cond:
            reserved, queued = self.running.reserved.bytes, requests_in(self.pending)
            return queued, len(self.running) + self.starting, reserved, self.running.gen.memory()

    def drain(self, seconds: float) -> None:
        """The server is stopping (SIGTERM, Ctrl-C): no new jobs (503), the waiting ones end with 503 now, the
        running ones may finish within `seconds`, then end with 503 (a stream: an error event and [DONE]).
        Callable from any thread."""
        with self.cond:
            self.draining = True
            end_waiting(self.pending, ApiError(503, SHUTTING_DOWN))
            self.cond.notify()
        timer = threading.Timer(seconds, self._end_running, [ApiError(503, SHUTTING_DOWN)])
        timer.daemon = True  # not the worker thread: it may be inside a long round
        timer.start()

    def close(self) -> None:
        self._stop(ApiError(503, SHUTTING_DOWN))
        self.thread.join(timeout=JOIN_S)

    def _stop(self, error: ApiError) -> None:
        """No more jobs: running ones are cancelled, waiting ones end with `error`."""
        with self.cond:
            self.closed = True
            end_waiting(self.pending, error)
            self.cond.notify()
        self._end_running(None)

    def _end_running(self, error: ApiError | None) -> None:
        """Cancel the running jobs (the worker drops them after its round); with `error`, end their channels with
        it now."""
        with self.cond:
            for job in self.running.jobs.values():
                job.cancelled.set()
                if error is not None:
                    job.emit(error)
                    job.emit(END)

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
                late = take_late(self.pending, self.timeout_s)
            expire(self.running, late, self.timeout_s, self.metrics)
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
        """Start waiting jobs, in order, while the batch has room; one that must wait for KV memory goes back to
        the queue's front with those behind it. An echo with more of its prompt to score goes back too, taking no
        room: those behind it may start meanwhile."""
        back = []  # echo jobs with more to score, in order
        while True:
            with self.cond:
                if not self.pending or len(self.running) >= self.max_batch:
                    break
                job, self.starting = self.pending.popleft(), 1
            started = self.running.start(job)
            with self.cond:
                self.starting = 0
                if not started:
                    self.pending.appendleft(job)
                    break
            if started is SCORING:
                back.append(job)
        with self.cond:
            self.pending.extendleft(reversed(back))
