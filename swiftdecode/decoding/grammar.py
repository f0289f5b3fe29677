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
from dataclasses import dataclass

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
# ... and all of a request's parsing and masking together (its compile included) at most this long: a grammar just
# under the step limit at every position would otherwise hold every round of the batch back for the whole answer.
GRAMMAR_REQUEST_S = 5.0
# A grammar's source (a schema as JSON text, a regex or a Lark grammar) at most, as tools.MAX_SCHEMA_CHARS: its
# compile runs on the worker thread between two rounds of the batch.
MAX_GRAMMAR_CHARS = 256 * 1024


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled once (a matcher at its start), for every choice of a request: each gets a copy."""

    matcher: llguidance.LLMatcher
    seconds: float  # the compile's time, counted in each copy's GRAMMAR_REQUEST_S


def grammar_text(spec: object) -> str:
    """llguidance's grammar for a spec: {"json_schema": schema (dict or JSON text)}, {"regex": str} or
    {"lark": str}; ParamError("grammar", ...) for a spec of another shape."""
    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in KINDS):
        raise ParamError("grammar", f"grammar must be one of {{{', '.join(map(repr, KINDS))}: ...}}, got {spec!r:.80}")
    (kind, value), make = next(iter(spec.items())), llguidance.LLMatcher
    if kind == "json_schema":
        try:
            value = json.loads(value) if isinstance(value, str) else value
            size = len(json.dumps(value))
        except (ValueError, TypeError, RecursionError) as e:
            raise ParamError("grammar", f"json_schema is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(value, dict):
            raise ParamError("grammar", f"json_schema must be a JSON object, got {value!r:.80}")
        check_size(kind, size)
        return make.grammar_from_json_schema(value)
    if not isinstance(value, str):
        raise ParamError("grammar", f"{kind} must be a string, got {value!r:.80}")
    check_size(kind, len(value))
    return make.grammar_from_regex(value) if kind == "regex" else make.grammar_from_lark(value)


def check_size(kind: str, chars: int) -> None:
    if chars > MAX_GRAMMAR_CHARS:
        raise ParamError("grammar", f"the {kind} has {chars} characters; at most {MAX_GRAMMAR_CHARS} are taken")


class Grammars:
    """Grammar constraints for one tokenizer and a model of `vocab` logits; `eos`: the ids that end an answer
    (allowed where the grammar may end). The grammar engine's view of the tokenizer is built on first use (~0.5-2 s)."""

    def __init__(self, tokenizer, vocab: int, eos: set[int]):
        self.tokenizer, self.vocab, self.eos, self.lltok = tokenizer, vocab, sorted(eos), None

    def compile(self, spec: object) -> Compiled:
        """A grammar, compiled (ParamError for one malformed, too large, or that does not compile). `spec`:
        grammar_text's, or a request's `tools.Tools` (the answer: text or calls, see `tools`)."""
        text = lark(spec, marker_token(self.tokenizer)) if isinstance(spec, Tools) else grammar_text(spec)
        if self.lltok is None:
            self.lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=self.eos)
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.lltok, text, log_level=0)  # an error is its state
        if matcher.is_error():
            lines = [line.strip() for line in matcher.get_error().splitlines() if line.strip()]  # where, source, why
            why = [line for line in lines[1:] if line.startswith("error:")][:1]
            raise ParamError("grammar", f"grammar does not compile: {' '.join(lines[:1] + why)}")
        return Compiled(matcher, time.perf_counter() - t0)

    def constraint(self, spec: object | None) -> Constraint | None:
        """A new request's constraint, None without a spec; `spec`: compile's, or a Compiled (shared by the
        choices of a request: each constraint parses on a copy)."""
        if spec is None:
            return None
        compiled = spec if isinstance(spec, Compiled) else self.compile(spec)
        return Constraint(compiled.matcher.deep_copy(), self.vocab, set(self.eos), compiled.seconds)


class Constraint:
    """One request's grammar state: the tokens taken so far (`commit`), plus a tree path being verified. A path
    may run on past an end-of-sequence token (`eos`); what follows it is never taken, and is not parsed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos: set[int], spent: float = 0.0):
        self.matcher, self.vocab, self.eos = matcher, vocab, eos
        self.spent = spent  # seconds of parsing and masking so far (the compile's included)
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
        """ParamError if the parser stopped (its item limits: every token consumed was allowed), a step took
        longer than GRAMMAR_STEP_S or the request's steps together longer than GRAMMAR_REQUEST_S."""
        if self.matcher.is_error():
            why = self.matcher.get_error().splitlines()[0][:200]
            raise ParamError("grammar", f"the grammar's parser stopped: {why}")
        self.spent += seconds
        if seconds > GRAMMAR_STEP_S:
            limit = f"{seconds * 1e3:.0f} ms for one position (at most {GRAMMAR_STEP_S * 1e3:.0f})"
            raise ParamError("grammar", f"the grammar is too costly to follow: its parse took {limit}")
        if self.spent > GRAMMAR_REQUEST_S:
            limit = f"{self.spent:.1f} s in all (at most {GRAMMAR_REQUEST_S:g} s a request)"
            raise ParamError("grammar", f"the grammar is too costly to follow: its parse took {limit}")
