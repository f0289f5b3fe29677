"""`swiftdecode soak`: run a server (or attach to one) and load it with concurrent valid and abusive requests.

Each valid request is first answered alone (its reference answer); during the soak it must get that same answer
again. Probes are malformed or hostile requests with a required outcome (a 4xx mostly, never a 5xx). Meanwhile
/health latency and the server's RSS are watched. Exit status 0 only when every check held.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import random
import secrets
import sys
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

from swiftdecode.apps.server import stall
from swiftdecode.apps.server.soak_process import (
    HEALTH_TIMEOUT_S,
    kv_reserved_mb,
    metrics_5xx,
    prefix_mb,
    rss_mb,
    start_server,
    stop_server,
    wait_ready,
)
from swiftdecode.apps.server.soak_requests import (
    COMPLETIONS,
    PATHS,
    PROBE_TIMEOUT_S,
    RAW_PROBES,
    Refused,
    Server,
    answer,
    never_read,
    passed,
    probe_bodies,
    send,
    slow_body,
    valid_requests,
)
from swiftdecode.base.errors import UserError

DEFAULT_MODEL = "smollm2-135m"  # the smallest registry model: the soak tests the server, not the model
VALID_TIMEOUT_S = 120  # a valid request may wait behind a full batch and a full queue
HEALTH_EVERY_S = 0.25  # /health must stay responsive while the engine is busy
HEALTH_P99_MAX_S = 1.0  # above this the event loop was blocked
RSS_GROWTH_MAX = 0.10  # end RSS (less the bounded prefix cache) at most 10% above the warmed-up baseline: no leak
# Load before the RSS baseline: the server's buffers (batch caches, attention scratch, a scored prompt's logits)
# reach their high-water marks only after minutes of mixed load. After 60 s, RSS less the prefix cache grew ~90
# MiB (1.14x) in each of two 10-minute soaks of 1,807 and 3,774 requests (a level, not a cost per request);
# after 300 s, 1.08x.
WARM_S = 300
IDLE_S = 5  # idle time before the end RSS, so that finished requests' buffers are released
VALID_SHARE = 0.75  # of the soak's requests; the rest are probes
DROP_SHARE = 0.2  # of the streamed valid requests: closed after 1-3 chunks, as a client that leaves
# Probes that decode before their answer: `x: x x | "a"` ends with a 400 only some 350 tokens in (its parse then
# takes 50 ms a position), which with 32 clients' requests in the batch took over VALID_TIMEOUT_S twice in 10 min.
SLOW_PROBE_TIMEOUT_S = 300
JOIN_GRACE_S = SLOW_PROBE_TIMEOUT_S + 15  # every client's last request ends within its timeout after the soak
NOTES_KEPT = 3  # failure details kept per kind, for the report
# They decode or score first: SLOW_PROBE_TIMEOUT_S
SLOW_PROBES = {"pathological_lark", "echo_long", "echo_n16", "long_prompt", "stop_after_literal"}


class Tally:
    """Counters and the first few notes of each kind, shared by the client threads."""

    def __init__(self) -> None:
        self.lock, self.counts, self.notes = threading.Lock(), Counter(), {}

    def add(self, key: str, note: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if note is not None and len(kept := self.notes.setdefault(key, [])) < NOTES_KEPT:
                kept.append(note)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve (default: {DEFAULT_MODEL})")
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default: 8)")
    parser.add_argument(
        "--ray", metavar="RxT", help="soak `serve --ray` with R replicas of T threads (RSS: the server and its Ray's)"
    )
    parser.add_argument("--url", help="soak this running server (http://host:port) instead of starting one")
    parser.add_argument("--key", help="with --url: its API key")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, to watch its RSS")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads (default: 32)")
    parser.add_argument("--seconds", type=int, default=600, help="soak duration after the warm-up (default: 600)")
    parser.add_argument(
        "--warm-seconds",
        type=int,
        default=WARM_S,
        help=f"load before the RSS baseline is taken (default: {WARM_S})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (default: 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    stall = parser.add_argument_group("--stall: whether heavy requests stall running streams (instead of the soak)")
    stall.add_argument("--stall", action="store_true", help="measure stream gaps and /health beside heavy requests")
    stall.add_argument("--streams", type=int, default=4, help="streams decoding meanwhile (default: 4)")
    stall.add_argument("--echo-tokens", type=int, default=8000, help="the score-only echo's prompt (default: 8000)")
    stall.add_argument("--echo-n", type=int, default=16, help="the echo's choices (default: 16)")
    stall.add_argument("--prompt-tokens", type=int, default=16000, help="the long prompt (default: 16000)")


def send_retrying(srv: Server, path: str, body: bytes, tally: Tally, **kw: Any) -> tuple[int, Any, Any]:
    """`send`, again after Retry-After while the queue is full (429), until the request's own timeout."""
    deadline = time.monotonic() + kw["timeout"]
    while True:
        status, headers, reply = send(srv, path, body, **kw)
        if status >= 500:
            tally.add("5xx", f"{path}: {status} {reply[:160]!r}")
        if status != 429 or time.monotonic() > deadline:
            return status, headers, reply
        tally.add("429")
        time.sleep(float(headers.get("Retry-After", 1)))


