"""Tool calling through `swiftdecode serve` (Qwen2.5-Coder-0.5B, whose chat template takes tools, and SmolLM2,
whose does not): the openai client's agent loop whole and streamed, tool_choice as OpenAI documents it, calls that
parse and validate over varied schemas, methods and batches token-identical to `ar`, and bad tools refused with
HTTP 400 beside a running stream. Also /tokenize and /detokenize."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import batched_and_solo

from swiftdecode import Generator
from swiftdecode.apps.bench.concurrency import serving
from swiftdecode.apps.server import create_app
from swiftdecode.decoding.tools import ArgumentsText, CallParser, check_tools, gathered, is_json, split_answer, told

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def gen(qwen):
    return Generator(*qwen, method="swift")


@pytest.fixture(scope="module")
def url(gen) -> Iterator[str]:
    with serving(create_app(gen, MODEL, max_batch=8)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 96, **kw})


def schema_of(name: str, tools: list[dict]) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def streamed(client, **kw) -> tuple[str | None, list[dict], str]:
    """(content, calls [{"id", "name", "arguments"}], finish reason) of a streamed chat, from its deltas."""
    content, calls, finish = [], {}, None
    for ch in client.chat.completions.create(model=MODEL, temperature=0, max_tokens=96, stream=True, **kw):
        delta, finish = ch.choices[0].delta, ch.choices[0].finish_reason or finish
        content.append(delta.content or "")
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------- the agent loop, whole and streamed


def test_agent_loop_call_result_answer(client):
    tools = [WEATHER, CLOCK]
    first = chat(client, messages=ASK, tools=tools, tool_choice="auto", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather", tools))
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "sunny"})}
    history = ASK + [choice.message.model_dump(exclude_none=True), result]
    answer = chat(client, messages=history, tools=tools, tool_choice="none").choices[0]
    assert answer.finish_reason == "stop" and answer.message.content and not answer.message.tool_calls

    content, calls, finish = streamed(client, messages=ASK, tools=tools, tool_choice="auto", parallel_tool_calls=False)
    assert (content, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_tool_choice_none_required_and_named(client):
    tools = [WEATHER, CLOCK]
    none = chat(client, messages=ASK, tools=tools, tool_choice="none")
    plain = chat(client, messages=ASK)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": the model is not told of the tools
    assert none.choices[0].message.content == plain.choices[0].message.content
    for choice, name in [("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")]:
        kw = dict(messages=ASK, tools=tools, tool_choice=choice)
        several = chat(client, **kw).choices[0]  # this model calls on until max_tokens: the last call is cut
        calls = several.message.tool_calls
        assert calls and all(c.function.name == (name or c.function.name) for c in calls), calls
        for c in calls[: -1 if several.finish_reason == "length" else None]:
            jsonschema.validate(json.loads(c.function.arguments), schema_of(c.function.name, tools))
        one = chat(client, **kw, parallel_tool_calls=False).choices[0]
        assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
        assert one.message.tool_calls[0].function.arguments == calls[0].function.arguments


def test_a_call_cut_by_the_token_limit_is_marked_and_goes_back_in(client):
    """An agent loop's history holds our own answer as it came: a call cut mid-arguments by max_tokens (not JSON)
    is taken back as its text (OpenAI takes it so), and the response marked it as cut."""
    tools = [WEATHER, CLOCK]
    cut = []
    for max_tokens in range(14, 30, 3):  # some of these limits fall inside the first call's arguments
        choice = chat(client, messages=ASK, tools=tools, tool_choice="required", max_tokens=max_tokens).choices[0]
        calls = choice.message.tool_calls or []
        for call in calls[:-1]:
            assert not (call.model_extra or {}).get("truncated")
        if choice.finish_reason == "length" and calls and not is_json(calls[-1].function.arguments):
            assert calls[-1].model_extra["truncated"] is True
            cut.append(choice.message)
    assert cut, "no limit cut a call mid-arguments"
    for message in cut:
        history = ASK + [message.model_dump(exclude_none=True)]
        answer = chat(client, messages=history + [{"role": "user", "content": "Go on."}], max_tokens=8)
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_history_arguments_that_are_not_json_are_written_as_they_are(gen):
    history = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": ArgumentsText('{"city": "Par')}],
        }
    ]
    prompt = gen.decode(gen.chat_ids(history, check_tools([WEATHER], "auto", True)))
    assert json.dumps('{"city": "Par') in prompt, prompt  # Qwen's template: the text, as its tojson writes a string
    assert told(history[1])["content"].endswith('"arguments": {"city": "Par}\n</tool_call>')  # a template without


# ---------------------------------------------------------------- 50 calls over varied schemas


def varied_schema(r: random.Random, depth: int = 0) -> dict:
    """A random object schema: strings, bounded integers, booleans, enums, arrays and nested objects, some required."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + ["object"] * (depth < 2)
    props = {}
    for i in range(r.randint(1, 4)):
        kind = r.choice(kinds)
        if kind == "string":
            props[f"s{i}"] = {"type": "string", "maxLength": 24}
        elif kind == "integer":
            props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": r.choice([9, 100, 5000])}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{i}"] = {"type": "string", "enum": r.sample(["red", "green", "blue", "low", "high", "none"], 3)}
        elif kind == "array":
            props[f"a{i}"] = {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3}
        else:
            props[f"o{i}"] = varied_schema(r, depth + 1)
    required = r.sample(sorted(props), r.randint(0, len(props)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def test_fifty_calls_over_varied_schemas_parse_and_validate(client):
    r = random.Random(0)
    cases = []
    for i in range(50):
        tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": varied_schema(r)}}
        tool["function"]["description"] = f"Record the details of case {i}"
        cases.append(([tool, CLOCK], f"Record case {i}: a {r.choice(['red', 'small', 'late'])} item."))

    def call(case):
        tools, ask = case
        msgs = [{"role": "user", "content": ask}]
        kw = dict(tool_choice="required", parallel_tool_calls=False, max_tokens=256)
        return chat(client, messages=msgs, tools=tools, **kw)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, cases))
    valid = 0
    for (tools, _), answer in zip(cases, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (c,) = choice.message.tool_calls
        jsonschema.validate(json.loads(c.function.arguments), schema_of(c.function.name, tools))
        valid += 1
    assert valid == 50


# ---------------------------------------------------------------- lossless under tools


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.95, seed=5)], ids=["greedy", "sampled"])
def test_every_method_is_token_identical_to_ar_under_tools(qwen, sampling):
    tools = check_tools([WEATHER, CLOCK], "required")
    kw = dict(max_new_tokens=64, grammar=tools, **sampling)
    ar = Generator(*qwen, method="ar")
    ids = ar.chat_ids(ASK + [{"role": "user", "content": "And the time in Tokyo?"}], tools)
    want = ar.generate(ids, **kw)
    assert split_answer(want.text)[1], want.text
    for method in ("swift", "ngram", "skip-only"):
        res = Generator(*qwen, method=method).generate(ids, **kw)
        assert res.token_ids == want.token_ids, method
        assert res.stats.tree_rounds > 0, method  # masks along verified paths, not only plain steps


