"""The jobs being decoded: the engine's `Batch` of the admitted requests, each request's job and its KV
reservation, and what starts, delivers and ends a job. Only the worker thread (worker.Worker) drives them."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from swiftdecode.apps.server.jobs import END, MAX_UNREAD, Job, Prompt
from swiftdecode.apps.server.metrics import Metrics
from swiftdecode.apps.server.protocol import ApiError, too_deep
from swiftdecode.apps.server.reservations import Reservations
from swiftdecode.base.errors import UserError
from swiftdecode.decoding.request import GenerationResult, GenerationStats, StreamEvent

if TYPE_CHECKING:
    from swiftdecode.engine.batch import Batch
    from swiftdecode.engine.generator import Generator

log = logging.getLogger(__name__)

# Running.start's answer for an echo job with more of its prompt to score: it waits, not the jobs behind it
SCORING = object()


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


def grammar(gen: Generator, prompt: Prompt, params: dict) -> dict:
    """The request's `grammar` keyword, compiled once for all its choices (the worker thread only)."""
    if params.get("grammar") is None:
        return {}
    prompt.grammar = prompt.grammar or gen.grammars.compile(params["grammar"])
    return {"grammar": prompt.grammar}


def engine_request(gen: Generator, job: Job):
    """The job's engine Request (UserError on bad input): its prompt encoded and its grammar compiled once for the
    request's choices; at least one new token (an echo may ask for none: it is answered before decoding)."""
    params = job.params["params"]
    at_least_one = {"params": replace(params, max_new_tokens=max(params.max_new_tokens, 1))}
    return gen.request(encoded(gen, job.prompt), **job.params | at_least_one | grammar(gen, job.prompt, job.params))


def waits_to_score(job: Job, batch: Batch) -> bool:
    """An echo whose prompt is still to be scored while the batch scores another's: it waits its turn, holding no
    scorer (its cache) and no KV reservation, and the jobs behind it may start meanwhile."""
    prompt, scorer = job.prompt, job.prompt.scorer
    if job.params["params"].logprobs is None or prompt.logprobs is not None:
        return False
    if scorer is not None and (scorer.done or batch.scorer is scorer):
        return False
    return batch.scorer is not None and not batch.scorer.done


def score(gen: Generator, job: Job, metrics: Metrics, batch: Batch) -> bool | None:
    """Echo with logprobs, the scorer's place free or its own (see `waits_to_score`): the prompt's entries, scored
    once for all its choices, a chunk in each of the batch's rounds (`Batch.scorer`, one prompt at a time, paced
    beside the decoding requests) (None: chunks remain). Once scored, its cache goes to the prefix store under
    the request's salt, so its prefill copies it. A job that asks for no new tokens is answered here (True)."""
    prompt, k = job.prompt, job.params["params"].logprobs
    if k is not None and prompt.logprobs is None:
        scorer = prompt.scorer
        if scorer is None or batch.scorer is not scorer and not scorer.done:  # the place is free: it takes it
            prompt.scorer = batch.scorer = scorer or gen.prompt_scorer(prompt.ids, k)
        if not prompt.scorer.done:
            return None
        batch.scorer = None if batch.scorer is prompt.scorer else batch.scorer
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
    if isinstance(e, RecursionError):  # a request nesting deeper than its checks could follow
        return too_deep()
    log.error("generation failed", exc_info=e)
    return ApiError(500, f"internal error during generation: {type(e).__name__}")


class Running:
    """The jobs being decoded: the engine's `Batch`, each request's job and its KV reservation. Only the worker
    thread calls these methods; it changes `jobs` and `reserved` under `lock`, which the event loop reads under."""

    def __init__(self, gen: Generator, metrics: Metrics, lock: threading.Condition, timeout_s: float, kv_gb: float):
        from swiftdecode.engine.batch import Batch

        self.gen, self.metrics, self.lock, self.timeout_s = gen, metrics, lock, timeout_s
        self.jobs: dict[object, Job] = {}  # Request -> its job, in the order they started
        cost, exact = gen.kv_cost()  # exact: a dropped cache is recomputed exactly, so reservations may grow
        self.reserved = Reservations(int(kv_gb * 2**30), cost, exact, lock)
        self.batch = Batch(gen)
        self.starved, self.waiting = set(), set()  # last round: could not grow their KV; sat out (or a slow reader)

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, job: Job) -> bool | object:
        """Validate and prefill a job; it joins the batch (or fails alone, with an ApiError). False: it must wait
        for KV memory; SCORING (truthy): (echo) more of its prompt is to be scored in the next rounds, inside one
        of its choices' KV reservation, or it waits its turn to be scored; the request is kept on the job."""
        if job.cancelled.is_set():
            self.release(job)
            job.prompt.left(job, self.batch)
            job.emit(END)
            self.metrics.count("cancelled")
            return True
        try:
            if job.request is None:
                self.metrics.observe(self.metrics.queue_wait, time.perf_counter() - job.submitted)
                job.request = engine_request(self.gen, job)
            req, entries = job.request, self.reserved.first(job.request)
            self.release(job)  # a prompt being scored held its entries since the last call
            if job.echo and waits_to_score(job, self.batch):
                return SCORING
            if self.reserved and (not self.reserved.fits(entries) or self.starved):  # the running ones grow first
                return False
            if job.echo and (answered := score(self.gen, job, self.metrics, self.batch)) is not False:
                if answered is None:  # more to score: one of its choices' jobs holds the entries meanwhile
                    if job.prompt.holder in (None, job):
                        job.prompt.holder = job
                        self.reserved.take(req, entries)
                    return SCORING
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
        if not size and self.batch.scorer is None:
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
