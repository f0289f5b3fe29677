"""The OpenAI wire format's requests: parsing and validation, and ApiError (the responses: `responses`).

Pure functions of JSON values (no model, no FastAPI): a bad request raises ApiError(400) naming its `param`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from swiftdecode.base.errors import UserError
from swiftdecode.base.params import CONTROLS, MAX_BIAS_IDS, MAX_TOP_LOGPROBS, SHOWN, ParamError, check_params
from swiftdecode.decoding.tools import ArgumentsText, Tools, check_tools

ERROR_TYPES = {429: "rate_limit_error"}  # else OpenAI's: invalid_request_error (4xx; 401 and 404 too), server_error
MAX_ID_DIGITS = 18  # a logit_bias key (a token id) has at most this many digits: int() of 5000 digits raises
MAX_SALT = 256  # characters of `cache_salt` or `user` at most
MAX_NESTING = 64  # a history call's arguments nest at most this deep: the chat template renders them recursively
# A JSON escape of a UTF-16 surrogate: only then can a parsed string hold a lone one, which cannot be encoded
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_STOP = 4  # as OpenAI
MAX_SEED = 2**63 - 1
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' `logprobs` at most, as OpenAI
MAX_N = 16  # choices per request at most: each is a request of its own in the batch (the queue: one place for all)
MAX_TEMPERATURE = 2  # OpenAI's range is [0, 2]; the engine itself takes any temperature >= 0
UNTIL_EOS = 2**31 - 1  # chat's default max_tokens, as OpenAI: the engine stops at EOS or the end of the context
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI
# Known OpenAI parameters we do not implement: accepted only at their neutral values.
UNSUPPORTED = tuple("suffix functions function_call best_of".split())  # functions: send tools
NEUTRAL = (None, False, 0, "", [], {})
NEUTRAL_EXTRA = {"best_of": (1,)}
ROLES = {"system", "developer", "user", "assistant", "tool"}
API_NAMES = {"max_new_tokens": "max_tokens"}  # Generator.stream keyword -> OpenAI field, where they differ
# check_params' names for the fields, spelled as this server's other messages spell them: 'max_tokens'
QUOTED = {
    f: f"'{API_NAMES.get(f, f)}'"
    for f in ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "logit_bias", "min_tokens", *CONTROLS)
}


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


def check_keys(keys: list[str]) -> None:
    """UserError for a key no request could send: empty (it would lock every client out), or not printable ASCII
    (HTTP headers carry bytes that servers read as Latin-1: such a key would never match)."""
    if not all(keys):
        raise UserError("an API key must not be empty (it would lock every client out)")
    if not all(k.isascii() and k.isprintable() and k.strip() == k for k in keys):
        raise UserError("an API key must be printable ASCII without surrounding spaces (no client could send it)")


def too_deep() -> ApiError:
    """The 400 of a request whose JSON nests deeper than its checks could recurse (a RecursionError)."""
    return ApiError(400, "the request nests too deep (JSON objects or arrays within each other)")


# ---------------------------------------------------------------- requests

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
    """Request body -> JSON object, or 400 (numbers of over 4300 digits and lone surrogates included)."""
    try:
        body = json.loads(raw)
        if LONE_SURROGATE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate cannot be encoded
    except (ValueError, RecursionError) as e:  # UnicodeError and JSONDecodeError are ValueErrors
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    check(isinstance(body, dict), "request body must be a JSON object")
    return body


@dataclass(frozen=True)
class Parsed:
    """A completion request's fields: the prompt (text, token ids or chat messages), the engine's keywords
    (`params`), the number of choices, echo, streaming and the prefix cache's salt part (cache_salt or user)."""

    prompt: str | list[int] | list[dict]
    params: dict
    n: int
    echo: bool
    stream: bool
    include_usage: bool
    salt: str | None
    tools: Tools | None = None