def test_a_batch_of_mixed_requests_equals_solo(gen):
    kinds = [check_tools([WEATHER, CLOCK], c) for c in ("auto", "required")] + [None]
    asks = ["Weather in Oslo?", "Write a haiku about rain.", "Time in Lima?", "What is 17 * 3?"]
    mix = []
    for i in range(8):
        tools, msgs = kinds[i % 3], [{"role": "user", "content": asks[i % 4]}]
        sampling = dict(temperature=0.7, seed=i) if i % 2 else {}
        mix.append((gen.chat_ids(msgs, tools), dict(grammar=tools, **sampling)))
    reqs, solo = batched_and_solo(gen, mix, 40)
    assert sum(r.stats.batched_rounds for r in reqs) > 0 and [r.new for r in reqs] == solo


# ---------------------------------------------------------------- bad tools: 400, the batch unharmed


BAD = [
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}}},
                }
            ]
        },
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": f"f{i}",
                        "parameters": {
                            "type": "object",
                            "properties": {f"p{j}": {"type": "string", "enum": ["v" * 100] * 30} for j in range(30)},
                        },
                    },
                }
                for i in range(3)
            ]
        },
        "tools",
    ),
]


def test_bad_tools_are_400_beside_a_running_stream(url, client):
    solo = chat(client, messages=[{"role": "user", "content": "Count from one to twenty."}], max_tokens=64)
    text = []

    def stream():
        for ch in chat(
            client, messages=[{"role": "user", "content": "Count from one to twenty."}], max_tokens=64, stream=True
        ):
            text.append(ch.choices[0].delta.content or "")

    thread = threading.Thread(target=stream)
    thread.start()
    for extra, param in BAD:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
            ],
        }
    ]
    deep = history[1]["tool_calls"][0]["function"] | {"arguments": "[" * 900 + "]" * 900}
    history[1]["tool_calls"][0]["function"] = deep
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": history}, timeout=60)
    assert r.status_code == 400 and "nest too deep" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    thread.join(120)
    assert "".join(text) == solo.choices[0].message.content


# ---------------------------------------------------------------- a template without tools; the parser


def test_a_template_without_tools_is_told_them_as_text(smollm):
    gen = Generator(*smollm, method="swift")
    tools = check_tools([WEATHER], "required", False)
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "content": "18 C, sunny"},
    ]
    prompt = gen.decode(gen.chat_ids(history, tools))
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_response>\n18 C, sunny" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    res = gen.generate(gen.chat_ids(ASK, tools), max_new_tokens=64, grammar=tools)
    content, calls = split_answer(res.text)
    assert content is None and [c["name"] for c in calls] == ["get_weather"] and res.finish_reason == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "text",
    [
        'Sure.<tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}}\n</tool_call>\n<tool_call>\n'
        '{"name": "g", "arguments": {}}\n</tool_call>',
        '{"name": "f", "arguments": {"a": "}\\n{"}}\n{"name": "g", "arguments": {"x": [1]}}',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1',
        'text with <tool and {"name": "f"',
    ],
)
def test_the_streamed_split_equals_the_whole_split_however_chunked(text):
    want = split_answer(text)
    for seed in range(50):
        r, parser, events, i = random.Random(seed), CallParser(), [], 0
        while i < len(text):
            k = r.randint(1, 6)
            events += parser.feed(text[i : i + k])
            i += k
        assert gathered(events + parser.close()) == want


# ---------------------------------------------------------------- /tokenize and /detokenize


def test_tokenize_and_detokenize(url, client, gen):
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == gen.tokenizer("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == gen.sm.max_length
    assert httpx.post(f"{url}/tokenize", json={"content": "Hello world"}).json()["tokens"] == r["tokens"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == back["content"] == "Hello world"
    asked = httpx.post(f"{url}/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()
    assert asked["count"] == chat(client, messages=ASK, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    for path, body in [("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": "x"}), ("/tokenize", {})]:
        assert httpx.post(f"{url}{path}", json=body).status_code == 400
    assert client.models.retrieve(MODEL).id == MODEL
