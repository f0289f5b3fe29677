"""`swiftdecode soak --stall`: whether heavy requests stall the others. Streams decode alone for a while (their
inter-token gaps alone); then a long score-only echo with many choices and a long prompt arrive beside them, and
their gaps while those are read are compared with the gaps alone; /health is polled throughout. Each stream is a
client sending bounded requests one after another, so its own context (and its rounds' cost) stays the same.

The server reads a long prompt or echo in chunks between the running requests' rounds, and builds responses
off its event loop; this measures that it does (a stall shows as gaps many times the alone gaps, or a slow
/health).
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from swiftdecode.apps.server.soak_requests import COMPLETIONS, Server, send

ALONE_S = 10.0  # the streams decode alone this long first (their first seconds left out: prefill, warm-up)
SETTLE_S = 2.0
HEALTH_EVERY_S = 0.05
GAP_RATIO_MAX, HEALTH_P99_MAX_S = 3.0, 0.2  # issue #54's bars: p99 gap ≤ 3x alone, /health p99 < 0.2 s
FILLER = "The committee met on Tuesday to review the budget, the schedule and the open questions. "
# Tokens of each streamed request: a stream is a client sending one such request after another, so its context
# stays short and its rounds cost the same before, beside and after the heavy requests.
STREAM_TOKENS = 256


@dataclass
class Stream:
    """One client's chunk arrival times (monotonic), a list per request."""

    times: list[list[float]] = field(default_factory=list)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else 0.0)


def gaps(streams: list[Stream], start: float, end: float) -> list[float]:
    """The inter-chunk gaps within each request whose later chunk arrived within [start, end]."""
    pairs = (p for s in streams for times in s.times for p in itertools.pairwise(times))
    return [b - a for a, b in pairs if start <= b <= end]


def prompt_of(srv: Server, tokens: int) -> str:
    """A text of about `tokens` tokens of the served tokenizer (FILLER repeated, counted by /tokenize)."""
    status, _, data = send(srv, "/tokenize", json.dumps({"prompt": FILLER * 50}).encode(), timeout=60)
    per = json.loads(data)["count"] / 50 if status == 200 else 20
    return FILLER * max(1, round(tokens / per))


def run_stream(srv: Server, model: str, stream: Stream, stop: threading.Event) -> None:
    """Greedy streamed requests of STREAM_TOKENS tokens, one after another until `stop`."""
    body = {"model": model, "prompt": "Count from one upwards, in words:", "max_tokens": STREAM_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {srv.key}"} if srv.key else {})
    while not stop.is_set():
        conn, times = http.client.HTTPConnection(srv.host, srv.port, timeout=600), []
        stream.times.append(times)
        try:
            conn.request("POST", COMPLETIONS, body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            while not stop.is_set() and (line := resp.readline()):
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
        finally:
            conn.close()


def measure(srv: Server, model: str, streams: int, echo_tokens: int, echo_n: int, prompt_tokens: int) -> dict:
    """Streams alone, then beside a score-only echo (`echo_tokens`, `echo_n` choices) and a `prompt_tokens` prompt."""
    stop, runs, health = threading.Event(), [Stream() for _ in range(streams)], []
    echo = {"model": model, "prompt": prompt_of(srv, echo_tokens), "echo": True, "logprobs": 0, "max_tokens": 0}
    long = {"model": model, "prompt": prompt_of(srv, prompt_tokens), "max_tokens": 1, "temperature": 0}

    def poll() -> None:
        while not stop.is_set():
            t = time.monotonic()
            send(srv, "/health", None, timeout=30)
            health.append((t, time.monotonic() - t))
            time.sleep(HEALTH_EVERY_S)

    threads = [threading.Thread(target=run_stream, args=(srv, model, s, stop), daemon=True) for s in runs]
    threads.append(threading.Thread(target=poll, daemon=True))
    for t in threads:
        t.start()
    time.sleep(ALONE_S)
    heavy_start, done = time.monotonic(), {}

    def heavy(name: str, body: dict) -> None:
        status, _, data = send(srv, COMPLETIONS, json.dumps(body).encode(), timeout=1200)
        done[name] = (status, time.monotonic() - heavy_start, len(data))

    jobs = [
        threading.Thread(target=heavy, args=("echo", {**echo, "n": echo_n})),
        threading.Thread(target=heavy, args=("prompt", long)),
    ]
    for t in jobs:
        t.start()
    for t in jobs:
        t.join()
    heavy_end = time.monotonic()
    stop.set()
    alone = gaps(runs, heavy_start - ALONE_S + SETTLE_S, heavy_start)
    beside = gaps(runs, heavy_start, heavy_end)
    during = [lat for t, lat in health if heavy_start <= t <= heavy_end]
    return {
        "heavy": done,
        "gap_alone_p50_s": statistics.median(alone) if alone else None,
        "gap_alone_p99_s": p99(alone),
        "gap_beside_p50_s": statistics.median(beside) if beside else None,
        "gap_beside_p99_s": p99(beside),
        "gap_p99_ratio": p99(beside) / p99(alone) if alone and beside else None,
        "gap_beside_max_s": max(beside, default=None),
        "health_p99_s": p99(during),
        "health_max_s": max(during, default=None),
        "heavy_s": heavy_end - heavy_start,
    }


def report(m: dict) -> list[str]:
    """Print the measurement; the bars it misses."""
    print(f"heavy requests (status, seconds, bytes): {m['heavy']}; read beside the streams in {m['heavy_s']:.1f} s")
    print(
        f"stream gaps: alone p50 {m['gap_alone_p50_s']:.3f} s, p99 {m['gap_alone_p99_s']:.3f} s; beside p50 "
        f"{m['gap_beside_p50_s']:.3f} s, p99 {m['gap_beside_p99_s']:.3f} s ({m['gap_p99_ratio']:.2f}x), "
        f"max {m['gap_beside_max_s']:.3f} s"
    )
    print(f"/health beside: p99 {m['health_p99_s']:.3f} s, max {m['health_max_s']:.3f} s")
    bad = [f"{name}: status {s}" for name, (s, _, _) in m["heavy"].items() if s != 200]
    if m["gap_p99_ratio"] > GAP_RATIO_MAX:
        bad.append(f"gap p99 {m['gap_p99_ratio']:.2f}x alone (bar {GAP_RATIO_MAX:g}x)")
    if m["health_p99_s"] >= HEALTH_P99_MAX_S:
        bad.append(f"/health p99 {m['health_p99_s']:.3f} s (bar {HEALTH_P99_MAX_S} s)")
    print("PASS" if not bad else "FAIL: " + "; ".join(bad))
    return bad
