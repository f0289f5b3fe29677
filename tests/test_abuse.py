"""Faults and abuse against a live server (SmolLM2): each probe gets a clear 4xx (or its own error event) while
a stream decodes beside it; /health keeps answering within a second; the stream's answer is its solo answer; and
the worker is left with nothing running, queued or reserved."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from swiftdecode import Generator, UserError
from swiftdecode.apps.bench.concurrency import serving
from swiftdecode.apps.server import create_app
from swiftdecode.apps.server.jobs import END

MODEL = "smollm2-135m"
KEY, OTHER_KEY, METRICS_KEY = "sk-tenant-a", "sk-tenant-b", "sk-operator"
HEALTH_S = 1.0  # /health must answer within this throughout
STREAM = {"model": MODEL, "prompt": "Once upon a time, a robot named", "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def gen(smollm):
    return Generator(*smollm, method="swift", prefix_cache_gb=0.25)


@pytest.fixture(scope="module")
def url(gen) -> Iterator[str]:
    app = create_app(gen, MODEL, api_key=[KEY, OTHER_KEY], metrics_key=METRICS_KEY, body_timeout_s=1.0)
    with serving(app) as base:
        yield base


@pytest.fixture(scope="module")
def solo(url) -> str:
    """The stream's answer when it runs alone (48 tokens: it is still decoding while the probes run)."""
    answer = post(url, "/v1/completions", STREAM).json()["choices"][0]
    assert answer["finish_reason"] == "length"
    return answer["text"]


def post(url: str, path: str, body, key: str | None = KEY, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
    return err


def metrics(url: str, key: str = METRICS_KEY) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}


@contextmanager
def beside_a_stream(url: str, solo: str) -> Iterator[None]:
    """Runs the body while a greedy stream decodes and /health is polled: then the stream's text must be its solo
    answer, /health must have answered within HEALTH_S each time, and nothing may be left running."""
    text, started, slowest, done = [], threading.Event(), [0.0], threading.Event()

    def stream() -> None:
        body, headers = {**STREAM, "stream": True}, {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    started.set()
        started.set()

    def health() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
            slowest[0] = max(slowest[0], time.perf_counter() - t0)
            time.sleep(0.05)

    threads = [threading.Thread(target=stream), threading.Thread(target=health)]
    threads[0].start()
    assert started.wait(60)
    threads[1].start()
    try:
        yield
    finally:
        threads[0].join(120)
        done.set()
        threads[1].join(30)
    assert "".join(text) == solo
    assert slowest[0] < HEALTH_S, f"/health took {slowest[0]:.2f} s"
    idle(url)


def idle(url: str) -> None:
    """Wait (up to 30 s) until nothing is running, queued or reserved."""
    deadline = time.monotonic() + 30
    keys = ("swiftdecode_requests_running", "swiftdecode_queue_depth", "swiftdecode_kv_reserved_bytes")
    while any((m := metrics(url))[k] for k in keys):
        assert time.monotonic() < deadline, {k: m[k] for k in keys}
        time.sleep(0.05)


# ---------------------------------------------------------------- 1. a long stop string froze the event loop


def test_a_long_stop_string_is_refused_beside_a_stream(url, solo):
    with beside_a_stream(url, solo):
        body = {**STREAM, "stream": True, "stop": ["x" * 200_000]}  # took 12.5 s for 30 tokens
        assert "1024 characters" in error_of(post(url, "/v1/completions", body), 400, "stop")["message"]
        error_of(post(url, "/v1/completions", {**body, "stop": ["x" * 3_000_000]}), 413)  # froze the server


def test_held_back_text_is_the_longest_end_that_begins_a_stop_string():
    """stop_overlap (bounded work per stop string) against the definition, on strings over a small alphabet."""
    import random

    from swiftdecode.decoding.request import stop_overlap

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 8)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        want = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        assert stop_overlap(text, stops) == want, (text, stops)


# ---------------------------------------------------------------- 2. one request failed the whole batch


def test_a_degenerate_temperature_is_refused_beside_a_stream(url, solo):
    with beside_a_stream(url, solo):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 1e-300, "top_p": 0.5}
        error_of(post(url, "/v1/completions", body), 400, "temperature")


