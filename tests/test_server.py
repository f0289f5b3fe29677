"""`swiftdecode serve`: a real uvicorn server on 127.0.0.1, driven by the `openai` client and raw HTTP."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from swiftdecode import Generator, UserError
from swiftdecode.apps.bench.concurrency import serving
from swiftdecode.apps.server import create_app

MODEL = "smollm2-135m"
KEY = "sk-test"


@pytest.fixture(scope="module")
def gen(smollm):
    return Generator(*smollm, method="swift")


@pytest.fixture(scope="module")
def url(gen) -> Iterator[str]:
    with serving(create_app(gen, MODEL, max_queue=6, api_key=KEY)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def metrics(url: str, key: str | None = KEY) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; /metrics asks for the API key where the server has one."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    text = r.text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}


# ---------------------------------------------------------------- openai client, greedy == engine


def test_server_is_ready_only_after_the_worker_warmed_up(gen, monkeypatch):
    """The server starts serving only once its worker thread has run the first forwards (`Generator.warm_up`,
    from the thread that decodes)."""
    done, real = [], gen.warm_up
    monkeypatch.setattr(gen, "warm_up", lambda: (time.sleep(0.5), real(), done.append(True)))
    with serving(create_app(gen, MODEL)):
        assert done


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # open even with --api-key


def test_completion_matches_engine(gen, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = gen.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_matches_engine(gen, client):
    question = "What is 2 + 2? Answer briefly."
    messages = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ref = gen.generate(question, max_new_tokens=10, temperature=0.0, chat=True)  # as `generate --chat`
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_logprobs_are_the_engines_in_every_response_shape(gen, client):
    """Chat and completions, whole and streamed: each token's log-probability and alternatives, as the engine
    reports them (the verification rows of speculative rounds: plain decoding's numbers)."""
    question = "Count from 1 to 10."
    ref = gen.generate(question, chat=True, max_new_tokens=16, temperature=0.0, logprobs=2)
    messages = [{"role": "user", "content": question}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [
        t
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    for content in (whole, streamed):
        assert [t.logprob for t in content] == [e.logprob for e in ref.logprobs]
        assert "".join(t.token for t in content) == ref.text
        for t, e in zip(content, ref.logprobs, strict=True):
            assert [a.logprob for a in t.top_logprobs] == [lp for _, lp in e.top]
        assert all(bytes(t.bytes).decode() == t.token for t in content)
    prompt = "1, 2, 3, 4,"
    ref = gen.generate(prompt, max_new_tokens=12, temperature=0.0, stop=[" 9"], logprobs=1)
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[" 9"], logprobs=1, stream=stream
        )
        parts = [c.choices[0].logprobs for c in (r if stream else [r]) if c.choices[0].logprobs]
        assert [lp for p in parts for lp in p.token_logprobs] == [e.logprob for e in ref.logprobs]
        assert "".join(t for p in parts for t in p.tokens) == ref.text
        offsets = [o for p in parts for o in p.text_offset]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert all(len(t) == 1 for p in parts for t in p.top_logprobs)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].logprobs is None


def test_streamed_text_offsets_count_the_tokens_before_whatever_the_chunking():
    """An entry can arrive after its token's text went out (the engine releases entries once all their text is
    streamed): its text_offset still counts the characters of the tokens before it."""
    import asyncio

    from swiftdecode.apps.server.streaming import sse_chunks
    from swiftdecode.decoding.logprobs import TokenLogprob
    from swiftdecode.decoding.request import GenerationResult, GenerationStats, StreamEvent

    texts = {1: "ab", 2: "c", 3: "de"}
    entries = [TokenLogprob(t, -0.5, ()) for t in texts]
    result = GenerationResult("abcde", [1, 2, 3], 4, "length", GenerationStats())
    events = [
        StreamEvent("ab", [1]),
        StreamEvent("c", [2], None, entries[:2]),
        StreamEvent("de", [3], result, entries[2:]),
    ]

    async def run() -> list[str]:
        async def rest():
            for ev in events[1:]:
                yield ev

        return [c async for c in sse_chunks({}, False, False, [(events[0], rest())], texts.get)]

    chunks = [json.loads(c[6:]) for c in asyncio.run(run()) if c.startswith("data: {")]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [o for lp in lps for o in lp["text_offset"]] == [0, 2, 3]


def test_echo_scores_the_prompt(gen, client, url):
    """/v1/completions' echo (as lm-eval's local-completions uses it): the prompt's tokens with their
    log-probabilities, the first without one, then the answer's, which are the engine's."""
    from swiftdecode.decoding.logprobs import prompt_logprobs

    prompt = "The capital of France is"
    ids = gen.encode(prompt)
    scored, _ = prompt_logprobs(gen.sm, ids, 1)
    ref = gen.generate(prompt, max_new_tokens=6, logprobs=1)
    for max_tokens, tail in ((0, []), (6, ref.logprobs)):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt + (ref.text if max_tokens else "") == "".join(lp.tokens)
        assert lp.token_logprobs == [None] + [e.logprob for e in scored + tail] and lp.top_logprobs[0] is None
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(tail)
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1})
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)] == [e.logprob for e in scored]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None
    for max_tokens in (0, 6):  # streamed: the first chunk holds the prompt, the whole equals the unstreamed answer
        kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
        whole, parts = client.completions.create(**kw), list(client.completions.create(**kw, stream=True))
        assert parts[0].choices[0].text == prompt and "".join(p.choices[0].text for p in parts) == whole.choices[0].text
        lps = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [x for lp in lps for x in getattr(lp, key)] == getattr(whole.choices[0].logprobs, key), key