LOST = (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, Refused)  # a request without an answer


def fetch_answer(srv: Server, spec: tuple, tally: Tally, chunks: int = 0) -> list | None:
    """A valid request's answer (None for a stream dropped after `chunks` chunks), or Refused."""
    _, path, body = spec
    data, stream = json.dumps(body).encode(), bool(body.get("stream"))
    status, _, reply = send_retrying(srv, path, data, tally, timeout=VALID_TIMEOUT_S, stream=stream, max_chunks=chunks)
    if status != 200:
        raise Refused(f"status {status}: {reply[:160]!r}")
    return None if chunks else answer(path, reply)


def run_valid(srv: Server, spec: tuple, solo: dict, rng: random.Random, tally: Tally) -> None:
    """One valid request (or a stream dropped after 1-3 chunks), its answer compared with the solo one."""
    name, _, body = spec
    chunks = rng.randint(1, 3) if body.get("stream") and rng.random() < DROP_SHARE else 0
    try:
        got = fetch_answer(srv, spec, tally, chunks)
    except LOST as e:
        return tally.add("valid.lost", f"{name}{' (dropped)' if chunks else ''}: {type(e).__name__}: {e}")
    if chunks or got == solo[name]:
        return tally.add("valid.dropped" if chunks else "valid.identical")
    was, now = ([t for t, _ in a] for a in (solo[name], got))
    tally.add("valid.different", f"{name}: " + ("logprobs only" if was == now else f"{was!r:.100} -> {now!r:.100}"))


def run_probe(srv: Server, name: str, model: str, bodies: dict, tally: Tally) -> None:
    """Send one probe and count its pass or fail (with why), and its HTTP status."""
    try:
        if name in RAW_PROBES:
            ok, detail = (never_read if name == "never_read" else slow_body)(srv, model)
        else:
            key = "wrong-" + secrets.token_hex(4) if name == "bad_key" else None
            timeout = SLOW_PROBE_TIMEOUT_S if name in SLOW_PROBES else PROBE_TIMEOUT_S
            path = PATHS.get(name, COMPLETIONS)
            status, _, data = send_retrying(srv, path, bodies[name], tally, timeout=timeout, key=key)
            ok, detail = passed(name, status, data), f"status {status}: {data[:160]!r}"
            tally.add(f"status.{name}.{status}")
    except (OSError, http.client.HTTPException, ValueError, IndexError) as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    tally.add(f"probe.{name}.{'pass' if ok else 'fail'}", None if ok else detail)