def test_a_request_failing_mid_round_leaves_the_batch_alone(smollm):
    """A request whose own part of a round raises (here its sampler, on its 6th pick) leaves the batch with the
    exception as its event; the others decode exactly their solo answers."""
    from swiftdecode.engine.batch import Batch

    gen = Generator(*smollm, method="swift")
    prompts = ["Name three fruits.", "Count from one to ten.", "What is the capital of France?"]
    solo = [gen.generate(p, chat=True, max_new_tokens=24, cache_salt="solo").token_ids for p in prompts]
    batch, reqs = Batch(gen), [gen.request(p, chat=True, max_new_tokens=24) for p in prompts]
    bad, picks, real = reqs[1], [0], reqs[1].sampler.pick

    def pick(*args, **kw):
        picks[0] += 1
        if picks[0] > 5:
            raise RuntimeError("this request's own failure")
        return real(*args, **kw)

    bad.sampler.pick = pick
    failures = []
    for req in reqs:
        batch.add(req)
    while len(batch):
        failures += [(r, e) for r, e in batch.step() if isinstance(e, Exception)]
    assert [r for r, _ in failures] == [bad] and "own failure" in str(failures[0][1])
    assert [reqs[0].new, reqs[2].new] == [solo[0], solo[2]]


# ---------------------------------------------------------------- 3. the decoding thread could be monopolised


def test_a_costly_grammar_ends_its_own_request_beside_a_stream(url, solo):
    with beside_a_stream(url, solo):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 1000, "temperature": 0}
        body["grammar"] = {"lark": 'start: x\nx: x x | "a"'}
        err = error_of(post(url, "/v1/completions", body), 400, "grammar")
        assert "costly" in err["message"] or "parser stopped" in err["message"]


def test_a_huge_prompt_is_refused_before_tokenizing(url, solo):
    with beside_a_stream(url, solo):
        body = {"model": MODEL, "prompt": "lorem ipsum " * (2**20 // 13), "max_tokens": 4}  # within 1 MiB
        assert "characters" in error_of(post(url, "/v1/completions", body), 400)["message"]
        ids = {"model": MODEL, "prompt": [1] * 300_000, "max_tokens": 4}  # token ids: counted, not converted
        assert "context" in error_of(post(url, "/v1/completions", ids), 400)["message"]


class Counting:
    """A Generator wrapper counting chat_ids calls (the prompt's encoding)."""

    def __init__(self, gen):
        self.gen, self.encoded = gen, 0

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def chat_ids(self, messages, tools=None):
        self.encoded += 1
        return self.gen.chat_ids(messages, tools)


def test_the_choices_of_a_request_encode_its_prompt_once(smollm):
    counting = Counting(Generator(*smollm, method="ar"))
    with serving(create_app(counting, MODEL)) as base:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 3}
        r = post(base, "/v1/chat/completions", {**body, "seed": 1, "temperature": 0.8}, None)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert counting.encoded == 1


def test_echo_scoring_is_inside_the_kv_budget(gen):
    """Scoring a prompt (echo with logprobs) needs its KV cache: a prompt that does not fit is a 413, not a
    forward outside the budget (max_tokens 0 used to skip the check)."""
    per_token = gen.sm.kv_layout().bytes(1)
    with serving(create_app(gen, MODEL, kv_gb=200 * per_token / 2**30)) as base:
        body = {"model": MODEL, "prompt": "one two three four five six seven", "echo": True, "logprobs": 1}
        assert post(base, "/v1/completions", {**body, "max_tokens": 0}, None).status_code == 200
        long = {**body, "prompt": "one two three " * 40, "max_tokens": 0}  # 120 tokens + a round's slack > 200
        assert "KV cache" in error_of(post(base, "/v1/completions", long, None), 413)["message"]


def test_a_long_echo_is_scored_between_the_others_rounds(gen, url, solo):
    """Scoring a long prompt (echo with logprobs, 6 chunks) holds a running stream for one chunk at a time, not
    for the whole prompt: the stream goes on decoding while it is scored, both answers are their solo answers."""
    from swiftdecode.decoding.logprobs import PROMPT_CHUNK, prompt_logprobs

    ids = [int(t) for t in gen.tokenizer("The quick brown fox jumps over the lazy dog. " * 140).input_ids]
    ids = ids[: 6 * PROMPT_CHUNK - 10]
    arrivals, first = [], threading.Event()

    def stream() -> None:
        body, headers = {**STREAM, "stream": True}, {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.perf_counter(), json.loads(line[6:])["choices"][0]["text"]))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    t0 = time.perf_counter()
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "cache_salt": "echo-test"}
    r = post(url, "/v1/completions", body)
    t1 = time.perf_counter()
    t.join(120)
    assert r.status_code == 200, r.text[:300]
    assert "".join(text for _, text in arrivals) == solo
    during = [a for a, _ in arrivals if t0 < a < t1]
    assert len(during) >= 3, (len(during), len(arrivals), t1 - t0)  # whole-prompt scoring let none through
    idle(url)  # the worker is done: the generator's model is free for the reference
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == [e.logprob for e in prompt_logprobs(gen.sm, ids, 1)[0]]  # chunks between rounds: the same entries