def parse_request(raw: bytes, chat: bool, model_id: str) -> Parsed:
    """A /v1/completions or /v1/chat/completions body -> Parsed, or ApiError (404: another model). Runs off the
    event loop: a megabyte-long body takes a while to parse and check."""
    body = parse_body(raw)
    model = take(body, "model", "str")
    check(model is not None, "missing required field 'model'", "model")
    if model != model_id:
        message = f"The model '{model[:SHOWN]}' does not exist; this server serves '{model_id}'"
        raise ApiError(404, message, "model", "model_not_found")
    prompt = parse_messages(body) if chat else parse_prompt(body)
    params, n, echo = parse_sampling(body, chat), parse_n(body), parse_echo(body, chat)
    check(chat or body.get("tools") in NEUTRAL, "'tools' is a /v1/chat/completions parameter", "tools")
    if tools := parse_tools(body) if chat else None:
        check("grammar" not in params, "give 'tools' or a 'response_format' / 'grammar', not both", "tools")
        params = params | {"grammar": tools}
    stream = take(body, "stream", "bool", False)
    include_usage = take(take(body, "stream_options", "dict", {}), "include_usage", "bool", False)
    salts = [take(body, key, "str") for key in ("cache_salt", "user")]
    check(all(s is None or len(s) <= MAX_SALT for s in salts), f"'cache_salt' and 'user' take {MAX_SALT} characters")
    salt = next((s for s in salts if s is not None), None)
    return Parsed(prompt, params, n, echo, stream, include_usage, salt, tools)


def parse_sampling(body: dict, chat: bool) -> dict:
    """OpenAI sampling fields -> Generator.request keyword arguments: `params` (validated by `check_params`, once:
    the engine takes them as they are; max_new_tokens 0 where only the prompt is scored), `seed` and `grammar`.
    JSON types and OpenAI's own limits are checked here."""
    for key in UNSUPPORTED:
        if body.get(key) not in NEUTRAL + NEUTRAL_EXTRA.get(key, ()):
            raise ApiError(400, f"'{key}' is not supported by this server", key)
    max_tokens = take(body, "max_tokens", "int", UNTIL_EOS if chat else COMPLETION_MAX_TOKENS)
    if chat:
        max_tokens = take(body, "max_completion_tokens", "int", max_tokens)
    score_only = max_tokens == 0 and parse_echo(body, chat)  # the prompt's logprobs, nothing generated
    temperature = take(body, "temperature", "number", 1.0)
    check(temperature <= MAX_TEMPERATURE, f"'temperature' must be between 0 and {MAX_TEMPERATURE}", "temperature")
    top_p, top_k = take(body, "top_p", "number", 1.0), take(body, "top_k", "int", 0)
    seed = take(body, "seed", "int")
    check(seed is None or 0 <= seed <= MAX_SEED, f"'seed' must be in [0, {MAX_SEED}]", "seed")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    check(stop is None or isinstance(stop, list), "'stop' must be a string or a list of strings", "stop")
    check(stop is None or len(stop) <= MAX_STOP, f"'stop' takes at most {MAX_STOP} sequences", "stop")
    controls = {k: take(body, k, "number", off) for k, (off, _) in CONTROLS.items()}
    ends = {"min_tokens": take(body, "min_tokens", "int", 0), "ignore_eos": take(body, "ignore_eos", "bool", False)}
    controls |= {k: v for k, v in ends.items() if v}  # vLLM's extensions, at their neutral values when absent
    bias = parse_logit_bias(body)
    logprobs = parse_logprobs(body, chat)
    try:
        first = 1 if score_only else max_tokens
        params = check_params(first, temperature, top_p, top_k, stop, QUOTED, logprobs, logit_bias=bias, **controls)
    except ParamError as e:
        raise ApiError(400, str(e), API_NAMES.get(e.field, e.field)) from None
    return {"params": replace(params, max_new_tokens=max_tokens), "seed": seed, **parse_grammar(body)}


