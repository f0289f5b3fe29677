"""`swiftdecode serve --ray`: two one-thread replicas of SmolLM2 on a local Ray cluster, against the single server.

The tests on a live cluster skip where Ray Serve is not installed (the `cluster` extra; CI installs it). The
failover test kills a replica and so runs last.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from swiftdecode import Generator
from swiftdecode.apps.bench.concurrency import serving
from swiftdecode.apps.cluster.board import labelled, merge
from swiftdecode.apps.cluster.routing import answer_of, answered_text, routing_text
from swiftdecode.apps.server import create_app

MODEL, KEY = "smollm2-135m", "sk-cluster"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers and say why each is prime.",
    "Explain what a hash map is to a child.",
    "Give two tips for writing clear emails.",
    "What is the capital of France? Answer with a story.",
    "Describe a cat in four sentences.",
    "Name three uses of a paperclip.",
    "Why is the sky blue? One paragraph.",
]


def test_merge_labels_each_replica_and_keeps_one_header_per_family():
    a = '# HELP x_total Things.\n# TYPE x_total counter\nx_total{path="/v1"} 3\n# TYPE y gauge\ny 1\n'
    b = '# HELP x_total Things.\n# TYPE x_total counter\nx_total{path="/v1"} 5\n# TYPE y gauge\ny 2\n'
    text = merge({"r1": a, "r2": b})
    assert text.count("# HELP x_total") == 1 and text.count("# TYPE y gauge") == 1
    assert 'x_total{replica="r1",path="/v1"} 3' in text and 'x_total{replica="r2",path="/v1"} 5' in text
    assert 'y{replica="r2"} 2' in text
    assert labelled("z{} 1", "r") == 'z{replica="r"} 1'


def test_routing_text_keeps_tenants_apart_and_prefixes_in_order():
    turn1 = {"messages": [{"role": "user", "content": "hi"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "hello"}]}
    assert routing_text("Bearer a", turn2).startswith(routing_text("Bearer a", turn1))
    assert routing_text("Bearer a", turn1) != routing_text("Bearer b", turn1)
    assert routing_text("Bearer a", {**turn1, "cache_salt": "x"}) != routing_text("Bearer a", turn1)
    assert routing_text("", {"prompt": [1, 2]}).endswith("|1 2 ") and routing_text("", None)


def test_the_answered_text_begins_the_next_turns_routing_text():
    turn1 = {"messages": [{"role": "user", "content": "hi"}]}
    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}]}).encode()
    chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ("hel", "lo")]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
    assert answer_of(body, streamed=False) == answer_of(sse, streamed=True) == "hello"
    assert answer_of(b"{}", streamed=False) is None
    turn2 = {
        "messages": [*turn1["messages"], {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    }
    assert routing_text("k", turn2).startswith(answered_text("k", turn1, "hello"))
    assert answered_text("k", {"prompt": "a"}, "b") == routing_text("k", {"prompt": "ab"})
    assert answered_text("k", {"prompt": [1]}, "b") is None


def test_cluster_flags_are_checked_before_anything_starts(capsys, monkeypatch):
    import sys

    from swiftdecode.apps.cli import main

    for argv in (
        ["--replicas", "2"],  # without --ray
        ["--ray", "--replicas", "0"],
        ["--ray", "--replicas", "2", "--max-replicas", "1"],
        ["--ray", "--threads", "0"],
    ):
        assert main(["serve", "--model", MODEL, *argv]) == 2, argv
        assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as without the cluster extra
    assert main(["serve", "--model", MODEL, "--ray", "--port", str(free_port())]) == 2
    assert "pip install 'swiftdecode[cluster]'" in capsys.readouterr().err
    monkeypatch.undo()
    base = ["bench", "--model", MODEL, "--data", "code-edit", "--methods", "swift"]
    assert main([*base, "--ray", "2x1"]) == 2  # without --concurrency
    assert main([*base, "--concurrency", "4", "--ray", "2x0"]) == 2
    assert main([*base, "--concurrency", "4", "--ray", "two"]) == 2


def test_replica_count_is_fixed_or_autoscaled_on_ongoing_requests():
    import argparse

    from swiftdecode.apps.cluster.deploy import replica_threads, scaling

    fixed = argparse.Namespace(replicas=2, max_replicas=None, max_batch=8, threads=None)
    assert scaling(fixed) == {"num_replicas": 2} and replica_threads(fixed) >= 1
    auto = argparse.Namespace(replicas=1, max_replicas=4, max_batch=8, threads=3)
    config = scaling(auto)["autoscaling_config"]
    assert (config["min_replicas"], config["max_replicas"], config["target_ongoing_requests"]) == (1, 4, 8)
    assert replica_threads(auto) == 3


def test_bench_alternates_each_ray_shape_with_the_single_server_round_by_round(monkeypatch):
    """`bench --concurrency N --ray RxT --pairs P`: P rounds, each the single server's pair of replays, then each
    shape's; a shape's aggregate is compared with the single server of its own round."""
    import argparse

    from swiftdecode.apps.bench import cluster
    from swiftdecode.apps.bench.cli import ray_rounds

    calls, rates = [], iter([(100.0, 90.0, 120.0), (50.0, 45.0, 70.0), (80.0, 80.0, 60.0)])

    def replays(rate: float, answers: list[str]) -> dict:
        replay = {"aggregate_tokens_per_s": rate, "requests": len(answers), "answers": [{"text": a} for a in answers]}
        return {"one_client": replay, "concurrent": replay, "speedup": rate, "identical_to_one_client": 2}

    def single(pairs: int) -> dict:
        assert pairs == 1
        calls.append("single")
        round_rates = next(rates)
        shape_rates[:] = round_rates[1:]
        return {"pairs": [replays(round_rates[0], ["a", "b"])], **replays(round_rates[0], ["a", "b"])}

    def shape_run(args, method, ids, answers, replicas, threads) -> dict:
        calls.append(f"{replicas}x{threads}")
        pair = replays(shape_rates.pop(0), ["a", "c"])
        same = sum(a["text"] == s for a, s in zip(pair["concurrent"]["answers"], answers, strict=True))
        return {"replicas": replicas, "threads": threads, "identical_to_single_server": same, "pairs": [pair], **pair}

    shape_rates: list[float] = []
    monkeypatch.setattr(cluster, "run", shape_run)
    args = argparse.Namespace(pairs=3, ray_shapes=[(2, 1), (1, 2)])
    ours, shapes = ray_rounds(single, "swift", [[1], [2]], args)
    assert calls == ["single", "2x1", "1x2"] * 3
    two, one = shapes["swiftdecode swift on Ray, 2 x 1 threads"], shapes["swiftdecode swift on Ray, 1 x 2 threads"]
    assert two["against_single"] == pytest.approx([0.9, 0.9, 1.0]) and two["against_single_median"] == 0.9
    assert one["against_single"] == pytest.approx([1.2, 1.4, 0.75]) and one["against_single_median"] == 1.2
    assert two["identical_to_single_server"] == 3 and len(two["pairs"]) == 3 and two["speedup"] == 80.0
    assert len(ours["pairs"]) == 3 and ours["speedup"] == 80.0  # the median pair


RAY_MISSING = "Ray Serve is the cluster extra: pip install -e '.[cluster]'"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_ray_stops_on_sigint_within_10_s_leaving_no_ray_process():
    """Ctrl-C's signal stops `serve --ray` and the Ray it started, even where the shell started it with SIGINT
    ignored (a background job); SIGTERM does the same (the soak's stop)."""
    import os
    import signal
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil", reason=RAY_MISSING)
    pytest.importorskip("ray", reason=RAY_MISSING)
    port = free_port()
    argv = [sys.executable, "-m", "swiftdecode.apps.cli", "serve", "--model", MODEL, "--ray", "--threads", "1"]
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 (as a shell's background job)
    proc = subprocess.Popen([*argv, "--port", str(port)], preexec_fn=ignore, stdout=subprocess.PIPE, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # Ray's own processes
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 10
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, alive
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The base URL of `serve --ray --replicas 2 --threads 1` on a local Ray cluster of this machine's cores."""
    import argparse

    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    from ray import serve

    from swiftdecode.apps.cluster.deploy import start
    from swiftdecode.apps.server.cli import add_arguments, check_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", MODEL, "--ray", "--replicas", "2", "--threads", "1", "--api-key", KEY]
    args = parser.parse_args([*argv, "--port", str(free_port()), "--max-queue", "16"])
    check_args(args)
    try:
        yield start(args).removesuffix("/v1")
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def solo(smollm) -> Iterator[str]:
    """The single server (one process, this process's threads) over the same model and method."""
    with serving(create_app(Generator(*smollm, method="swift"), MODEL, api_key=KEY)) as url:
        yield url


def complete(url: str, prompt: str, stream: bool = False, tokens: int = 24, **extra) -> dict:
    """A greedy chat completion: {"text", "cached", "error"} (a stream's text joined from its deltas)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": stream}
    body = {**body, "temperature": 0, **extra}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=300)
        assert r.status_code == 200, r.text
        res = r.json()
        cached = res["usage"]["prompt_tokens_details"]["cached_tokens"]
        return {"text": res["choices"][0]["message"]["content"], "cached": cached, "error": None}
    text, error = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                error = chunk.get("error", error)
                text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    return {"text": "".join(text), "cached": None, "error": error}


def test_replicas_answer_as_the_single_server(cluster, solo):
    """16 requests at once, half streamed, over two replicas of one thread: each answer is the single server's."""
    expected = [complete(solo, p)["text"] for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: complete(cluster, PROMPTS[i % 8], stream=i >= 8), range(16)))
    assert [g["text"] for g in got] == expected + expected


def test_errors_and_keys_are_the_single_servers(cluster, solo):
    for url_body_key in [("/v1/chat/completions", b"{not json", KEY), ("/v1/completions", b"{}", None)]:
        path, body, key = url_body_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        ours, single = (httpx.post(f"{u}{path}", content=body, headers=headers, timeout=60) for u in (cluster, solo))
        assert (ours.status_code, ours.json()) == (single.status_code, single.json())
        assert ours.status_code in (400, 401)
    assert httpx.get(f"{cluster}/v1/nowhere", headers=HEADERS).status_code == 404
    # checked at the ingress as the single server checks: the key before the body, the replicas' body limit, and
    # a completion's parameters (none of these reaches a replica)
    big = b"x" * (2 * 2**20)
    for headers, status in (({}, 401), (HEADERS, 413)):
        ours, single = (
            httpx.post(f"{u}/v1/completions", content=big, headers=headers, timeout=60) for u in (cluster, solo)
        )
        assert (ours.status_code, ours.json()) == (single.status_code, single.json()) and ours.status_code == status
    bad = {"model": MODEL, "prompt": "x", "temperature": 9}
    ours, single = (httpx.post(f"{u}/v1/completions", json=bad, headers=HEADERS, timeout=60) for u in (cluster, solo))
    assert (ours.status_code, ours.json()) == (single.status_code, single.json()) and ours.status_code == 400
    assert "x-swiftdecode-replica" not in ours.headers  # answered by the ingress
    assert httpx.get(f"{cluster}/v1/models", headers=HEADERS).json()["data"][0]["id"] == MODEL


def test_metrics_carry_each_replicas_label(cluster):
    assert httpx.get(f"{cluster}/metrics").status_code == 401
    deadline, replicas = time.monotonic() + 30, set()
    while len(replicas) < 2 and time.monotonic() < deadline:
        text = httpx.get(f"{cluster}/metrics", headers=HEADERS).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}
        time.sleep(0.5)
    assert len(replicas) == 2 and text.count("# TYPE swiftdecode_requests_total") <= 1


def converse(url: str, talks: int = 8, turns: int = 4) -> tuple[list[str], list[int]]:
    """`talks` conversations of `turns` turns, interleaved turn by turn (the first prompts are PROMPTS'): every
    answer, and for each later turn whether its cached prompt tokens cover the previous turn's whole prompt."""
    history = [[{"role": "user", "content": p}] for p in PROMPTS[:talks]]
    answers, covered, before = [], [], [0] * talks
    for turn in range(turns):
        for i, talk in enumerate(history):
            body = {"model": MODEL, "messages": talk, "max_tokens": 12, "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=300).json()
            answers.append(r["choices"][0]["message"]["content"])
            talk += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": f"More ({turn})."}]
            usage = r["usage"]
            if turn:
                covered.append(usage["prompt_tokens_details"]["cached_tokens"] >= before[i])
            before[i] = usage["prompt_tokens"]
    return answers, covered


def test_conversation_turns_land_on_the_replica_holding_their_prefix(cluster, solo):
    """8 conversations x 4 turns, interleaved, their first prompts already sent to both replicas (the earlier
    tests): every later turn finds the previous turn's whole prompt in its replica's cache (the replica that
    answered it), and every answer is the single server's."""
    answers, covered = converse(cluster)
    assert all(covered), covered
    assert answers == converse(solo)[0]


def test_a_replica_killed_mid_request_costs_no_answer(cluster, solo):
    """8 requests in flight (4 streamed) when a replica dies: the others retry and answer as the single server;
    a stream cut after it began ends with a replica_lost error, never with other text; none hangs."""
    import ray

    expected = [complete(solo, p, tokens=64)["text"] for p in PROMPTS]
    replica = next(
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "Replica" in a["name"]
    )
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(complete, cluster, p, i % 2 == 1, 64) for i, p in enumerate(PROMPTS)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
        got = [f.result(timeout=300) for f in futures]
    for i, (g, want) in enumerate(zip(got, expected, strict=True)):
        if g["error"] is not None:
            assert i % 2 == 1 and g["error"]["code"] == "replica_lost" and want.startswith(g["text"])
        else:
            assert g["text"] == want