def test_echoes_waiting_their_turn_to_be_scored_hold_no_room(gen):
    """Two long echoes (scored one prompt at a time) and then a short request, under a KV budget that holds one
    echo's prompt and the short request but not both prompts: the second echo waits its turn holding no KV cache,
    so the short request is answered while the first echo is still being scored (it used to wait for the first
    echo's end behind the second), and every answer is its solo answer."""
    from swiftdecode.decoding.logprobs import PROMPT_CHUNK
    from swiftdecode.decoding.request import ROUND_SLACK

    def ids(text: str) -> list[int]:
        return [int(t) for t in gen.tokenizer(text * 400).input_ids][: 12 * PROMPT_CHUNK]

    first, second = ids("The quick brown fox jumps over the lazy dog. "), ids("A stitch in time saves nine. ")
    short = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    entries = len(first) + 2 * ROUND_SLACK + 64  # one echo's prompt, and room for the short request
    echo = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 0}
    with serving(create_app(gen, MODEL, kv_gb=entries * gen.sm.kv_layout().bytes(1) / 2**30)) as base:
        with ThreadPoolExecutor(2) as pool:
            one = pool.submit(post, base, "/v1/completions", {**echo, "prompt": first}, None)
            while metrics(base)["swiftdecode_kv_reserved_bytes"] == 0:  # the first echo is being scored
                time.sleep(0.01)
            two = pool.submit(post, base, "/v1/completions", {**echo, "prompt": second, "n": 2}, None)
            while metrics(base)["swiftdecode_queue_depth"] < 2:
                time.sleep(0.01)
            answer = post(base, "/v1/completions", short, None)
            assert answer.status_code == 200 and not one.done()
            results = [one.result(), two.result()]
        assert [len(r.json()["choices"]) for r in results] == [1, 2]
        scored = [r.json()["choices"][0]["logprobs"]["token_logprobs"] for r in results]
        assert [len(s) for s in scored] == [len(first), len(second)]
        assert answer.json()["choices"][0]["text"] == gen.generate("Once upon a time", max_new_tokens=4).text
        idle(base)


# ---------------------------------------------------------------- 4. the prefix cache leaked other users' text


def test_the_prefix_cache_is_shared_only_within_a_tenant(url):
    """cached_tokens across API keys is always 0; within one key (and one cache_salt or user) it still reuses."""
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    chat["messages"] = [{"role": "system", "content": "You are a terse assistant for a bank. " * 8}]
    chat["messages"].append({"role": "user", "content": "What is my balance?"})

    def cached(key: str, **extra) -> int:
        r = post(url, "/v1/chat/completions", {**chat, **extra}, key)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY) == 0
    assert cached(OTHER_KEY) == 0  # the same prompt, another tenant
    assert cached(KEY) > 50 and cached(OTHER_KEY) > 50  # each reuses its own
    assert cached(KEY, cache_salt="team-x") == 0 and cached(KEY, cache_salt="team-x") > 50
    assert cached(KEY, user="alice") == 0 and cached(KEY, user="alice") > 50
    error_of(post(url, "/v1/chat/completions", {**chat, "cache_salt": "s" * 257}), 400)


def test_the_copy_pool_is_shared_only_within_a_tenant(gen):
    """The pool probe: after a tenant's answer, a caller asks the same question and reads how many of its tokens
    came from copies (the suffix drafter copies from its own text and its tenant's pool). Within the key (the
    control: the probe works) the earlier answer is copied; across keys nothing of it is, whatever `user` or
    `cache_salt` the caller sends; the answers are the same. Responses carry no engine statistics unless the
    server is asked to (`response_stats`)."""
    body = {"model": MODEL, "prompt": "Describe a walk through an old forest.", "max_tokens": 40, "temperature": 0}

    def copied(base: str, key: str, **extra) -> tuple[str, int, int]:
        r = post(base, "/v1/completions", {**body, **extra}, key).json()
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        return r["choices"][0]["text"], r["swiftdecode"]["accepted_by_source"]["suffix"], cached

    with serving(create_app(gen, MODEL, api_key=[KEY, OTHER_KEY], response_stats=True)) as base:
        secret = copied(base, KEY)[0]  # joins KEY's pool
        across = [copied(base, OTHER_KEY, **extra) for extra in ({"user": "u"}, {"cache_salt": "s"}, {})]
        within = copied(base, KEY)
    assert all(text == secret for text, _, _ in [*across, within])
    assert [cached for _, _, cached in across] == [0, 0, 0] and within[2] > 0
    assert within[1] > 2 * max(n for _, n, _ in across) + 8, (within, across)
    with serving(create_app(gen, MODEL, api_key=KEY)) as base:
        assert "swiftdecode" not in post(base, "/v1/completions", body, KEY).json()