def client(
    srv: Server, specs: list, solo: dict, model: str, bodies: dict, seed: int, until: float, tally: Tally, first: list
) -> None:
    """Valid requests and probes until `until`: those of `first` (a valid request's spec or a probe's name), then
    at random, the probes in a seeded order that visits them all in turn."""
    rng = random.Random(seed)
    probes = itertools.cycle(rng.sample([*bodies, *RAW_PROBES], len(bodies) + len(RAW_PROBES)))
    first = list(first)
    while time.monotonic() < until:
        try:
            pick = first.pop(0) if first else rng.choice(specs) if specs and rng.random() < VALID_SHARE else None
            if isinstance(pick, tuple):
                run_valid(srv, pick, solo, rng, tally)
            else:
                run_probe(srv, pick or next(probes), model, bodies, tally)
        except Exception as e:  # a bug of this tool's, or an answer of a shape it did not foresee: counted, not fatal
            tally.add("tool.error", f"{type(e).__name__}: {e}")
        tally.add("requests")


def watch_health(srv: Server, stop: threading.Event, latencies: list[float], tally: Tally) -> None:
    """GET /health every HEALTH_EVERY_S; a timeout counts as HEALTH_TIMEOUT_S, and as a failure."""
    while not stop.wait(HEALTH_EVERY_S):
        t = time.monotonic()
        try:
            status = send(srv, "/health", None, timeout=HEALTH_TIMEOUT_S)[0]
            latencies.append(time.monotonic() - t)
            if status != 200:
                tally.add("health.fail", f"status {status}")
        except (OSError, http.client.HTTPException) as e:
            latencies.append(HEALTH_TIMEOUT_S)
            tally.add("health.fail", f"{type(e).__name__}: {e}")


def soak(
    srv: Server,
    specs: list,
    solo: dict,
    model: str,
    bodies: dict,
    args: argparse.Namespace,
    tally: Tally,
    seconds: int,
    desc: str = "soak",
    cover: bool = False,
):
    """The clients and the /health watcher for `seconds`: (/health latencies, clients still stuck)."""
    from tqdm import tqdm

    start, stop, latencies = time.monotonic(), threading.Event(), []
    until = start + seconds
    health = threading.Thread(target=watch_health, args=(srv, stop, latencies, tally), daemon=True)
    seeds, kinds = [args.seed * 1_000_003 + i for i in range(args.clients)], [*bodies, *RAW_PROBES]
    # In the warm-up client i first sends valid request i and probe i: every kind of request has been served once
    # (with as many clients as kinds) before the RSS baseline, so that what they allocate for good is in it.
    first = [[specs[i % len(specs)], kinds[i % len(kinds)]] if cover and specs else [] for i in range(args.clients)]
    clients = [
        threading.Thread(target=client, args=(srv, specs, solo, model, bodies, s, until, tally, f), daemon=True)
        for s, f in zip(seeds, first, strict=True)
    ]
    for t in [health, *clients]:
        t.start()
    with tqdm(total=seconds, unit="s", desc=desc) as bar:
        while (now := time.monotonic()) < until:
            time.sleep(min(1.0, until - now))
            bar.set_postfix(requests=tally.counts["requests"], refresh=False)
            bar.update(min(seconds, round(time.monotonic() - start)) - bar.n)
    print(f"soak over: waiting for the clients' last requests (at most {JOIN_GRACE_S} s)", file=sys.stderr)
    end = time.monotonic() + JOIN_GRACE_S  # daemon threads: one stuck past this cannot keep the tool alive
    for t in clients:
        t.join(max(0.0, end - time.monotonic()))
    stop.set()
    health.join(HEALTH_TIMEOUT_S + 1)
    return latencies, sum(t.is_alive() for t in clients)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values) or [math.nan]
    return values[max(0, math.ceil(q * len(values)) - 1)]


