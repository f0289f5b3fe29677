"""The engine's text rules: a prompt's token ids (plain or in the chat template, checked), ids back to text, and
the ids that end a generation. Stop strings and streaming are `request.Request`'s."""

from __future__ import annotations

import json

from swiftdecode.base.errors import UserError


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a generation: the generation config's EOS ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [ids])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


class Prompts:
    """One tokenizer's prompt encoding and output decoding, for a model of `vocab_size` tokens and a context of
    `max_length` tokens."""

    def __init__(self, tokenizer, vocab_size: int, max_length: int):
        self.tokenizer, self.vocab_size, self.max_length = tokenizer, vocab_size, max_length
        self._token_chars: int | None = None

    @property
    def max_chars(self) -> int:
        """Characters that surely take more tokens than the context holds: the context times the longest token's
        characters (a token's text decodes to at most as many characters as its vocabulary entry has: one per byte
        in byte-level vocabularies). Checked before tokenizing: a 16 MiB prompt took ~20 s to tokenize."""
        if self._token_chars is None:
            tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._token_chars = max(len(t) for t in tokens if t)
        return self.max_length * self._token_chars

    def check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise UserError(
                f"prompt has {chars} characters, more tokens than the model's context ({self.max_length} tokens) holds"
            )

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` in the model's chat template, ready for the assistant's answer; `tools`: OpenAI's
        function tools, for a template that takes them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError("this model's tokenizer has no chat template (a base model): drop --chat, or pick another")
        said = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        self.check_chars(said + len(json.dumps([tools, [m.get("tool_calls") for m in messages]])))
        out = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        """Token ids of a text prompt (as the user's chat message if `chat`) or of checked ids, leaving room in the
        context for at least one new token (else UserError)."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt))
        elif len(prompt) >= self.max_length:
            raise UserError(f"prompt has {len(prompt)} tokens; the model's context is {self.max_length} tokens")
        ids = self._ids(prompt, chat)
        if len(ids) >= self.max_length:
            raise UserError(f"prompt has {len(ids)} tokens; the model's context is {self.max_length} tokens")
        return ids

    def _ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt is empty")
            if chat:
                return self.chat_ids([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt)["input_ids"])
        ids = [int(i) for i in prompt]
        if not ids:
            raise UserError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise UserError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextSoFar:
    """The text of a growing token list, decoded a few tokens at a time (decoding all of it every round costs
    ~0.3 ms at 2000 tokens). Each update decodes the tokens committed last time together with the new ones and
    appends the difference: both decodes start at the same token, so a decoder's rules for a sequence's first
    token (a leading space) cancel, and text is committed only once its characters are whole (no trailing
    U+FFFD). `text` is a prefix of decode(all ids); the caller decodes them all once where it must be exact."""

    def __init__(self, decode):
        self.decode, self.text = decode, ""
        self.start = self.end = 0  # ids[start:end]: the tokens committed by the last update

    def update(self, ids: list[int]) -> str:
        head, full = self.decode(ids[self.start : self.end]), self.decode(ids[self.start :])
        if len(full) > len(head) and full.startswith(head) and not full.endswith("\ufffd"):
            self.text += full[len(head) :]
            self.start, self.end = self.end, len(ids)
        return self.text