# ---------------------------------------------------------------- 5. readers that never read, slow bodies


def test_a_reader_that_never_reads_holds_a_bounded_buffer(smollm):
    """A job whose events nobody takes (its event loop never runs) stops being decoded at MAX_UNREAD events,
    and the worker goes on serving others meanwhile."""
    from swiftdecode.apps.server.jobs import MAX_UNREAD, Job, Prompt
    from swiftdecode.apps.server.metrics import Metrics
    from swiftdecode.apps.server.worker import Worker
    from swiftdecode.base.params import check_params

    worker = Worker(Generator(*smollm, method="ar"), 4, Metrics(), max_batch=4)
    assert worker.warm.wait(60)
    params = {"params": check_params(1000)}  # the engine keywords the server's protocol gives a job
    stuck = Job(Prompt("1, 2, 3, 4, 5, 6,", False), params, asyncio.new_event_loop())
    try:
        worker.submit(stuck)
        deadline = time.monotonic() + 60
        while stuck.unread <= MAX_UNREAD:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held = stuck.unread
        loop = asyncio.new_event_loop()
        other = Job(Prompt("Hi", False), {"params": check_params(8)}, loop)
        worker.submit(other)
        items = loop.run_until_complete(asyncio.wait_for(drain(other), 60))
        assert items[-1] is END and any(getattr(i, "result", None) for i in items)
        assert stuck.unread == held <= MAX_UNREAD + 2  # a round's event or two past the line, no more
    finally:
        worker.close()


async def drain(job) -> list:
    """A job's events up to END."""
    items = [await job.next()]
    while items[-1] is not END:
        items.append(await job.next())
    return items


def test_a_body_that_trickles_in_gets_408(url, solo):
    with beside_a_stream(url, solo):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            sock.sendall(f"{head}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{".encode())
            assert sock.recv(4096).split(b"\r\n")[0].endswith(b"408 Request Timeout")


# ---------------------------------------------------------------- 6. large bodies blocked the event loop


def test_a_logit_bias_flood_is_refused_beside_a_stream(url, solo):
    bias = {str(i): 1 for i in range(90_000)}  # just under the body limit of SmolLM2's server (1 MiB)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logit_bias": bias}, separators=",:")
    big = json.dumps({"model": MODEL, "prompt": "Hi", "logit_bias": {str(i): 1 for i in range(1_000_000)}})
    with beside_a_stream(url, solo):  # (the client shares this process: its own work counts against /health too)
        assert "300" in error_of(post(url, "/v1/completions", body), 400, "logit_bias")["message"]
        assert "bytes" in error_of(post(url, "/v1/completions", big), 413)["message"]
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(300)}}
    assert post(url, "/v1/completions", ok).status_code == 200


# ---------------------------------------------------------------- 7. open endpoints


def test_metrics_and_docs_are_not_open(gen, url):
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OTHER_KEY}"}).status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).status_code == 200
    with serving(create_app(gen, MODEL, api_key=[KEY, OTHER_KEY])) as base:  # several tenants: not without its key
        r = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 403 and "--metrics-key" in r.json()["error"]["message"]
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{page}").status_code == 404
    with serving(create_app(gen, MODEL, api_key=KEY, metrics_key="sk-metrics", docs=True)) as base:
        assert httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 401
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-metrics"}).status_code == 200
        assert httpx.get(f"{base}/openapi.json").status_code == 200


# ---------------------------------------------------------------- 8. edge cases: 400 not 500, OpenAI's shapes


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "M", "prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
        (b'{"model": "M", "prompt": "Hi", "logit_bias": {"1' + b"0" * 5000 + b'": 1}}', "logit_bias"),
        (b'{"model": "M", "prompt": "\\ud800"}', None),
        (b'{"model": "\\udfff", "prompt": "Hi"}', None),
    ],
)
def test_malformed_numbers_and_strings_are_400(url, raw, param):
    error_of(post(url, "/v1/completions", raw.replace(b'"M"', json.dumps(MODEL).encode())), 400, param)