def summarize(tally: Tally, probes: list[str], latencies: list[float], stuck: int, rss: tuple, srv: Server) -> dict:
    """The soak's numbers, as --json writes them."""
    c = tally.counts
    valid = {k: c[f"valid.{k}"] for k in ("identical", "different", "lost", "dropped")}
    statuses = {p: {k.split(".")[2]: n for k, n in c.items() if k.startswith(f"status.{p}.")} for p in probes}
    probes = {p: {"pass": c[f"probe.{p}.pass"], "fail": c[f"probe.{p}.fail"], "statuses": statuses[p]} for p in probes}
    health = {"checks": len(latencies), "failures": c["health.fail"]}
    health |= {f"{q}_s": round(percentile(latencies, v), 4) for q, v in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}
    ratio = rss[1] / rss[0] if None not in rss else None
    return {
        "requests": c["requests"],
        "valid": {"sent": sum(valid.values()), **valid},
        "probes": probes,
        "status_5xx": c["5xx"],
        "status_429": c["429"],
        "health": health,
        "stuck_clients": stuck,
        "tool_errors": c["tool.error"],
        "rss_mb": {"baseline": rss[0], "end": rss[1], "ratio": ratio},
        "server_5xx": metrics_5xx(srv),
        "notes": tally.notes,
    }


def verdict(s: dict) -> list[str]:
    """The checks that failed."""
    h, ratio = s["health"], s["rss_mb"]["ratio"]
    bad = [f"{n} valid requests {k}" for k in ("lost", "different") if (n := s["valid"][k])]
    bad += [f"probe {name} failed {p['fail']}x" for name, p in s["probes"].items() if p["fail"]]
    bad += [f"{s['status_5xx']} responses 5xx"] * bool(s["status_5xx"])
    bad += [f"{h['failures']} /health checks failed"] * bool(h["failures"])
    bad += [f"/health p99 {h['p99_s']:.3f} s >= {HEALTH_P99_MAX_S:g} s"] * (not h["p99_s"] < HEALTH_P99_MAX_S)
    bad += [f"{s['stuck_clients']} clients stuck in a request"] * bool(s["stuck_clients"])
    bad += [f"{s['tool_errors']} unexpected errors in this tool (see notes)"] * bool(s["tool_errors"])
    bad += [f"RSS grew {ratio:.2f}x"] * (ratio is not None and ratio > 1 + RSS_GROWTH_MAX)
    bad += [f"probe {name} never sent" for name, p in s["probes"].items() if not p["pass"] + p["fail"]]
    bad += [f"{s['kv_reserved_mb_idle']:.1f} MiB of KV cache still reserved once idle"] * bool(s["kv_reserved_mb_idle"])
    return bad + s["problems"]


def print_report(s: dict, bad: list[str]) -> None:
    v, h, r = s["valid"], s["health"], s["rss_mb"]
    print(
        f"\nrequests {s['requests']}; valid: {v['sent']} sent, {v['identical']} identical, {v['different']} "
        f"different, {v['lost']} lost, {v['dropped']} streams dropped on purpose"
    )
    for name, p in s["probes"].items():
        print(f"  probe {name:22} pass {p['pass']:5}  fail {p['fail']:5}  HTTP statuses {p['statuses'] or '-'}")
    print(f"5xx: {s['status_5xx']}; 429 (queue full, retried): {s['status_429']}; /metrics' 5xx: {s['server_5xx']}")
    print(
        f"/health: {h['checks']} checks, {h['failures']} failed, p50 {h['p50_s']:.3f} s, p99 {h['p99_s']:.3f} s, "
        f"max {h['max_s']:.3f} s"
    )
    if r["ratio"] is not None:
        print(
            f"RSS less the prefix cache: {r['baseline']:.0f} MiB after warm-up, {r['end']:.0f} MiB at the end "
            f"({r['ratio']:.3f}x); with it: {s['rss_with_prefix_cache_mb']}; the prefix cache's: "
            f"{s['prefix_cache_mb']}; KV reserved once idle: {s['kv_reserved_mb_idle']} MiB"
        )
    for kind, notes in sorted(s["notes"].items()):
        print("\n".join(f"  {kind}: {note[:300]}" for note in notes))
    print("PASS" if not bad else "FAIL: " + "; ".join(bad))


