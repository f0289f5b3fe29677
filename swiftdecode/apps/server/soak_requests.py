"""What `swiftdecode soak` sends: the valid requests (each reproducible: greedy or seeded) and how to read their
answers, the probes (malformed or hostile requests) with the outcome each must get, and one HTTP call."""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import time
from typing import Any, NamedTuple

# Echo probes' prompts (~2,000 tokens): prompts to score take turns, so with 32 closed-loop clients an echo may wait
# behind 31 others; at ~7,000 tokens (10 s of scoring each on 2 cores) that wait passed any client's timeout.
# `soak --stall` measures an 8,000-token echo with n=16 beside running streams.
ECHO_REPEATS = 350
PROBE_TIMEOUT_S = 60  # most probes are rejected before any decoding: a minute means the server is stuck
NEVER_READ_S = 5  # a stream opened and never read, for this long
SLOW_BODY_STALL_S = 40  # a body that stops coming: the server should time it out (408) or close before this
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PROMPTS = (
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What does a CPU do? Answer in JSON.",
    "Once upon a time",
)
GREEDY, SEEDED = {"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
# Probes answered by plain HTTP; each must get a 4xx, or also: "answer" a 200 whose choices all finished, "200" any
# 200, "401" only a 401. Anything else, and any 5xx, fails it.
ALSO_OK = {
    "tiny_temperature": "answer",
    "pathological_lark": "answer",  # sampled: an answer that ends before the parse grows costly is an answer
    "echo_long": "200",
    "echo_n16": "200",
    "long_prompt": "answer",
    "stop_after_literal": "answer",
    "cut_tool_call": "answer",
    "tokenize_big": "200",
    "bad_key": "401",
}
PATHS = {"cut_tool_call": CHAT, "tokenize_big": "/tokenize"}  # a probe's route, where it is not COMPLETIONS
# An assistant's call cut by the token limit, as our own response gave it (its arguments are not JSON)
CUT_CALL = {"id": "call_1", "type": "function", "function": {"name": "convert", "arguments": '{"amount": 250, "'}}
DEEP = 400  # a response_format schema nesting objects this deep
FLOOD = 90_000  # logit_bias entries: with the shortest distinct keys they fit a 1 MiB body (the limit's floor)
RAW_PROBES = ("never_read", "slow_body")  # written on a bare socket


class Server(NamedTuple):
    host: str
    port: int
    key: str | None
    pid: int | None


def send(
    srv: Server,
    path: str,
    body: bytes | None,
    *,
    timeout: float,
    key: str | None = None,
    stream: bool = False,
    max_chunks: int = 0,
) -> tuple[int, Any, Any]:
    """One request (GET without a body): (status, headers, body bytes), or for a 200 stream its `data:` events up
    to [DONE] (or its first `max_chunks`). `timeout` bounds each socket operation, and reading a whole stream."""
    deadline, conn = time.monotonic() + timeout, http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    key = key or srv.key
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        try:
            conn.request("GET" if body is None else "POST", path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (a 413) and closed: its answer may still be readable
        resp = conn.getresponse()
        if not stream or resp.status != 200:
            return resp.status, resp.headers, resp.read()
        events: list[dict] = []
        while time.monotonic() < deadline:
            if not (line := resp.readline()):
                raise ConnectionError("stream ended before [DONE]")
            if line.startswith(b"data:"):
                if (data := line[5:].strip()) == b"[DONE]":
                    return 200, resp.headers, events
                events.append(json.loads(data))
                if len(events) == max_chunks:
                    return 200, resp.headers, events
        raise TimeoutError(f"stream still running after {timeout:g} s")
    finally:
        conn.close()


def valid_requests(model: str) -> list[tuple[str, str, dict]]:
    """(name, path, body) of each valid request: greedy or seeded, so that each answer is reproducible."""

    def chat(prompt: str, **kw: Any) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], **kw}

    def comp(prompt: str, **kw: Any) -> dict:
        return {"model": model, "prompt": prompt, **kw}

    return [
        ("greedy_chat", CHAT, chat(PROMPTS[0], max_tokens=48, **GREEDY)),
        ("greedy_completion", COMPLETIONS, comp(PROMPTS[3], max_tokens=32, **GREEDY)),
        ("seeded_chat", CHAT, chat(PROMPTS[1], max_tokens=40, **SEEDED)),
        ("seeded_completion", COMPLETIONS, comp(PROMPTS[3], max_tokens=40, **SEEDED)),
        ("json_chat", CHAT, chat(PROMPTS[2], max_tokens=64, response_format=JSON_FORMAT, **GREEDY)),
        ("logprobs_chat", CHAT, chat(PROMPTS[1], max_tokens=24, logprobs=True, top_logprobs=3, **GREEDY)),
        ("logprobs_completion", COMPLETIONS, comp(PROMPTS[0], max_tokens=24, logprobs=2, **GREEDY)),
        ("n3_chat", CHAT, chat(PROMPTS[0], max_tokens=32, n=3, temperature=0.7, seed=1234)),
        ("n3_completion", COMPLETIONS, comp(PROMPTS[3], max_tokens=32, n=3, temperature=0.7, seed=1234)),
        ("stream_chat", CHAT, chat(PROMPTS[2], max_tokens=48, stream=True, **GREEDY)),
        ("stream_completion", COMPLETIONS, comp(PROMPTS[3], max_tokens=48, stream=True, **SEEDED)),
    ]


