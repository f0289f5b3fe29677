"""`swiftdecode bench --concurrency N`: the prompts replayed through our OpenAI-compatible server by N clients at
once, against one client at a time, on the same server (same model, method and batching settings); the same
replay runs against any llama-server peer asked for (bench/llama_server.py, N parallel slots).

Each client streams `/v1/completions` with the prompt's token ids (chat template applied once, as in the bench),
greedy, each request on a new local connection (llama-server closes a streamed answer's connection
unannounced), and records time to first token (first streamed text), wall time and completion tokens. Reported
per mode: aggregate tokens/s (all completion tokens / wall time of the whole replay), p50/p95 time to first
token, mean per-request tokens/s, HTTP 429s, the CPU seconds the clients used, and whether every answer equals
the one-client answer to the same prompt. The clients run in a process of their own, as a server's clients are
other programs: they share the machine's cores with the server (their CPU time says how much), not its
interpreter lock.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

MODEL_ID = "bench"


@contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` with uvicorn in a background thread on a free local port; yields the base URL. The calling
    thread's OpenMP pool is released first: the server's worker thread runs the kernels from now on."""
    import uvicorn

    from swiftdecode.kernels.openmp import release_thread_pool

    release_thread_pool()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the bench server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def ask(url: str, ids: list[int], max_tokens: int, client=None) -> dict:
    """One streamed greedy completion (over `client`'s connection, else a new one): text, completion tokens, time
    to first token, wall time, HTTP status."""
    import httpx

    if client is None:
        with httpx.Client(timeout=600) as client:
            return ask(url, ids, max_tokens, client)
    body = {"model": MODEL_ID, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    t0, first, text, tokens = time.perf_counter(), None, [], 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "wall_s": time.perf_counter() - t0}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter() - t0
                    text.append(choice["text"])
    wall = time.perf_counter() - t0
    return {"status": 200, "text": "".join(text), "tokens": tokens, "ttft_s": first or wall, "wall_s": wall}


def replay(url: str, ids: list[list[int]], max_tokens: int, clients: int) -> dict:
    """All prompts through `clients` concurrent clients (each on its own connection, taking the next prompt when
    done); `client_cpu_s`: CPU seconds this process spent on them."""
    import httpx

    todo, answers = queue.SimpleQueue(), [None] * len(ids)
    for job in enumerate(ids):
        todo.put(job)

    def one_client() -> None:  # the next prompt when done, on a new connection (a reused one fails on llama-server)
        with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while True:
                try:
                    i, prompt = todo.get_nowait()
                except queue.Empty:
                    return
                answers[i] = ask(url, prompt, max_tokens, client)

    t0, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda _: one_client(), range(clients)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    ok = [a for a in answers if a["status"] == 200]
    ttft = sorted(a["ttft_s"] for a in ok)
    return {
        "clients": clients,
        "requests": len(answers),
        "completed": len(ok),
        "rejected_429": sum(a["status"] == 429 for a in answers),
        "wall_s": wall,
        "client_cpu_s": cpu,
        "aggregate_tokens_per_s": sum(a["tokens"] for a in ok) / wall,
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p95_s": _quantile(ttft, 0.95),
        "per_request_tokens_per_s": statistics.fmean(a["tokens"] / a["wall_s"] for a in ok) if ok else None,
        "answers": answers,
    }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def run(make_gen: Callable, ids: list[list[int]], max_tokens: int, clients: int, max_batch: int, pairs: int = 1):
    """One client, then `clients` at once, through one of our servers (see `replay_pairs`). Each replay has a
    server of its own over a new Generator (`make_gen()`; the model stays loaded), as a Ray replay has fresh
    replicas: nothing learned or kept by the other replay (prefix cache, copy pool, skip set, acceptance) is
    reused, only what its own requests share (a chat template's system prompt), as it would be live."""
    from contextlib import ExitStack

    from swiftdecode.apps.server import create_app

    servers = [ExitStack()]

    def fresh() -> str:  # the previous server stops first: one worker thread decodes at a time
        servers[0].close()
        servers[0] = ExitStack()
        app = create_app(make_gen(), MODEL_ID, max_queue=max(len(ids), 1), max_batch=max_batch)
        return servers[0].enter_context(serving(app))

    try:
        return {"max_batch": max_batch, **replay_pairs(fresh(), fresh, ids, max_tokens, clients, pairs)}
    finally:
        servers[0].close()


def replay_pairs(url: str, fresh: Callable[[], str], ids: list[list[int]], max_tokens: int, clients: int, pairs: int):
    """One client, then `clients` at once, through the OpenAI-compatible server at `url` (warmed up with one
    request first), `pairs` times alternated (a machine's speed drifts: each pair's ratio compares neighbours);
    answers compared prompt by prompt within each pair. Before each replay `fresh()` clears what the server kept
    from earlier replays and returns the URL to replay through. The top-level replays and speedup are the pair of
    median speedup."""
    runs = []
    with multiprocessing.get_context("spawn").Pool(1) as client:
        client.apply(ask, (url, ids[0], 8))  # warm-up
        for _ in range(pairs):
            solo, together = (client.apply(replay, (fresh(), ids, max_tokens, n)) for n in (1, clients))
            runs.append(_pair(solo, together))
    return _with_median(runs)


