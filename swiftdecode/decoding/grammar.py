"""Structured output: a request's answer constrained to a JSON schema, a regular expression or a Lark grammar.

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) tracks the parse and gives, for each position, the
tokens that keep the output inside the grammar; the sampler sets every other token's logit to −inf before it
picks. Speculative rounds stay lossless: verification asks for the mask at each position of the path it is
following (the matcher consumes the path's tokens, and rolls them back when the round ends), so every position
is masked exactly as plain decoding masks it. Once the grammar is complete only an end-of-sequence token remains.
"""

from __future__ import annotations

import json
import time

import llguidance
import llguidance.hf
import numpy as np
import torch

from swiftdecode.base.params import ParamError
from swiftdecode.decoding.tools import Tools, lark, marker_token

KINDS = ("json_schema", "regex", "lark")  # a grammar spec is {kind: value}, exactly one of these
# One position's parse and mask may take this long at most, else the request ends (ParamError, HTTP 400): every
# round of a batch waits for each request's masks. A JSON schema's take 0.03-2 ms (SmolLM2, the first position
# included); an ambiguous grammar's grow with the output without bound (`x: x x | "a"`: 20 ms at 300 tokens, 0.5 s
# at 900), and llguidance's own item limits stop it only past that.
GRAMMAR_STEP_S = 0.05


def grammar_text(spec: object) -> str:
    """llguidance's grammar for a spec: {"json_schema": schema (dict or JSON text)}, {"regex": str} or
    {"lark": str}; ParamError("grammar", ...) for a spec of another shape."""
    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in KINDS):
        raise ParamError("grammar", f"grammar must be one of {{{', '.join(map(repr, KINDS))}: ...}}, got {spec!r:.80}")
    (kind, value), make = next(iter(spec.items())), llguidance.LLMatcher
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ParamError("grammar", f"json_schema is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ParamError("grammar", f"json_schema must be a JSON object, got {value!r:.80}")
        return make.grammar_from_json_schema(value)
    if not isinstance(value, str):
        raise ParamError("grammar", f"{kind} must be a string, got {value!r:.80}")
    return make.grammar_from_regex(value) if kind == "regex" else make.grammar_from_lark(value)


class Grammars:
    """Grammar constraints for one tokenizer and a model of `vocab` logits; `eos`: the ids that end an answer
    (allowed where the grammar may end). The grammar engine's view of the tokenizer is built on first use (~0.5-2 s)."""

    def __init__(self, tokenizer, vocab: int, eos: set[int]):
        self.tokenizer, self.vocab, self.eos, self.lltok = tokenizer, vocab, sorted(eos), None

    def constraint(self, spec: object | None) -> Constraint | None:
        """A new request's constraint, None without a spec (ParamError for one malformed or that does not compile).
        `spec`: grammar_text's, or a request's `tools.Tools` (the answer: text or calls, see `tools`)."""
        if spec is None:
            return None
        text = lark(spec, marker_token(self.tokenizer)) if isinstance(spec, Tools) else grammar_text(spec)
        if self.lltok is None:
            self.lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=self.eos)
        matcher = llguidance.LLMatcher(self.lltok, text, log_level=0)  # compiled once: an error is its state
        if matcher.is_error():
            lines = [line.strip() for line in matcher.get_error().splitlines() if line.strip()]  # where, source, why
            why = [line for line in lines[1:] if line.startswith("error:")][:1]
            raise ParamError("grammar", f"grammar does not compile: {' '.join(lines[:1] + why)}")
        return Constraint(matcher, self.vocab, set(self.eos))


class Constraint:
    """One request's grammar state: the tokens taken so far (`commit`), plus a tree path being verified. A path
    may run on past an end-of-sequence token (`eos`); what follows it is never taken, and is not parsed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos: set[int]):
        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)  # llguidance's mask: bit i of word w is token 32w + i
        self.path: list[int] = []  # tokens consumed beyond the committed ones (a path during verification)

    def allowed(self, after: list[int] | tuple) -> torch.Tensor:
        """Bool [vocab]: the tokens that may follow the committed tokens and then `after` (up to an EOS in it)."""
        after, t0 = next((after[:i] for i, t in enumerate(after) if t in self.eos), after), time.perf_counter()
        n = len(self.path)
        if n > len(after) or list(after[:n]) != self.path:  # a different path: start again from the committed
            self._rollback()
            n = 0
        self._consume(list(after[n:]))
        self.path.extend(after[n:])
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        self._check(time.perf_counter() - t0)
        return torch.from_numpy(np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab].view(bool))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after the committed ones (llguidance's fast-forward tokens): a
        branch worth verifying, which plain decoding nearly always takes (it may pick a shorter token of the same
        bytes, so they are verified as any branch is)."""
        if limit <= 0:
            return []
        self._rollback()
        t0 = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()[:limit]
        self._check(time.perf_counter() - t0)
        return tokens

    def commit(self, tokens: list[int]) -> None:
        """Tokens the generation took (after a round's verification)."""
        self._rollback()
        self._consume(tokens)

    def _rollback(self) -> None:
        if self.path:
            self.matcher.rollback(len(self.path))
            self.path = []

    def _consume(self, tokens: list[int]) -> None:
        if tokens:
            t0 = time.perf_counter()
            self.matcher.consume_tokens(tokens)
            self._check(time.perf_counter() - t0)

    def _check(self, seconds: float) -> None:
        """ParamError if the parser stopped (its item limits: every token consumed was allowed) or a step took
        longer than GRAMMAR_STEP_S."""
        if self.matcher.is_error():
            why = self.matcher.get_error().splitlines()[0][:200]
            raise ParamError("grammar", f"the grammar's parser stopped: {why}")
        if seconds > GRAMMAR_STEP_S:
            limit = f"{seconds * 1e3:.0f} ms for one position (at most {GRAMMAR_STEP_S * 1e3:.0f})"
            raise ParamError("grammar", f"the grammar is too costly to follow: its parse took {limit}")
