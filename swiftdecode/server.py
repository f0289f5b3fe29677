"""`swiftdecode serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Generator.

One model, one `Generator`, one worker thread. Requests wait in a bounded FIFO queue (full -> 429 with
Retry-After) and are generated one at a time off the event loop, so /health and /metrics stay responsive.
Every request is a `gen.stream(...)` call: a client that goes away is noticed between tokens, the engine's
iterator is closed and the worker moves on. The Generator's layer-skip search state is shared by all requests.
"""

import asyncio
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swiftdecode.errors import UserError

if TYPE_CHECKING:
    import argparse

    from fastapi import FastAPI, Request

    from swiftdecode.engine import Generator

log = logging.getLogger("swiftdecode.server")

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
MAX_BODY = 16 * 2**20  # bytes
GRACE_S = 5  # on shutdown, in-flight requests get this long before they are cancelled
MAX_STOP = 4  # as OpenAI
MAX_SEED = 2**63 - 1
UNTIL_EOS = 2**31 - 1  # chat's default max_tokens, as OpenAI: the engine stops at EOS or the end of the context
# Known OpenAI parameters we do not implement: accepted only at their neutral values.
UNSUPPORTED = tuple(
    "logprobs top_logprobs echo suffix logit_bias presence_penalty frequency_penalty tools functions best_of "
    "response_format".split()
)
NEUTRAL = (None, False, 0, "", [], {})
NEUTRAL_EXTRA = {"best_of": (1,), "response_format": ({"type": "text"},)}
ROLES = {"system", "developer", "user", "assistant", "tool"}
KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


class ApiError(Exception):
    """An HTTP error sent in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request parsing (pure, no model needed)

KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v),
        "a number",
    ),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def take(body: dict, key: str, kind: str, default: Any = None) -> Any:
    """body[key] if present and not null, checked to be of `kind` (see KINDS); else default."""
    value = body.get(key)
    if value is None:
        return default
    ok, desc = KINDS[kind]
    if not ok(value):
        raise ApiError(400, f"'{key}' must be {desc}, got {json.dumps(value)[:80]}", key)
    return value


def check(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise ApiError(400, message, param)


def parse_body(raw: bytes) -> dict:
    """Request body -> JSON object, or 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    check(isinstance(body, dict), "request body must be a JSON object")
    return body


def parse_sampling(body: dict, chat: bool) -> dict:
    """OpenAI sampling fields -> Generator.stream keyword arguments."""
    for key in UNSUPPORTED:
        if body.get(key) not in NEUTRAL + NEUTRAL_EXTRA.get(key, ()):
            raise ApiError(400, f"'{key}' is not supported by this server", key)
    check(take(body, "n", "int", 1) == 1, "only n=1 is supported", "n")
    max_tokens = take(body, "max_tokens", "int", UNTIL_EOS if chat else 16)
    if chat:
        max_tokens = take(body, "max_completion_tokens", "int", max_tokens)
    check(max_tokens >= 1, "'max_tokens' must be at least 1", "max_tokens")
    temperature = take(body, "temperature", "number", 1.0)
    check(0 <= temperature <= 2, "'temperature' must be between 0 and 2", "temperature")
    top_p = take(body, "top_p", "number", 1.0)
    check(0 < top_p <= 1, "'top_p' must be in (0, 1]", "top_p")
    top_k = take(body, "top_k", "int", 0)
    check(top_k >= 0, "'top_k' must be >= 0 (0 disables it)", "top_k")
    seed = take(body, "seed", "int")
    check(seed is None or 0 <= seed <= MAX_SEED, f"'seed' must be in [0, {MAX_SEED}]", "seed")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    check(stop is None or isinstance(stop, list), "'stop' must be a string or a list of strings", "stop")
    if stop is not None:
        check(len(stop) <= MAX_STOP, f"'stop' takes at most {MAX_STOP} sequences", "stop")
        check(all(isinstance(s, str) and s for s in stop), "'stop' entries must be non-empty strings", "stop")
    params = dict(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed, stop=stop or None)
    return {"max_new_tokens": max_tokens, **params}