def test_error_shapes_are_openais(url):
    r = post(url, "/v1/completions", STREAM, key="wrong")
    err = error_of(r, 401)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    err = error_of(post(url, "/v1/completions", {**STREAM, "model": "gpt-4"}), 404, "model")
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"


def test_unhandled_errors_are_counted(gen, monkeypatch):
    from swiftdecode.apps.server import protocol

    def broken(*args):
        raise RuntimeError("a bug")

    with serving(create_app(gen, MODEL)) as base:
        monkeypatch.setattr(protocol, "parse_request", broken)
        r = post(base, "/v1/completions", STREAM, None)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        text = httpx.get(f"{base}/metrics").text
    assert 'swiftdecode_http_requests_total{path="/v1/completions",status="500"} 1' in text


def test_an_empty_api_key_is_refused(gen):
    from swiftdecode.apps.cli import main

    with pytest.raises(UserError, match="empty"):
        create_app(gen, MODEL, api_key="")
    assert main(["serve", "--model", MODEL, "--api-key", ""]) == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn exits its thread
def test_a_failed_warm_up_stops_the_server_from_starting(gen, monkeypatch):
    def fail():
        raise RuntimeError("no memory for the warm-up")

    monkeypatch.setattr(gen, "warm_up", fail)
    with pytest.raises(RuntimeError, match="did not start"), serving(create_app(gen, MODEL)):
        pass


def test_a_stopped_worker_makes_health_fail(gen):
    app = create_app(gen, MODEL)
    with serving(app) as base:
        app.state.api.worker.failure = RuntimeError("stopped")  # as the worker's loop records a crash
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        error_of(post(base, "/v1/completions", STREAM, None), 503)


def test_log_probabilities_are_always_valid_json():
    from swiftdecode.apps.server.responses import MIN_LOGPROB, logprobs_json
    from swiftdecode.decoding.logprobs import TokenLogprob

    entries = [TokenLogprob(1, -math.inf, ((2, math.nan),)), TokenLogprob(2, math.nan, ())]
    for chat in (True, False):
        out = json.loads(json.dumps(logprobs_json(entries, chat, str), allow_nan=False))
        values = [c["logprob"] for c in out["content"]] if chat else out["token_logprobs"]
        assert values == [MIN_LOGPROB, None]


def test_kv_reservations_grow_and_an_evicted_request_resumes_exactly(gen):
    """A request reserves the KV entries of its context and a round's slack, and more as its cache grows (a chat
    request without max_tokens used to reserve the whole context up front). When no running request can grow,
    the last started gives its cache back and later prefills its context again: every answer is its solo one."""
    from concurrent.futures import ThreadPoolExecutor

    prompts, body = ["The sky is", "Water boils at", "1, 2, 3,"], {"model": MODEL, "max_tokens": 60, "temperature": 0}
    solo = [gen.generate(p, max_new_tokens=60, cache_salt="solo").text for p in prompts]
    entries = 1.5 * (8 + 60 + 128)  # one request's prompt, max_tokens and round's slack, and half another's
    with serving(create_app(gen, MODEL, kv_gb=entries * gen.sm.kv_layout().bytes(1) / 2**30)) as base:
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: post(base, "/v1/completions", {**body, "prompt": p}, None), prompts))
        assert [r.json()["choices"][0]["text"] for r in outs] == solo
        m = metrics(base)
    assert m["swiftdecode_preemptions_total"] >= 1 and m["swiftdecode_kv_reserved_bytes"] == 0


def test_a_chat_without_max_tokens_reserves_what_it_holds(gen, url):
    """Its budget is the rest of the context, but while it runs it reserves about what its cache holds."""
    content = "Count from 1 to 1000, one number per line."
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(8):  # a few chunks in: it is decoding
            next(lines)
        reserved = metrics(url)["swiftdecode_kv_reserved_bytes"]
    assert 0 < reserved < gen.sm.kv_layout().bytes(1) * gen.sm.max_length / 16
    idle(url)  # closing the stream cancelled it


def test_freed_heap_memory_goes_back_to_the_system():
    """The worker's idle-time trim (server/heap.py) reaches glibc's malloc_trim where the C library is glibc."""
    import platform

    from swiftdecode.apps.server.heap import release_free_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    blocks = [bytearray(1 << 16) for _ in range(2000)]  # ~128 MiB in small blocks, then freed: pages to return
    del blocks
    assert release_free_memory() is True