def answer(path: str, reply: Any) -> list:
    """Each choice's (text, its tokens' logprobs or None): from a response, or joined from a stream's events."""
    chat = path == CHAT
    if isinstance(reply, list):
        texts: dict[int, str] = {}
        for c in (c for event in reply for c in event.get("choices", [])):
            piece = c.get("delta", {}).get("content") if chat else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
        return [(texts[i], None) for i in sorted(texts)]
    out = []
    for c in sorted(json.loads(reply)["choices"], key=lambda c: c["index"]):
        lp = c.get("logprobs")
        values = None if not lp else [t["logprob"] for t in lp["content"]] if chat else lp["token_logprobs"]
        out.append((c["message"]["content"] if chat else c["text"], values))
    return out


class Refused(Exception):
    """A valid request answered with an error status."""


def probe_bodies(model: str) -> dict[str, bytes]:
    """Each HTTP probe's request body, built once (some are megabytes). The raw ones hold what json.dumps would not
    write: a 5000-digit integer, a lone surrogate's escape."""
    m = json.dumps(model).encode()
    digits = (f"{i:0{width}}" for width in range(1, 8) for i in range(10**width))  # "0".."9", "00".."99", ...

    def js(**kw: Any) -> bytes:
        return json.dumps({"model": model, **kw}, separators=(",", ":")).encode()

    return {
        "long_stop": js(prompt="Hi", max_tokens=16, stream=True, stop=["x" * 200_000]),  # took 12.5 s for 30 tokens
        "tiny_temperature": js(prompt="Hi", max_tokens=5, temperature=1e-300, top_p=0.5),
        "pathological_lark": js(prompt="a", max_tokens=1000, grammar={"lark": 'start: x\nx: x x | "a"'}),
        "huge_prompt": js(prompt="lorem ipsum " * (15 * 2**20 // 12), max_tokens=4),
        "huge_body": js(prompt="Hi", logit_bias=dict.fromkeys(map(str, range(1_500_000)), 0)),
        "echo_long": js(prompt="the quick brown fox jumps " * ECHO_REPEATS, echo=True, logprobs=1, max_tokens=0),
        "echo_n16": js(prompt="a stitch in time saves nine " * ECHO_REPEATS, echo=True, logprobs=0, max_tokens=0, n=16),
        "long_prompt": js(prompt="the early bird catches the worm " * 800, max_tokens=4, temperature=0),
        "stop_after_literal": js(prompt="x", max_tokens=600, grammar={"regex": "(ab){400}END"}, stop=["END"]),
        "cut_tool_call": js(
            messages=[
                {"role": "user", "content": "Convert 250 USD to EUR."},
                {"role": "assistant", "content": None, "tool_calls": [CUT_CALL]},
                {"role": "user", "content": "Go on."},
            ],
            max_tokens=8,
        ),
        "tokenize_big": js(prompt="lorem ipsum dolor " * 10_000),
        "deep_schema": js(prompt="Hi", response_format=deep_format(DEEP)),
        "huge_grammar": js(prompt="Hi", grammar={"regex": "a" * 300_000}),
        "logit_bias_flood": js(prompt="Hi", logit_bias=dict.fromkeys(itertools.islice(digits, FLOOD), 0)),
        "big_int": b'{"model":%s,"prompt":"Hi","max_tokens":%s}' % (m, b"9" * 5000),
        "big_int_key": b'{"model":%s,"prompt":"Hi","logit_bias":{"%s":1}}' % (m, b"9" * 5000),
        "lone_surrogate": b'{"model":%s,"prompt":"\\ud800"}' % m,
        "lone_surrogate_model": b'{"model":"\\ud800","prompt":"Hi"}',
        "bad_key": js(prompt="Hi", max_tokens=4),
    }


def deep_format(depth: int) -> dict:
    """A response_format whose schema nests `depth` objects: a 400 (too deep or too costly), never a 500."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


def passed(name: str, status: int, data: bytes) -> bool:
    """Whether an HTTP probe got an allowed answer (see ALSO_OK)."""
    also = ALSO_OK.get(name)
    if also == "401" or 400 <= status < 500:
        return status == 401 if also == "401" else True
    try:
        return status == 200 and (
            also == "200" or also == "answer" and all(c["finish_reason"] for c in json.loads(data)["choices"])
        )
    except (ValueError, KeyError, TypeError):
        return False


def never_read(srv: Server, model: str) -> tuple[bool, str]:
    """Open a long stream, read nothing for a while, close: nothing to check but its effect on the others."""
    data = json.dumps({"model": model, "prompt": PROMPTS[3], "max_tokens": 256, "stream": True}).encode()
    with socket.create_connection((srv.host, srv.port), timeout=PROBE_TIMEOUT_S) as s:
        s.sendall(request_head(srv, len(data)) + data)
        time.sleep(NEVER_READ_S)
    return True, "closed unread"


def slow_body(srv: Server, model: str) -> tuple[bool, str]:
    """Announce 1000 bytes of body, send 10, stall: the server must answer a 4xx (408) or close."""
    with socket.create_connection((srv.host, srv.port), timeout=SLOW_BODY_STALL_S) as s:
        s.sendall(request_head(srv, 1000) + b'{"model": ')
        try:
            first = s.recv(4096)
        except TimeoutError:
            return False, f"connection still open, no answer after {SLOW_BODY_STALL_S} s"
        except ConnectionResetError:
            return True, "reset by the server"
    status = int(first.split()[1]) if first else 0
    return not first or 400 <= status < 500, f"status {status}: {first[:160]!r}"


def request_head(srv: Server, length: int) -> bytes:
    auth = f"Authorization: Bearer {srv.key}\r\n" if srv.key else ""
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {srv.host}:{srv.port}\r\n{auth}Content-Type: application/json\r\n"
    return f"{head}Content-Length: {length}\r\n\r\n".encode()