def test_penalties_are_the_engines(gen, client):
    prompt, kw = "1, 2, 3, 4,", dict(presence_penalty=0.5, frequency_penalty=1.0)
    ref = gen.generate(prompt, max_new_tokens=16, temperature=0.0, **kw)
    assert ref.text != gen.generate(prompt, max_new_tokens=16, temperature=0.0).text  # they change the answer
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, **kw)
    assert r.choices[0].text == ref.text


def test_sampling_controls_are_the_engines(smollm, client):
    """repetition_penalty, min_p and logit_bias as the engine applies them: the server's answers equal a fresh
    generator's, after everything the shared server has served before."""
    prompt = "def add(a, b):"
    fresh = Generator(*smollm, method="swift")
    cases = [
        dict(repetition_penalty=1.1),
        dict(temperature=0.9, seed=3, min_p=0.2),
        dict(ignore_eos=True),
        dict(min_tokens=12),
    ]
    first = fresh.generate(prompt, max_new_tokens=16).token_ids[0]
    cases.append(dict(logit_bias={first: -100.0}))
    for kw in cases:
        ref = fresh.generate(prompt, max_new_tokens=16, **{"temperature": 0.0, **kw}).text
        wire = {**kw, "logit_bias": {str(t): b for t, b in kw["logit_bias"].items()}} if "logit_bias" in kw else kw
        extra = {k: v for k, v in wire.items() if k in ("repetition_penalty", "min_p", "ignore_eos", "min_tokens")}
        std = {k: v for k, v in wire.items() if k not in extra}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, **{"temperature": 0, **std}, extra_body=extra
        )
        assert r.choices[0].text == ref, kw


def test_structured_output(gen, client):
    """response_format json_object / json_schema and the `grammar` extension, answered as the engine answers."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Name a city in France, as JSON."}]
    ref = gen.generate(gen.chat_ids(messages), max_new_tokens=40, grammar={"json_schema": schema}).text
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=fmt, stream=stream
        )
        text = "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
        assert text == ref and set(json.loads(text)) == {"city"}
    ask = [{"role": "user", "content": "Give a JSON object with a city in France."}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=MODEL, prompt="The year is", max_tokens=8, temperature=0, extra_body={"grammar": {"regex": " [0-9]{4}"}}
    )
    assert re.fullmatch(" [0-9]{4}", r.choices[0].text)


def test_n_choices_decode_together_as_separate_requests(gen, client, url):
    """`n` choices: choice i samples with seed + i, exactly as the engine answers that seed alone; streamed
    choices interleave by index; usage counts the prompt once and every choice's tokens."""
    prompt, kw = "Once upon a time", dict(max_tokens=12, temperature=0.9, seed=7)
    refs = [gen.generate(prompt, max_new_tokens=12, temperature=0.9, seed=7 + i) for i in range(3)]
    assert len({ref.text for ref in refs}) > 1
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == [ref.text for ref in refs]
    assert r.usage.completion_tokens == sum(len(ref.token_ids) for ref in refs)
    messages = [{"role": "user", "content": prompt}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, **kw)
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(2)
    ]
    assert texts == [c.message.content for c in whole.choices] and chunks[-1].usage == whole.usage
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "n": 16, "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16  # 8 run, 8 wait in the queue's one place
    deadline = time.time() + 30
    while (m := metrics(url))["swiftdecode_requests_running"] or m["swiftdecode_queue_depth"]:
        assert time.time() < deadline
        time.sleep(0.1)


