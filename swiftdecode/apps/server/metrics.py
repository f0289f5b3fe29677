"""Server-wide counters and histograms, and their Prometheus text exposition (GET /metrics)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds: interactive to long prompts

Samples = list[tuple[str, float]]  # (labels or suffix, value) of one metric family
Family = tuple[str, str, str, Samples]  # (name, type, help, samples)


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, sum and count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
        self.total += value

    def samples(self) -> Samples:
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
    cached_prompt_tokens: int = 0  # ... of them, copied from the prefix cache
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
    preemptions: int = 0  # running requests whose KV cache was dropped for memory (recomputed on their return)

    def observe(self, histogram: Histogram, value: float) -> None:
        with self.lock:
            histogram.observe(value)

    def count(self, key: str) -> None:
        with self.lock:
            self.finished[key] = self.finished.get(key, 0) + 1

    def count_http(self, path: str, status: int) -> None:
        with self.lock:
            self.http[path, status] = self.http.get((path, status), 0) + 1

    def add_streamed(self, tokens: int) -> None:
        with self.lock:
            self.new_tokens += tokens

    def record(self, prompt_tokens: int, stats: dict) -> None:
        """Add a completed request's GenerationStats.to_dict()."""
        rounds = stats.get("tree_rounds") or 0
        with self.lock:
            for total, key in ((self.round_kinds, "round_kinds"), (self.round_seconds, "round_seconds")):
                for k, v in stats[key].items():
                    total[k] = total.get(k, 0) + v
            for k, v in stats["accepted_by_source"].items():
                self.accepted_by_source[k] = self.accepted_by_source.get(k, 0) + v
            self.prompt_tokens += prompt_tokens
            self.cached_prompt_tokens += stats["cached_prompt_tokens"]
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

    def render(self, queued: int, running: int, kv_reserved: int, kept: dict[str, int], model: str, method: str) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        with self.lock:
            families = _traffic(self, model, method) + _decoding(self) + _latency(self)
        families += [
            ("queue_depth", "gauge", "Requests waiting in the queue.", [("", queued)]),
            ("requests_running", "gauge", "Requests being generated (decoding together).", [("", running)]),
            ("kv_reserved_bytes", "gauge", "KV cache bytes reserved by running requests.", [("", kv_reserved)]),
            (
                "prefix_cache_bytes",
                "gauge",
                "KV cache bytes kept for prompts' shared prefixes.",
                [("", kept["prefix_cache"])],
            ),
            (
                "drafter_kept_bytes",
                "gauge",
                "Bytes drafters keep across requests (the suffix drafter's pool).",
                [("", kept["drafters"])],
            ),
        ]
        lines: list[str] = []
        for name, kind, help_, samples in families:
            lines += [f"# HELP swiftdecode_{name} {help_}", f"# TYPE swiftdecode_{name} {kind}"]
            lines += [f"swiftdecode_{name}{labels} {value:g}" for labels, value in samples]
        return "\n".join(lines) + "\n"


# The family builders below read `m` under its lock (taken by Metrics.render).


def _traffic(m: Metrics, model: str, method: str) -> list[Family]:
    """What is served, requests by outcome, tokens and generation time."""
    tps = m.done_tokens / m.gen_seconds if m.gen_seconds else 0.0
    return [
        ("info", "gauge", "Served model and decoding method.", [(f'{{model="{model}",method="{method}"}}', 1)]),
        (
            "http_requests_total",
            "counter",
            "HTTP requests by path and status.",
            [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(m.http.items())],
        ),
        (
            "requests_total",
            "counter",
            "Generations by outcome (stop, length, cancelled, error).",
            [(f'{{outcome="{k}"}}', n) for k, n in sorted(m.finished.items())],
        ),
        ("prompt_tokens_total", "counter", "Prompt tokens of completed requests.", [("", m.prompt_tokens)]),
        ("preemptions_total", "counter", "Requests whose KV cache was dropped for memory.", [("", m.preemptions)]),
        (
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens of completed requests whose KV entries came from the prefix cache.",
            [("", m.cached_prompt_tokens)],
        ),
        ("generated_tokens_total", "counter", "Tokens generated (cancelled requests included).", [("", m.new_tokens)]),
        ("generation_seconds_total", "counter", "Wall time of completed generations.", [("", m.gen_seconds)]),
        ("tokens_per_second", "gauge", "Tokens per second over completed generations.", [("", tps)]),
    ]


def _decoding(m: Metrics) -> list[Family]:
    """Rounds, acceptance, the draft's skip set and search state, batching."""
    rounds, skip = m.tree_rounds, m.last.get("skip", {})
    search = [(f'{{state="{m.last["search"]}"}}', 1)] if "search" in m.last else []
    return [
        (
            "rounds_total",
            "counter",
            "Decoding rounds of completed requests by kind (draft, ngram, plain).",
            [(f'{{kind="{k}"}}', n) for k, n in sorted(m.round_kinds.items())],
        ),
        (
            "round_seconds_total",
            "counter",
            "Seconds spent in decoding rounds of each kind.",
            [(f'{{kind="{k}"}}', v) for k, v in sorted(m.round_seconds.items())],
        ),
        (
            "accepted_tokens_total",
            "counter",
            "Accepted draft tokens by the drafter that proposed them (skip, ngram, both).",
            [(f'{{source="{k}"}}', n) for k, n in sorted(m.accepted_by_source.items())],
        ),
        (
            "mean_accepted_tokens",
            "gauge",
            "Mean tokens accepted per round (all requests).",
            [("", m.accepted / rounds if rounds else 1.0)],
        ),
        (
            "acceptance_rate",
            "gauge",
            "Draft acceptance rate (round-weighted, all requests).",
            [("", m.accept_rate / rounds if rounds else 0.0)],
        ),
        (
            "skip_layers",
            "gauge",
            "Current skip-set size (layers skipped while drafting).",
            [(f'{{kind="{k}"}}', len(skip.get(k, []))) for k in ("attn", "mlp")],
        ),
        (
            "draft_sparsity_level",
            "gauge",
            "Activation-sparsity level of the draft's MLPs (0 = dense).",
            [("", skip.get("sparsity", 0))],
        ),
        ("search_state", "gauge", "Layer-set search state (1 = current).", search),
        ("batch_size", "gauge", "Requests in the last decoding round.", [("", m.batch_size)]),
        (
            "forward_rows",
            "gauge",
            "Rows of the last batched forward (0 = the last round ran alone).",
            [("", m.forward_rows)],
        ),
    ]


def _latency(m: Metrics) -> list[Family]:
    return [
        ("queue_wait_seconds", "histogram", "Time from submission to start of prefill.", m.queue_wait.samples()),
        (
            "time_to_first_token_seconds",
            "histogram",
            "Time from submission to the first text.",
            m.first_token.samples(),
        ),
    ]
