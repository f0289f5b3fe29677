"""The OpenAI wire format's responses: a whole completion, the stream's chunks (tool calls' deltas included),
log-probabilities and usage. Pure functions of the engine's results (no model, no FastAPI)."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from itertools import accumulate

from swiftdecode.decoding.tools import CallParser, finish_reason, is_json, split_answer

MIN_LOGPROB = -9999.0  # written for a log-probability of -inf (vLLM's convention; JSON has no infinity)


SSE_DONE = "data: [DONE]\n\n"  # the last line of every stream


def response_head(chat: bool, model_id: str) -> dict:
    """The fields a request's response (or each of its chunks) starts with: a fresh id, object, created, model."""
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
    }


def usage(results: list) -> dict:
    """OpenAI's token counts of a request's GenerationResults (one per choice; the prompt counts once)."""
    n, first = sum(len(r.token_ids) for r in results), results[0]
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": first.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": first.stats.cached_prompt_tokens},
    }


def logprobs_json(
    entries: list, chat: bool, text_of: Callable[[int], str], offset: int = 0, first: int | None = None
) -> dict:
    """OpenAI's `logprobs` of a choice or chunk from `logprobs.TokenLogprob` entries; text_of: a token's text.
    The completions API's text_offset counts each token's text from `offset` (the characters before them);
    `first`: a token before the entries that has no log-probability (an echoed prompt's first)."""
    if chat:

        def item(token: int, logprob: float) -> dict:
            text = text_of(token)
            return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}
    head = [] if first is None else [text_of(first)]
    tokens = head + [text_of(e.token) for e in entries]
    starts = list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
    top = [None] * len(head) + [{text_of(t): finite(lp) for t, lp in e.top} for e in entries]
    logprobs = [None] * len(head) + [finite(e.logprob) for e in entries]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": starts}


def echo_head(echo: tuple, chat: bool, text_of: Callable[[int], str] | None) -> tuple[str, dict | None, int]:
    """A stream's echoed prompt, the same for each choice: (its text, the logprobs of its entries (the first token
    without a log-probability) if asked for, the characters its tokens span: the next entry's text_offset).
    `echo` as completion's; `text_of`: None without logprobs."""
    said, ids, entries = echo
    if not text_of:
        return said, None, 0
    lps = logprobs_json(entries, chat, text_of, 0, ids[0]) if entries is not None else None
    return said, lps, sum(len(text_of(t)) for t in ids)


def finite(logprob: float) -> float | None:
    """A log-probability as JSON can carry it: -inf as MIN_LOGPROB, NaN as null (json.dumps would write bare
    -Infinity or NaN, which is not JSON)."""
    return None if math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def completion(
    head: dict,
    chat: bool,
    results: list,
    text_of: Callable[[int], str],
    echo: tuple | None = None,
    tools: bool = False,
    stats: bool = False,
) -> dict:
    """The whole (non-streamed) response to a request, a choice per GenerationResult; with `stats`, `swiftdecode`
    holds the engine's statistics of the first choice (off by default: they tell how a tenant's shared copy pool
    served the answer). `echo`: (prompt text, prompt ids, the prompt's TokenLogprob entries
    for ids[1:] or None), which each choice's text and logprobs begin with. `tools`: the answers are split into
    content and tool calls."""
    choices, (said, first, before) = [], (echo[0], echo[1][0], echo[2] or []) if echo else ("", None, [])
    for i, res in enumerate(results):
        message, finish = {"role": "assistant", "content": res.text}, res.finish_reason
        if tools:
            content, calls = split_answer(res.text)
            message, finish = {"role": "assistant", "content": content}, finish_reason(finish, len(calls))
            message |= {"tool_calls": tool_calls(calls, res.finish_reason)} if calls else {}
        text = {"message": message} if chat else {"text": said + res.text}
        logprobs = logprobs_json(before + res.logprobs, chat, text_of, 0, first) if res.logprobs is not None else None
        choices.append({"index": i, **text, "logprobs": logprobs, "finish_reason": finish})
    extra = {"swiftdecode": results[0].stats.to_dict()} if stats else {}
    return {**head, "choices": choices, "usage": usage(results), **extra}


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n"


def tool_calls(calls: list[dict], reason: str) -> list[dict]:
    """An answer's calls as its message holds them; where the token limit cut the last one mid-arguments, that one
    says so (`"truncated": true`; its arguments are the text so far, which a request's history takes back)."""
    out = [tool_call(c["name"], c["arguments"]) for c in calls]
    if reason == "length" and not is_json(calls[-1]["arguments"]):
        out[-1]["truncated"] = True
    return out


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    """A call as a response's message holds it (a fresh id unless given)."""
    call_id = call_id or f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolDeltas:
    """A streamed answer's text, with tools, as chat deltas: content, each call's start (its id, name and empty
    arguments) and its arguments as they come, as OpenAI streams `delta.tool_calls`."""

    def __init__(self):
        self.parser = CallParser()

    def feed(self, text: str) -> list[dict]:
        return [self.delta(event) for event in self.parser.feed(text)]

    def close(self) -> list[dict]:
        return [self.delta(event) for event in self.parser.close()]

    def delta(self, event: tuple) -> dict:
        if event[0] == "content":
            return {"content": event[1]}
        if event[0] == "call":
            return {"tool_calls": [{"index": event[1], **tool_call(event[2], "")}]}
        return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


def chunk(
    head: dict,
    chat: bool,
    text: str | None,
    finish: str | None,
    role: bool = False,
    logprobs: dict | None = None,
    index: int = 0,
    delta: dict | None = None,
) -> str:
    """A streamed chunk of choice `index` (`head` from chunk_head): a piece of text (chat: or a `delta`), or the
    finish reason (text None), with the `logprobs` of the tokens it completes (from logprobs_json) if any."""
    if chat:
        delta = delta or ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return sse({**head, "choices": [choice]})


def chunk_head(head: dict, chat: bool) -> dict:
    return {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