def combined(results: list[dict]) -> dict:
    """Replays of one server run apart (each a `replay_pairs` result, e.g. one per round) as one result: every
    pair, and the median pair's replays and speedup on top."""
    return {**results[0], **_with_median([p for r in results for p in r["pairs"]])}


def _with_median(runs: list[dict]) -> dict:
    median = sorted(runs, key=lambda r: r["speedup"])[(len(runs) - 1) // 2]
    return {**median, "pairs": runs}


def _pair(solo: dict, together: dict) -> dict:
    if not solo["completed"]:
        statuses = sorted({a["status"] for a in solo["answers"]})
        raise RuntimeError(f"no request of the one-client replay completed (HTTP statuses {statuses})")
    same = [
        a["status"] == 200 and a["text"] == b.get("text")
        for a, b in zip(together["answers"], solo["answers"], strict=True)
    ]
    return {
        "one_client": solo,
        "concurrent": together,
        "identical_to_one_client": sum(same),
        "speedup": together["aggregate_tokens_per_s"] / solo["aggregate_tokens_per_s"],
    }


def table(result: dict) -> str:
    """Markdown: every replay of our server, then of each llama-server peer, and the ratios between them."""
    rows = [
        "| server | pair | clients | requests | completed | 429 | aggregate tok/s | per-request tok/s | TTFT p50 s "
        "| TTFT p95 s | client CPU s / wall s | identical to one client |",
        "|" + "---|" * 12,
    ]
    servers = {f"swiftdecode {result['method']}": result, **result.get("peers", {})}
    for name, res in servers.items():
        if "error" in res:
            rows.append(f"| {name} | failed: {res['error'][:200]} |")
            continue
        for i, pair in enumerate(res["pairs"], 1):
            for key in ("one_client", "concurrent"):
                r = pair[key]
                same = f"{pair['identical_to_one_client']}/{r['requests']}" if key == "concurrent" else ""
                rows.append(
                    f"| {name} | {i} | {r['clients']} | {r['requests']} | {r['completed']} | {r['rejected_429']} "
                    f"| {r['aggregate_tokens_per_s']:.2f} | {r['per_request_tokens_per_s'] or 0:.2f} "
                    f"| {r['ttft_p50_s'] or 0:.2f} | {r['ttft_p95_s'] or 0:.2f} "
                    f"| {r['client_cpu_s']:.2f} / {r['wall_s']:.2f} | {same} |"
                )
    speedups = ", ".join(f"{p['speedup']:.2f}x" for p in result["pairs"])
    same = sum(p["identical_to_one_client"] for p in result["pairs"])
    total = sum(p["concurrent"]["requests"] for p in result["pairs"])
    rows.append(
        f"\nAggregate speedup {result['speedup']:.2f}x (--max-batch {result['max_batch']}; the median of "
        f"{len(result['pairs'])} alternated pairs: {speedups}); {same}/{total} concurrent answers identical to "
        "the one-client answers."
    )
    for name, res in result.get("peers", {}).items():
        if "error" in res:
            continue
        theirs, clients = res["concurrent"]["aggregate_tokens_per_s"], res["concurrent"]["clients"]
        if "against_single" in res:  # a Ray shape: compared round by round, not median pair with median pair
            head = f"{name}: aggregate {theirs:.2f} tok/s with {clients} clients (median pair)"
            rows.append(head + _against_single(res))
            continue
        ours = result["concurrent"]["aggregate_tokens_per_s"]
        ours_1, theirs_1 = (r["one_client"]["aggregate_tokens_per_s"] for r in (result, res))
        rows.append(
            f"{name}: aggregate {theirs:.2f} tok/s with {clients} clients (ours {ours / theirs:.2f}x), one client "
            f"{ours_1 / theirs_1:.2f}x (ours / theirs), its own speedup {res['speedup']:.2f}x, "
            f"{res['identical_to_one_client']}/{res['concurrent']['requests']} answers identical to its one-client "
            "answers (median pair)."
        )
    return "\n".join(rows)


def _against_single(res: dict) -> str:
    """A Ray shape's line's end: its N-client aggregate over our single server's, round by round."""
    ratios = ", ".join(f"{r:.2f}x" for r in res["against_single"])
    total = len(res["against_single"]) * res["concurrent"]["requests"]
    return (
        f", its own speedup {res['speedup']:.2f}x; its N-client aggregate over our single server's in the same "
        f"round: {ratios} (median {res['against_single_median']:.2f}x); {res['identical_to_single_server']}/{total} "
        "answers of its N-client replays identical to our single server's one-client answers."
    )