def stall_run(srv: Server, model: str, args: argparse.Namespace) -> int:
    """`soak --stall` (see stall.py): 0 when the streams' gaps and /health kept within the bars."""
    m = stall.measure(srv, model, args.streams, args.echo_tokens, args.echo_n, args.prompt_tokens)
    bad = stall.report(m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**m, "failed_checks": bad}, f, indent=2)
    return 0 if not bad else 1


def solo_answers(srv: Server, specs: list, tally: Tally) -> tuple[dict, list[str]]:
    """Each valid request sent alone: its reference answer (a request that fails alone is left out, and reported)."""
    solo, problems = {}, []
    for spec in specs:
        try:
            solo[spec[0]] = fetch_answer(srv, spec, tally)
        except LOST as e:
            problems.append(f"solo {spec[0]}: {type(e).__name__}: {e}")
    return solo, problems


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.seconds < 1 or args.warm_seconds < 0:
        raise UserError("--clients and --seconds must be >= 1, --warm-seconds >= 0")
    shape = None
    if args.ray is not None:
        from swiftdecode.apps.bench.cli import ray_shapes

        if len(shapes := ray_shapes(args.ray)) != 1:
            raise UserError(f"--ray takes one shape RxT, got {args.ray!r}")
        shape = shapes[0]
    proc, log_path = None, None
    if args.url:
        url = urlsplit(args.url if "//" in args.url else f"http://{args.url}")
        srv = Server(url.hostname or "127.0.0.1", url.port or 80, args.key, args.pid)
    else:
        proc, srv, log_path = start_server(args, shape)
    try:
        model = wait_ready(srv, proc, log_path)
        if args.stall:
            return stall_run(srv, model, args)
        tally, specs = Tally(), valid_requests(model)
        solo, problems = solo_answers(srv, specs, tally)
        bodies = probe_bodies(model)  # before the soak, so that no client waits for it
        if srv.key is None:
            del bodies["bad_key"]  # an open server takes any key
        specs = [s for s in specs if s[0] in solo]
        warm, stuck = soak(srv, specs, solo, model, bodies, args, tally, args.warm_seconds, "warm-up", cover=True)
        time.sleep(IDLE_S)  # the baseline is read idle, as the end is: the same state, freed memory handed back
        baseline = rss_mb(srv.pid), prefix_mb(srv)  # after the warm-up: the batch, caches and allocator have grown
        latencies, more = soak(srv, specs, solo, model, bodies, args, tally, args.seconds)
        latencies, stuck = warm + latencies, stuck + more
        time.sleep(IDLE_S)
        end = rss_mb(srv.pid), prefix_mb(srv)
        # the prefix cache grows to its bound (--prefix-cache-gb) by design: the leak check is on the rest
        rest = tuple(None if rss is None else rss - (prefix or 0) for rss, prefix in (baseline, end))
        summary = summarize(tally, [*bodies, *RAW_PROBES], latencies, stuck, rest, srv)
        summary["prefix_cache_mb"] = {"baseline": baseline[1], "end": end[1]}
        summary["rss_with_prefix_cache_mb"] = {"baseline": baseline[0], "end": end[0]}
        summary["kv_reserved_mb_idle"] = kv_reserved_mb(srv)
        if proc is not None and proc.poll() is not None:
            problems.append(f"the server exited with status {proc.returncode}")
        summary["problems"] = problems
    finally:
        if proc is not None and proc.poll() is None:
            stop_server(proc)
    bad = verdict(summary)
    print_report(summary, bad)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "failed_checks": bad}, f, indent=2)
    return 0 if not bad else 1
