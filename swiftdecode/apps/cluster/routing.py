"""The text a request is routed by, and the text a replica's prefix cache holds once it has answered.

Ray's PrefixCacheAffinityRouter keeps a prefix tree of the routing texts each replica was sent, and sends a
request to the replica whose text shares the longest beginning with its own. It inserts prompts only; a
conversation's next turn begins with the previous prompt *and its answer*, which only the replica that answered
holds. So each replica adds the answered text (`answered_text`) to the tree itself, and the next turn follows
it even where several replicas once saw the same first prompt.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def text_of(value: Any) -> str:
    """A prompt as text for prefix matching: a string as is, token ids and messages spelled out in order."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, int):
        return f"{value} "
    if isinstance(value, list):
        return "".join(text_of(v) for v in value)
    if isinstance(value, dict):
        return f"<{value.get('role', '')}>{text_of(value.get('content', value.get('text')))}"
    return ""


def routing_text(authorization: str, request: Any) -> str:
    """What the router matches: a digest of the tenant (API key, cache_salt or user, as the prefix cache keys
    it), then the prompt or messages. Never empty."""
    request = request if isinstance(request, dict) else {}
    salt = request.get("cache_salt") or request.get("user") or ""
    tenant = hashlib.sha256(f"{authorization}\0{salt}".encode()).hexdigest()[:16]
    return f"{tenant}|{text_of(request.get('messages', request.get('prompt', '')))}"


def answer_of(body: bytes, streamed: bool) -> str | None:
    """The first choice's text in a completion response (a stream's deltas joined), None if there is none."""
    try:
        if not streamed:
            choice = json.loads(body)["choices"][0]
            return choice["message"]["content"] if "message" in choice else choice["text"]
        chunks = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
        parts = [c for chunk in chunks for c in chunk.get("choices", []) if c.get("index", 0) == 0]
        return "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in parts)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def answered_text(authorization: str, request: Any, answer: str) -> str | None:
    """The routing text of the request followed by its answer, as the next turn's will begin; None where a next
    prompt cannot be known to begin with it (token ids)."""
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("messages"), list):
        turn = {**request, "messages": [*request["messages"], {"role": "assistant", "content": answer}]}
        return routing_text(authorization, turn)
    if isinstance(request.get("prompt"), str):
        return routing_text(authorization, {**request, "prompt": request["prompt"] + answer})
    return None
