"""/tokenize and /detokenize, as vLLM's and llama.cpp's servers have them.

/tokenize takes {"prompt": text} (llama.cpp: "content"; "add_special_tokens", llama.cpp: "add_special") or chat
{"messages", "tools"?} (the prompt a chat completion would read, with its generation prompt) and answers
{"tokens", "count", "max_model_len"}; /detokenize takes {"tokens"} and answers {"prompt"} (llama.cpp: "content").
They run on a tokenizer of their own, in a thread of their own: the worker thread's tokenizer is not shared
between threads, and a flood of them queues there, not in the event loop's thread pool that parses completions.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from swiftdecode.apps.server.protocol import ApiError, check, parse_body, parse_messages, parse_tools, take
from swiftdecode.base.text import Prompts
from swiftdecode.decoding.tools import render


class Tokens:
    """A copy of the served tokenizer (`prompts`), its calls one at a time on `thread` (the only one using it)."""

    def __init__(self, prompts: Prompts):
        self.prompts = prompts  # its own tokenizer (Generator.codec)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="swiftdecode-tokens")

    def tokenize(self, raw: bytes) -> dict:
        body = parse_body(raw)
        if "messages" in body:
            messages, tools = parse_messages(body), parse_tools(body)
            ids = self.prompts.chat_ids(*render(messages, tools, self.prompts.tokenizer))
        else:
            text = take(body, "prompt", "str", take(body, "content", "str"))
            check(text is not None, "give 'prompt' (a string) or 'messages'", "prompt")
            special = take(body, "add_special_tokens", "bool", take(body, "add_special", "bool", True))
            self.prompts.check_chars(len(text))
            ids = list(self.prompts.tokenizer(text, add_special_tokens=special)["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": self.prompts.max_length}

    def detokenize(self, raw: bytes) -> dict:
        ids = parse_body(raw).get("tokens")
        ok = isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        check(ok, "'tokens' must be a list of token ids", "tokens")
        vocab = self.prompts.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must lie in [0, {vocab})", "tokens")
        text = self.prompts.decode(ids)
        return {"prompt": text, "content": text}