def parse_grammar(body: dict) -> dict:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}})
    or this server's `grammar` extension (the engine's spec: {"json_schema" | "regex" | "lark": ...}) -> the
    engine's `grammar` keyword, if any. Whether a grammar compiles is the engine's to check."""
    fmt, grammar = take(body, "response_format", "dict"), take(body, "grammar", "dict")
    kind = fmt.get("type") if fmt else "text"
    check(kind in ("text", "json_object", "json_schema"), f"unknown response_format type {kind!r}", "response_format")
    check(kind == "text" or grammar is None, "give 'response_format' or 'grammar', not both", "grammar")
    if kind == "json_object":
        return {"grammar": {"json_schema": {"type": "object"}}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        check(isinstance(spec, dict), "'response_format.json_schema' must be an object", "response_format")
        schema = spec.get("schema", {"type": "object"})
        check(isinstance(schema, dict), "'response_format.json_schema.schema' must be an object", "response_format")
        return {"grammar": {"json_schema": schema}}
    return {"grammar": grammar} if grammar else {}


def parse_echo(body: dict, chat: bool) -> bool:
    """/v1/completions' `echo`: the response's text (and logprobs) begin with the prompt's (a stream's first chunk
    holds it); then max_tokens may be 0 (scoring a text)."""
    echo = take(body, "echo", "bool", False)
    check(not (echo and chat), "'echo' is a /v1/completions parameter", "echo")
    return echo


def parse_n(body: dict) -> int:
    """How many choices to generate (OpenAI's `n`)."""
    n = take(body, "n", "int", 1)
    check(1 <= n <= MAX_N, f"'n' must be in [1, {MAX_N}]", "n")
    return n


def choice_params(params: dict, index: int) -> dict:
    """The engine keywords of choice `index`: with a seed, choice i samples with seed + i (so choices differ and
    each is reproducible); without one, each draws its own."""
    seed = params.get("seed")
    return params if seed is None or index == 0 else {**params, "seed": (seed + index) % (MAX_SEED + 1)}


def parse_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias} (ids as strings, as JSON keys are) -> {id: bias}; the values'
    range and the ids' bound are the engine's to check."""
    bias = take(body, "logit_bias", "dict")
    if not bias:
        return None
    limit = f"'logit_bias' takes at most {MAX_BIAS_IDS} token ids"
    check(len(bias) <= MAX_BIAS_IDS, limit, "logit_bias")
    digits = re.compile(rf"[0-9]{{1,{MAX_ID_DIGITS}}}")
    ok = all(digits.fullmatch(k) and KINDS["number"][0](v) for k, v in bias.items())
    check(ok, "'logit_bias' must map token ids (strings of digits) to numbers", "logit_bias")
    return {int(k): v for k, v in bias.items()}


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token to report with each token's log-probability, or None (off): chat's `logprobs`
    (true/false) and `top_logprobs`, the completions API's `logprobs` (how many alternatives)."""
    if not chat:
        n = take(body, "logprobs", "int")
        limit = f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}]"
        check(n is None or 0 <= n <= MAX_COMPLETION_LOGPROBS, limit, "logprobs")
        return n
    on, top = take(body, "logprobs", "bool", False), take(body, "top_logprobs", "int")
    check(top is None or on, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    limit = f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]"
    check(top is None or 0 <= top <= MAX_TOP_LOGPROBS, limit, "top_logprobs")
    return (top or 0) if on else None


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
    """`messages` of /v1/chat/completions -> [{"role", "content": str}] (text content parts are joined); an
    assistant's `tool_calls` as [{"name", "arguments": object}] (its content may then be null)."""
    messages = body.get("messages")
    check(messages is not None, "missing required field 'messages'", "messages")
    check(isinstance(messages, list) and len(messages) > 0, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        check(isinstance(m, dict), f"{param} must be an object", param)
        role, content = m.get("role"), m.get("content")
        check(role in ROLES, f"{param}.role must be one of {sorted(ROLES)}", f"{param}.role")
        calls = parse_calls(m.get("tool_calls"), param) if role == "assistant" else []
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            check(all(isinstance(p, str) for p in parts), f"{param}.content: only text parts are supported", param)
            content = "".join(parts)
        content = "" if content is None and calls else content
        check(isinstance(content, str), f"{param}.content must be a string or a list of text parts", param)
        out.append({"role": "system" if role == "developer" else role, "content": content})
        out[-1] |= {"tool_calls": calls} if calls else {}
    return out


def parse_calls(calls: object, param: str) -> list[dict]:
    """An assistant message's `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": JSON
    text}}]) -> [{"name", "arguments": the parsed object, or tools.ArgumentsText where the text is not JSON}]."""
    if calls is None:
        return []
    check(isinstance(calls, list), f"{param}.tool_calls must be a list", param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)
        check(ok, f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}", where)
        try:
            arguments = json.loads(f["arguments"])
        except (ValueError, RecursionError):  # a call cut by the token limit: its text, as OpenAI takes it
            arguments = ArgumentsText(f["arguments"])
        check(not nested_deeper(arguments, MAX_NESTING), f"{where}.function.arguments nest too deep", where)
        out.append({"name": f["name"], "arguments": arguments})
    return out


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects and arrays more than `limit` deep (recursing at most that far)."""
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return bool(inner) and (limit <= 0 or any(nested_deeper(v, limit - 1) for v in inner))


def parse_tools(body: dict) -> Tools | None:
    """A chat request's `tools`, `tool_choice` and `parallel_tool_calls` (see tools.check_tools)."""
    try:
        return check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ParamError as e:
        raise ApiError(400, str(e), e.field) from None