def parse_prompt(body: dict) -> str | list[int]:
    """`prompt` of /v1/completions: a string or a list of token ids (or a one-element list of either)."""
    check("prompt" in body, "missing required field 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    is_ids = isinstance(prompt, list) and all(KINDS["int"][0](t) for t in prompt)
    check(is_ids, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    return prompt


def parse_messages(body: dict) -> list[dict]:
    """`messages` of /v1/chat/completions -> [{"role", "content": str}] (text content parts are joined)."""
    messages = body.get("messages")
    check(messages is not None, "missing required field 'messages'", "messages")
    check(isinstance(messages, list) and len(messages) > 0, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        check(isinstance(m, dict), f"{param} must be an object", param)
        role, content = m.get("role"), m.get("content")
        check(role in ROLES, f"{param}.role must be one of {sorted(ROLES)}", f"{param}.role")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            check(
                all(isinstance(p, str) for p in parts),
                f"{param}.content: only text parts are supported",
                param,
            )
            content = "".join(parts)
        check(isinstance(content, str), f"{param}.content must be a string or a list of text parts", param)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ---------------------------------------------------------------- metrics


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds: interactive to long prompts


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, sum and count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
        self.total += value

    def samples(self) -> list[tuple[str, float]]:
        edges = [*(f"{b:g}" for b in self.buckets), "+Inf"]
        cumulative = [sum(self.counts[: i + 1]) for i in range(len(self.counts))]
        return [(f'_bucket{{le="{e}"}}', c) for e, c in zip(edges, cumulative, strict=True)] + [
            ("_sum", self.total),
            ("_count", sum(self.counts)),
        ]


@dataclass
class Metrics:
    """Server-wide counters, updated by the worker thread and read by /metrics (guarded by `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    http: dict[tuple[str, int], int] = field(default_factory=dict)  # (path, status) -> count
    finished: dict[str, int] = field(default_factory=dict)  # finish reason / cancelled / error -> count
    prompt_tokens: int = 0
    new_tokens: int = 0  # every token streamed, cancelled requests included
    done_tokens: int = 0  # tokens of completed requests (tokens/s numerator)
    gen_seconds: float = 0.0
    tree_rounds: int = 0
    accepted: float = 0.0  # sum over requests of mean_accepted_tokens * tree_rounds
    accept_rate: float = 0.0  # sum over requests of acceptance_rate * tree_rounds
    round_kinds: dict[str, int] = field(default_factory=dict)  # rounds by kind (draft, ngram, plain)
    round_seconds: dict[str, float] = field(default_factory=dict)  # ... their seconds
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted draft tokens by drafter
    last: dict = field(default_factory=dict)  # stats.to_dict() of the last completed request
    queue_wait: Histogram = field(default_factory=Histogram)  # submission to start of prefill
    first_token: Histogram = field(default_factory=Histogram)  # submission to first streamed text
    batch_size: int = 0  # requests in the last round
    forward_rows: int = 0  # rows of the last batched forward (0: the last round ran alone)

    def observe(self, histogram: Histogram, value: float) -> None:
        with self.lock:
            histogram.observe(value)

    def count(self, key: str) -> None:
        with self.lock:
            self.finished[key] = self.finished.get(key, 0) + 1

    def record(self, prompt_tokens: int, stats: dict) -> None:
        rounds = stats.get("tree_rounds") or 0
        with self.lock:
            for total, key in ((self.round_kinds, "round_kinds"), (self.round_seconds, "round_seconds")):
                for k, v in stats[key].items():
                    total[k] = total.get(k, 0) + v
            for k, v in stats["accepted_by_source"].items():
                self.accepted_by_source[k] = self.accepted_by_source.get(k, 0) + v
            self.prompt_tokens += prompt_tokens
            self.done_tokens += stats["new_tokens"]
            self.gen_seconds += stats["wall_s"]
            self.tree_rounds += rounds
            self.accepted += (stats.get("mean_accepted_tokens") or 0.0) * rounds
            self.accept_rate += (stats.get("acceptance_rate") or 0.0) * rounds
            self.last = stats

    def mean_seconds(self) -> float:
        with self.lock:
            n = sum(self.finished.values())
            return self.gen_seconds / n if n else 1.0

    def render(self, queued: int, running: int, model: str, method: str) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP swiftdecode_{name} {help_}", f"# TYPE swiftdecode_{name} {kind}"])
            lines.extend(f"swiftdecode_{name}{labels} {value:g}" for labels, value in samples)

        with self.lock:
            rounds, last = self.tree_rounds, self.last
            skip = last.get("skip", {})
            metric(
                "info",
                "gauge",
                "Served model and decoding method.",
                [(f'{{model="{model}",method="{method}"}}', 1)],
            )
            metric(
                "http_requests_total",
                "counter",
                "HTTP requests by path and status.",
                [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.http.items())],
            )
            metric(
                "requests_total",
                "counter",
                "Generations by outcome (stop, length, cancelled, error).",
                [(f'{{outcome="{k}"}}', n) for k, n in sorted(self.finished.items())],
            )
            metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of completed requests.",
                [("", self.prompt_tokens)],
            )
            metric(
                "generated_tokens_total",
                "counter",
                "Tokens generated (cancelled requests included).",
                [("", self.new_tokens)],
            )
            metric(
                "generation_seconds_total",
                "counter",
                "Wall time of completed generations.",
                [("", self.gen_seconds)],
            )
            tps = self.done_tokens / self.gen_seconds if self.gen_seconds else 0.0
            metric("tokens_per_second", "gauge", "Tokens per second over completed generations.", [("", tps)])
            metric(
                "rounds_total",
                "counter",
                "Decoding rounds of completed requests by kind (draft, ngram, plain).",
                [(f'{{kind="{k}"}}', n) for k, n in sorted(self.round_kinds.items())],
            )
            metric(
                "round_seconds_total",
                "counter",
                "Seconds spent in decoding rounds of each kind.",
                [(f'{{kind="{k}"}}', v) for k, v in sorted(self.round_seconds.items())],
            )
            metric(
                "accepted_tokens_total",
                "counter",
                "Accepted draft tokens by the drafter that proposed them (skip, ngram, both).",
                [(f'{{source="{k}"}}', n) for k, n in sorted(self.accepted_by_source.items())],
            )
            metric(
                "mean_accepted_tokens",
                "gauge",
                "Mean tokens accepted per round (all requests).",
                [("", self.accepted / rounds if rounds else 1.0)],
            )
            metric(
                "acceptance_rate",
                "gauge",
                "Draft acceptance rate (round-weighted, all requests).",
                [("", self.accept_rate / rounds if rounds else 0.0)],
            )
            metric(
                "skip_layers",
                "gauge",
                "Current skip-set size (layers skipped while drafting).",
                [(f'{{kind="{k}"}}', len(skip.get(k, []))) for k in ("attn", "mlp")],
            )
            metric(
                "draft_sparsity_level",
                "gauge",
                "Activation-sparsity level of the draft's MLPs (0 = dense).",
                [("", skip.get("sparsity", 0))],
            )
            metric(
                "search_state",
                "gauge",
                "Layer-set search state (1 = current).",
                [(f'{{state="{last["search"]}"}}', 1)] if "search" in last else [],
            )
            metric("batch_size", "gauge", "Requests in the last decoding round.", [("", self.batch_size)])
            metric(
                "forward_rows",
                "gauge",
                "Rows of the last batched forward (0 = the last round ran alone).",
                [("", self.forward_rows)],
            )
            for name, hist, what in (
                ("queue_wait_seconds", self.queue_wait, "Time from submission to start of prefill."),
                ("time_to_first_token_seconds", self.first_token, "Time from submission to the first text."),
            ):
                lines.extend([f"# HELP swiftdecode_{name} {what}", f"# TYPE swiftdecode_{name} histogram"])
                lines.extend(f"swiftdecode_{name}{suffix} {value:g}" for suffix, value in hist.samples())
        metric("queue_depth", "gauge", "Requests waiting in the queue.", [("", queued)])
        metric("requests_running", "gauge", "Requests being generated (decoding together).", [("", running)])
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the batching generation worker

END = object()  # last item of every job's event queue
DEFAULT_MAX_BATCH = 8  # requests decoding together; see README (Serving) for the measured throughput curve
DEFAULT_KV_GB = 4.0  # KV cache the running requests may reserve (each: prompt + max tokens + a round's slack)
DEFAULT_TIMEOUT_S = 600.0  # a request still queued or generating this long after submission ends with HTTP 504


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

    def emit(self, item: object) -> None:
        """Thread-safe put into `events` (no-op once the event loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancelled.set()


class Worker:
    """One daemon thread decoding up to `max_batch` jobs together (`Batch`: one forward per round for all of
    them), admitted in arrival order; at most `max_queue` more wait, beyond that 429. A cancelled job (client
    gone) leaves the batch before the next round."""

    def __init__(
        self,
        gen: "Generator",
        max_queue: int,
        metrics: Metrics,
        max_batch: int = DEFAULT_MAX_BATCH,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_gb: float = DEFAULT_KV_GB,
    ):
        from swiftdecode.batch import Batch

        self.gen, self.max_queue, self.metrics, self.max_batch = gen, max_queue, metrics, max_batch
        self.timeout_s, self.kv_bytes, self.per_token = timeout_s, int(kv_gb * 2**30), gen.sm.kv_bytes_per_token()
        self.reserved: dict[object, int] = {}  # Request -> KV bytes it may grow to
        self.batch = Batch(gen)
        self.pending: deque[Job] = deque()
        self.running: dict[object, Job] = {}  # Request -> its job
        self.starting = 0  # jobs taken from the queue, being validated and prefilled
        self.cond = threading.Condition()
        self.closed = False
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

    def depth(self) -> tuple[int, int]:
        with self.cond:
            return len(self.pending), len(self.running) + self.starting

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for job in self.running.values():
                job.cancelled.set()
            for job in self.pending:
                job.cancelled.set()
                job.emit(ApiError(503, "server shutting down"))
                job.emit(END)
            self.pending.clear()
            self.cond.notify()
        self.thread.join(timeout=30)

    def _loop(self) -> None:
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
                self._fail(late, self._timeout_error(), "timeout")
            with self.cond:
                admit = []
                while self.pending and len(self.running) + len(admit) < self.max_batch:
                    admit.append(self.pending.popleft())
                self.starting = len(admit)
            for k, job in enumerate(admit):
                started = self._start(job)
                with self.cond:
                    self.starting -= 1
                    if not started:  # waits for KV memory: it and those behind it go back, in order
                        self.pending.extendleft(reversed(admit[k:]))
                        self.starting = 0
                if not started:
                    break
            self._drop_cancelled()
            self._drop_late()
            if len(self.batch):
                self._round()
        for req in list(self.running):
            self._finish(req, "cancelled")

    def _start(self, job: Job) -> bool:
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
            with self.cond:
                self.running[req] = job
                self.reserved[req] = need
            self._deliver(req, self.batch.add(req))
        except ApiError as e:
            self._fail([job], e)
        except UserError as e:
            self._fail([job], ApiError(e.status, str(e)))
        except Exception as e:  # never let one request take the server down
            log.exception("generation failed")
            self._fail([job], ApiError(500, f"internal error during generation: {type(e).__name__}"))
        return True

    def _round(self) -> None:
        size = len(self.batch)
        try:
            for req, event in self.batch.step():
                self._deliver(req, event)
            with self.metrics.lock:
                self.metrics.batch_size, self.metrics.forward_rows = size, self.batch.rows
        except Exception as e:  # the batch's requests fail; the server and later requests carry on
            log.exception("generation failed")
            reqs = self.batch.active + self.batch.joining
            jobs = [self.running[r] for r in reqs if r in self.running]
            for req in reqs:
                self.batch.remove(req)
            self._fail(jobs, ApiError(500, f"internal error during generation: {type(e).__name__}"))

    def _deliver(self, req, event) -> None:
        job = self.running[req]
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
            self._finish(req, req.finish)

    def _drop_cancelled(self) -> None:
        for req, job in list(self.running.items()):
            if job.cancelled.is_set():
                self.batch.remove(req)
                self._finish(req, "cancelled")

    def _timeout_error(self) -> ApiError:
        return ApiError(
            504, f"generation exceeded the server's request timeout ({self.timeout_s:g} s)", None, "timeout"
        )

    def _drop_late(self) -> None:
        now = time.perf_counter()
        late = [(r, j) for r, j in list(self.running.items()) if now - j.submitted > self.timeout_s]
        for req, _ in late:
            self.batch.remove(req)
        if late:
            self._fail([j for _, j in late], self._timeout_error(), "timeout")

    def _finish(self, req, outcome: str) -> None:
        with self.cond:
            job = self.running.pop(req)
            self.reserved.pop(req, None)
        with self.metrics.lock:
            self.metrics.new_tokens += job.streamed
        self.metrics.count(outcome)
        job.emit(END)

    def _fail(self, jobs: list[Job], error: ApiError, outcome: str = "error") -> None:
        with self.cond:
            for req in [r for r, j in self.running.items() if j in jobs]:
                del self.running[req]
                self.reserved.pop(req, None)
        for job in jobs:
            with self.metrics.lock:
                self.metrics.new_tokens += job.streamed
            job.emit(error)
            job.emit(END)
            self.metrics.count(outcome)


# ---------------------------------------------------------------- HTTP layer


def held_back(text: str, stop: list[str] | None) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (it may yet become one)."""
    return max((k for s in stop or () for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _usage(res: Any) -> dict:
    n = len(res.token_ids)
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n}


class Disconnected(Exception):
    """The client went away while we waited for its job."""


async def next_event(job: Job, request: "Request", poll_s: float = 0.25) -> object:
    """Next item of the job's channel; raises Disconnected if the client hangs up meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=poll_s)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise Disconnected from None


def create_app(
    gen: "Generator",
    model_id: str,
    *,
    max_queue: int = 64,
    max_batch: int = DEFAULT_MAX_BATCH,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kv_gb: float = DEFAULT_KV_GB,
    api_key: str | None = None,
) -> "FastAPI":
    """The FastAPI app serving `gen` as model `model_id`; the worker thread stops on app shutdown."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    metrics = Metrics()
    worker: Worker | None = None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal worker
        worker = Worker(gen, max_queue, metrics, max_batch, timeout_s, kv_gb)
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="swiftdecode", lifespan=lifespan)

    def error_response(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(ApiError(500, f"internal server error: {type(e).__name__}"))

    def count_status(asgi_app: Callable) -> Callable:
        """Pure ASGI middleware counting responses by (path, status) for /metrics."""

        async def counted(scope: dict, receive: Callable, send: Callable) -> None:
            async def send_counted(message: dict) -> None:
                if message["type"] == "http.response.start":
                    key = (scope["path"] if scope["path"] in KNOWN_PATHS else "other", message["status"])
                    with metrics.lock:
                        metrics.http[key] = metrics.http.get(key, 0) + 1
                await send(message)

            await asgi_app(scope, receive, send_counted if scope["type"] == "http" else send)

        return counted

    app.add_middleware(count_status)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(
                401, "invalid or missing API key (send 'Authorization: Bearer KEY')", None, "invalid_api_key"
            )

    async def read_request(request: Request) -> dict:
        authorize(request)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"request body exceeds {MAX_BODY // 2**20} MiB")
        body = parse_body(bytes(raw))
        model = take(body, "model", "str")
        check(model is not None, "missing required field 'model'", "model")
        if model != model_id:
            raise ApiError(
                404, f"The model '{model}' does not exist; this server serves '{model_id}'", "model", "model_not_found"
            )
        return body

    async def run_job(request: Request, job: Job) -> AsyncIterator[Any]:
        """Queue the job and yield its engine events; cancels the job if the client leaves or we stop early."""
        worker.submit(job)
        try:
            while (item := await next_event(job, request)) is not END:
                if isinstance(item, ApiError):
                    raise item
                yield item
        finally:
            worker.cancel(job)

    async def complete(request: Request, chat: bool) -> Any:
        body = await read_request(request)
        prompt = parse_messages(body) if chat else parse_prompt(body)
        params = parse_sampling(body, chat)
        stream = take(body, "stream", "bool", False)
        include_usage = take(take(body, "stream_options", "dict", {}), "include_usage", "bool", False)
        job = Job(prompt, chat, params, asyncio.get_running_loop())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_id,
        }
        events = run_job(request, job)
        try:
            first = await anext(events)  # surfaces queue/parameter errors as a proper HTTP status
        except Disconnected:
            return PlainTextResponse("", status_code=499)
        if stream:
            sse = sse_chunks(head, chat, include_usage, params["stop"], first, events)
            return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            res = first.result
            async for ev in events:
                res = ev.result
        except Disconnected:
            return PlainTextResponse("", status_code=499)
        text = {"message": {"role": "assistant", "content": res.text}} if chat else {"text": res.text}
        choice = {"index": 0, **text, "logprobs": None, "finish_reason": res.finish_reason}
        return {**head, "choices": [choice], "usage": _usage(res), "swiftdecode": res.stats.to_dict()}

    async def sse_chunks(
        head: dict, chat: bool, include_usage: bool, stop: list[str] | None, first: Any, events: AsyncIterator
    ) -> Any:
        """OpenAI streaming chunks as server-sent events, ending with `data: [DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        if chat:
            yield chunk("", None, role=True)
        ev, text, sent = first, "", 0  # text streamed by the engine; sent: how much of it went out
        try:
            while ev.result is None:
                text += ev.text
                safe = len(text) - held_back(text, stop)  # never send what may turn out to be a stop string
                if safe > sent:
                    yield chunk(text[sent:safe], None)
                    sent = safe
                ev = await anext(events)
            res = ev.result
            if len(res.text) > sent:
                yield chunk(res.text[sent:], None)
            yield chunk(None, res.finish_reason)
            if include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(res)})}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except (Disconnected, StopAsyncIteration):
            return  # client gone (the job is cancelled by run_job) or stream ended without a result
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health() -> dict:
        queued, running = worker.depth()
        return {"status": "ok", "model": model_id, "queued": queued, "running": running}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(*worker.depth(), model=model_id, method=gen.method)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "swiftdecode"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict:
        authorize(request)
        if name != model_id:
            raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    return app


# ---------------------------------------------------------------- CLI


def add_arguments(parser: "argparse.ArgumentParser") -> None:
    from swiftdecode import METHODS
    from swiftdecode.models import add_model_argument

    add_model_argument(parser)
    parser.add_argument("--method", default="swift", choices=METHODS, help="decoding method (default: swift)")
    parser.add_argument("--fast-path", default="auto", help="CPU matmul path: auto (default), torch, ...")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests decoded together, one forward per round (default: {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; beyond -> 429")
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=DEFAULT_KV_GB,
        help="KV cache the running requests may reserve (prompt + max tokens each); a request waits for room, "
        f"one that can never fit gets 413 (default: {DEFAULT_KV_GB:g})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds a request may take from arrival, queue included; beyond -> 504 (default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SWIFTDECODE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $SWIFTDECODE_API_KEY; none = open)",
    )


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket (fails fast, before loading the model, if the address is taken)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args: "argparse.Namespace") -> int:
    import uvicorn

    import swiftdecode
    from swiftdecode.engine import Generator

    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not args.request_timeout > 0:
        raise UserError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if not args.max_kv_gb > 0:
        raise UserError(f"--max-kv-gb must be > 0, got {args.max_kv_gb}")
    sock = listen(args.host, args.port)
    model, tokenizer = swiftdecode.load(
        args.model, cache_dir=args.cache_dir, fast_path=args.fast_path, weights=args.weights
    )
    gen = Generator(model, tokenizer, method=args.method)
    app = create_app(
        gen,
        args.model,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        timeout_s=args.request_timeout,
        kv_gb=args.max_kv_gb,
        api_key=args.api_key,
    )
    print(f"swiftdecode: serving {args.model} ({args.method}) on http://{args.host}:{sock.getsockname()[1]}/v1")
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=GRACE_S)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