def test_stop_and_seed(gen, client):
    prompt = "1, 2, 3, 4, 5,"
    full = gen.generate(prompt, max_new_tokens=16, temperature=0.0).text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    want = full[: full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=stream
        )
        choices = [c.choices[0] for c in r] if stream else r.choices
        assert "".join(c.text for c in choices) == want and choices[-1].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=7, extra_body={"top_k": 20}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


# ---------------------------------------------------------------- raw HTTP: errors never hurt the server


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", "{not json", None),
        ("/v1/completions", "[1, 2]", None),
        ("/v1/completions", "[" * 100_000, None),
        ("/v1/completions", {"prompt": "hi"}, "model"),
        ("/v1/completions", {"model": 7, "prompt": "hi"}, "model"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": 42}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [-1, 5]}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, None),
        ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 4}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": True}, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 10**400}, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": "1"}, "frequency_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": -1}, "top_k"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "min_tokens": 99, "max_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": {"regex": "[a-"}}, "grammar"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": {"sql": "x"}}, "grammar"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": 1}, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True},
            "echo",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -3}, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [42] * 9000, "max_tokens": 4}, None),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0]"),
    ],
)
def test_bad_request_is_400(url, path, body, param):
    err = assert_error(post(url, path, body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_auth_model_route_errors_then_recovery(url, gen):
    ok = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert assert_error(post(url, "/v1/completions", ok, key=None), 401)["code"] == "invalid_api_key"
    assert_error(post(url, "/v1/completions", ok, key="sk-wrong"), 401)
    assert_error(httpx.get(f"{url}/v1/models"), 401)
    assert assert_error(post(url, "/v1/completions", {**ok, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    assert_error(httpx.get(f"{url}/v1/nowhere"), 404)
    r = post(url, "/v1/completions", ok)  # every failure above left the server healthy
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == gen.generate("Hello", max_new_tokens=3).text


# ---------------------------------------------------------------- concurrency


def test_concurrent_streams_complete_or_429(url, gen):
    """16 simultaneous streams against max_queue=6: each completes exactly or gets a clean 429; none lost."""
    prompts = [f"Write a short fact about the number {i}." for i in range(16)]

    def ask(prompt: str) -> tuple[int, str, str | None]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text, r.headers.get("retry-after")
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return 200, "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1]), None

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, prompts))
    assert all(status in (200, 429) for status, _, _ in results), results
    assert sum(status == 200 for status, _, _ in results) >= 1
    for status, text, retry_after in results:
        if status == 429:
            assert int(retry_after) >= 1 and json.loads(text)["error"]["code"] == "queue_full"
    retried = [results[i] if results[i][0] == 200 else ask(p) for i, p in enumerate(prompts)]  # none lost
    assert [text for _, text, _ in retried] == [gen.generate(p, max_new_tokens=6).text for p in prompts]
    m = metrics(url)
    assert m["swiftdecode_queue_depth"] == 0 and m["swiftdecode_requests_running"] == 0
    rounds = sum(v for k, v in m.items() if k.startswith("swiftdecode_rounds_total{"))
    assert rounds > 0  # some answers end at once with EOS (no round); the others took rounds
    assert all(
        k in m for k in ('swiftdecode_accepted_tokens_total{source="skip"}', 'swiftdecode_rounds_total{kind="plain"}')
    )


class Controlled:
    """A Generator wrapper whose requests wait for `gate` when they start, and fail on demand (to test the queue and
    errors)."""

    def __init__(self, gen):
        self.gen, self.gate, self.entered = gen, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def request(self, prompt, **kw):
        self.entered.set()
        assert self.gate.wait(60)
        text = self.gen.decode(prompt)  # the worker hands the engine the prompt's ids
        if text == "raise UserError":
            raise UserError("rejected by the engine", status=422)
        if text == "raise RuntimeError":
            raise RuntimeError("boom")
        return self.gen.request(prompt, **kw)


def test_queue_full_disconnect_and_engine_errors(gen):
    wrapped = Controlled(gen)
    with serving(create_app(wrapped, MODEL, max_queue=1, max_batch=1)) as url, ThreadPoolExecutor(2) as pool:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
        running = pool.submit(post, url, "/v1/completions", body, None)
        assert wrapped.entered.wait(30)
        three = {**body, "prompt": "In the beginning", "n": 3}  # its 3 choices take the queue's one place together
        queued = pool.submit(post, url, "/v1/completions", three, None)
        while httpx.get(f"{url}/health").json()["queued"] != 1:  # /health answers while the worker is busy
            assert not queued.done(), queued.result().text
            time.sleep(0.02)
        full = post(url, "/v1/completions", body, None)
        assert_error(full, 429)
        assert int(full.headers["retry-after"]) >= 1
        wrapped.gate.set()
        outs = [running.result(), queued.result()]
        assert [r.json()["choices"][0]["text"] for r in outs] == [
            gen.generate(p, max_new_tokens=5).text for p in ("Once upon a time", "In the beginning")
        ]
        assert len({c["text"] for c in outs[1].json()["choices"]}) == 1 and len(outs[1].json()["choices"]) == 3
        used = sum(r.json()["usage"]["completion_tokens"] for r in outs)

        # a client that leaves mid-stream frees the worker at its next token
        long = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.monotonic() + 60
        while metrics(url).get('swiftdecode_requests_total{outcome="cancelled"}') != 1:
            assert time.monotonic() < deadline, "stream was not cancelled"
            time.sleep(0.05)
        streamed = metrics(url)["swiftdecode_generated_tokens_total"] - used
        assert 1 <= streamed < 400

        assert_error(post(url, "/v1/completions", {**body, "prompt": "raise UserError"}, None), 422)
        assert_error(post(url, "/v1/completions", {**body, "prompt": "raise RuntimeError"}, None), 500)
        r = post(url, "/v1/completions", {**body, "stream": True}, None)
        data = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == outs[0].json()["choices"][0]["text"]
        m = metrics(url)
        assert m['swiftdecode_requests_total{outcome="error"}'] == 2
        assert m["swiftdecode_queue_depth"] == 0 and m["swiftdecode_mean_accepted_tokens"] >= 1
        assert m['swiftdecode_http_requests_total{path="/v1/completions",status="429"}'] == 1
        assert any(k.startswith("swiftdecode_search_state{") for k in m)
        assert 'swiftdecode_skip_layers{kind="attn"}' in m
        assert "swiftdecode_draft_sparsity_level" in m


def test_concurrent_requests_decode_together_exactly_and_disconnects_free_slots(gen):
    """8 clients at once (max_batch 8): every answer is its solo run; then 10 clients that leave mid-stream leave
    nothing running or queued behind."""
    prompts = [f"Tell me one thing about the number {i}." for i in range(8)]
    with serving(create_app(gen, MODEL, max_queue=16, max_batch=8)) as url, ThreadPoolExecutor(8) as pool:
        ask = lambda p: post(url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0})
        texts = [r.json()["choices"][0]["text"] for r in pool.map(ask, prompts)]
        assert texts == [gen.generate(p, max_new_tokens=24).text for p in prompts]
        m = metrics(url)
        assert m["swiftdecode_time_to_first_token_seconds_count"] >= 1
        assert m['swiftdecode_queue_wait_seconds_bucket{le="+Inf"}'] == 8

        def leave(i: int) -> None:
            body = {"model": MODEL, "prompt": f"Count to {100 + i}:", "max_tokens": 300, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                next(r.iter_lines())

        list(pool.map(leave, range(10)))
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "Count:", "n": 3, "max_tokens": 300, "stream": True},
            timeout=60,
        ) as r:
            next(r.iter_lines())  # three choices, left after one chunk
        deadline = time.monotonic() + 60
        held = ("swiftdecode_requests_running", "swiftdecode_queue_depth", "swiftdecode_kv_reserved_bytes")
        while any((m := metrics(url))[k] for k in held):
            assert time.monotonic() < deadline, "a disconnected client's request or its KV memory is still held"
            time.sleep(0.05)
        assert m['swiftdecode_requests_total{outcome="cancelled"}'] == 13


def test_request_timeout_ends_a_long_generation_with_504(gen):
    with serving(create_app(gen, MODEL, timeout_s=1.0)) as url:
        long = {"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 2000, "temperature": 0}
        err = assert_error(post(url, "/v1/completions", long), 504)
        assert err["code"] == "timeout"
        m = metrics(url)
        assert m['swiftdecode_requests_total{outcome="timeout"}'] == 1 and m["swiftdecode_requests_running"] == 0
        ok = post(url, "/v1/completions", {**long, "max_tokens": 4})  # the server carries on
        assert (
            ok.status_code == 200
            and ok.json()["choices"][0]["text"] == gen.generate("1, 2, 3, 4, 5,", max_new_tokens=4).text
        )


def test_kv_budget_queues_what_does_not_fit_and_rejects_what_never_can(gen):
    """--max-kv-gb: requests reserve prompt + max_tokens of KV cache; two that do not fit together run one after
    the other (both exact), one that can never fit gets 413 at once."""
    per_request = (8 + 60 + 128) * gen.sm.kv_layout().bytes(1)  # prompt, max_tokens, a round's slack
    with serving(create_app(gen, MODEL, kv_gb=1.5 * per_request / 2**30)) as url, ThreadPoolExecutor(2) as pool:
        body = {"model": MODEL, "max_tokens": 60, "temperature": 0}
        prompts = ["The sky is", "Water boils at"]
        outs = list(pool.map(lambda p: post(url, "/v1/completions", {**body, "prompt": p}), prompts))
        assert [r.json()["choices"][0]["text"] for r in outs] == [
            gen.generate(p, max_new_tokens=60).text for p in prompts
        ]
        err = assert_error(post(url, "/v1/completions", {**body, "prompt": "Hi", "max_tokens": 1000}), 413)
        assert "KV cache" in err["message"]
        m = metrics(url)
        assert m["swiftdecode_requests_running"] == 0 and m["swiftdecode_queue_depth"] == 0


def test_chat_turns_reuse_the_prefix_cache_and_answer_as_without_it(smollm, gen):
    """A second chat turn copies the first turn's cache entries (usage reports them as cached tokens, /metrics
    counts them) and answers exactly as a server without the prefix cache does."""
    from swiftdecode.apps.cli import main

    warm = Generator(*smollm, method="swift", prefix_cache_gb=0.25)
    with serving(create_app(warm, MODEL)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        history, cached = [{"role": "user", "content": "Name a color."}], []
        for follow_up in ("Name another one.", "And a third?"):
            r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
            ref = gen.generate(gen.chat_ids(history), max_new_tokens=16)
            assert r.choices[0].message.content == ref.text
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            history += [{"role": "assistant", "content": ref.text}, {"role": "user", "content": follow_up}]
        m = metrics(base)
    assert cached[0] == 0 and cached[1] > 10
    assert m["swiftdecode_prompt_tokens_cached_total"] == sum(cached) and m["swiftdecode_prefix_cache_bytes"] > 0
    assert main(["serve", "--model", MODEL, "--prefix-cache-gb", "-1"]) == 2


def test_sigterm_ends_streams_with_an_error_event_and_done(smollm):
    """`swiftdecode serve` stopped (SIGTERM) while a long stream and a whole request generate: within the grace
    period the stream ends with a `server shutting down` error event and [DONE] (not cut mid-stream), the whole
    request is answered with 503, and the process exits."""
    import os
    import signal
    import subprocess
    import sys

    with socket_port() as port:
        pass
    argv = [sys.executable, "-m", "swiftdecode.apps.cli", "serve", "--model", MODEL, "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": "Count on and on:", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    try:
        assert "serving" in proc.stdout.readline()
        deadline = time.monotonic() + 120
        while not ready(base) and time.monotonic() < deadline:  # ready once its worker has warmed up
            time.sleep(0.2)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
            lines = []
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                stream = r.iter_lines()
                lines += [next(stream) for _ in range(6)]  # decoding
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                lines += list(stream)
            ended = time.monotonic() - t0
            assert whole.result().status_code == 503
        events = [ln for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "server shutting down" in events[-2], events[-3:]
        assert ended < 5, ended
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has stopped
    finally:
        proc.kill()


def ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


class socket_port:
    """A free TCP port on 127.0.0.1 (as a context: the socket that found it is closed on exit)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
