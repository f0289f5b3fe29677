"""The generation engine for one request at a time: prefill, then rounds (`round`) of propose (the drafters,
chosen by `scheduler`) → verify (one full forward over the draft tree) → keep the accepted path. Settings and
presets: `base.config`; the drafters: `drafters.registry`."""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable, Iterator

import torch

from swiftdecode.base.config import METHODS, PAPER_SEARCH, EngineConfig, preset
from swiftdecode.base.errors import UserError
from swiftdecode.base.params import RequestParams, check_params, check_vocab
from swiftdecode.base.text import Prompts, eos_ids
from swiftdecode.decoding.grammar import Compiled, Grammars
from swiftdecode.decoding.logprobs import PromptScorer
from swiftdecode.decoding.request import GenerationResult, Request, StreamEvent
from swiftdecode.decoding.sampling import Sampler
from swiftdecode.decoding.tools import Tools, render
from swiftdecode.engine.round import Proposer, round_alone
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel, warm_up
from swiftdecode.runtime.prefix import PrefixStore

__all__ = ["PAPER_SEARCH", "EngineConfig", "Generator", "preset"]

DEFAULT_MAX_NEW_TOKENS = 128  # a request's token budget when the caller names none


class Generator:
    """Lossless generation with one model. Not thread-safe; the drafters' state carries across calls.
    `proposer`: the drafters and the scheduler that picks each round's kind; finished sequences' cache entries are
    kept for later prompts (`prefix_cache_gb`; none off our batch-invariant kernels, where reuse is not exact)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        method: str = "swift",
        config: EngineConfig | None = None,
        prefix_cache_gb: float = 0.0,
    ):
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.tokenizer, self.sm = method, tokenizer, warm_up(SwiftModel(model))  # see warm_up
        self.cfg = cfg = config or (preset(method) if method != "ar" else None)
        self._prompts, self.eos = Prompts(tokenizer, self.sm.vocab_size, self.sm.max_length), eos_ids(model, tokenizer)
        self.grammars = Grammars(tokenizer, self.sm.vocab_size, self.eos)
        self.proposer = Proposer(self.sm, cfg)
        self._prefixes = PrefixStore(int(prefix_cache_gb * 2**30) if self.sm.layer_loop() != "transformers" else 0)

    def chat_ids(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, see tools.render) in the chat template, ready for the answer."""
        return self._prompts.chat_ids(*render(messages, tools, self.tokenizer))

    def generate(self, prompt: str | list[int], **params) -> GenerationResult:
        """Generate to completion; see `request` for the parameters."""
        return next(event.result for event in self.stream(prompt, **params) if event.result is not None)

    def stream(self, prompt: str | list[int], **params) -> Iterator[StreamEvent]:
        """Validate (see `request`), then return an iterator of text pieces; the last event carries the result."""
        return self._run(self.request(prompt, **params))

    def _run(self, req: Request) -> Iterator[StreamEvent]:
        yield from filter(None, [self.begin(req)])  # rounds whose tokens show no new text yield no event
        while not req.done:
            yield from filter(None, [self.step(req)])

    def request(
        self,
        prompt: str | list[int],
        *,
        seed: int | None = None,
        chat: bool = False,
        grammar: dict | Tools | Compiled | None = None,
        cache_salt: str | None = None,
        params: RequestParams | None = None,
        **checked,
    ) -> Request:
        """A request, not started (UserError on bad input). `params`: its parameters as validated at the edge
        (`params.check_params`), else `checked`: check_params' keywords (max_new_tokens: 128 unless given; stop;
        logprobs, 0-20 alternatives per token, None: off; sampling), validated here. `grammar`: the answer's
        structure (or `tools.Tools`; or either as `grammars.compile` gave it, for the choices of one request);
        `cache_salt`: cache entries are shared only by requests of one salt."""
        if params is not None and checked:
            raise UserError(f"give the parameters as `params` or as keywords, not both (got {', '.join(checked)})")
        params = params or check_params(**{"max_new_tokens": DEFAULT_MAX_NEW_TOKENS} | checked)
        check_vocab(params, self.sm.vocab_size)
        constraint, ids = self.grammars.constraint(grammar), self._prompts.encode(prompt, chat)  # ids < the context
        seed = seed if seed is not None else secrets.randbits(63)
        sampler = Sampler(params.sampling, seed, ids, constraint, self.eos)
        budget = min(params.max_new_tokens, self.sm.max_length - len(ids))
        eos = set() if params.sampling.ignore_eos else self.eos
        decode, windows = self._prompts.decode, self.sm.kv_layout().windows
        return Request(ids, budget, sampler, list(params.stop), eos, decode, windows, params.logprobs, cache_salt)

    def begin(self, req: Request) -> StreamEvent | None:
        """Prefill the request's prompt into its cache and take the first token."""
        t, reader = time.perf_counter(), self.proposer.prefill_reader()
        if (cached := self.take_prompt(req)) or reader is None:
            logits = self.sm.logits(self.sm.prefill(req.ids[cached:], req.cache)[-1:])[0]
        else:
            logits = reader.prefill(req.ids, req.cache)
        first = req.sampler.pick(logits, len(req.ids))
        req.stats.time_split["prefill"] = time.perf_counter() - t
        return self.advance(req, [first], logits[None])

    def step(self, req: Request) -> StreamEvent | None:
        """One decoding round of a started request."""
        return self.advance(req, *round_alone(self.sm, self.proposer, req))

    def advance(self, req: Request, tokens: list[int], rows: torch.Tensor | None = None) -> StreamEvent | None:
        """Give the request a round's tokens (`Request.take`); on completion, the drafters see it end and its
        cache goes to the prefix store."""
        event = req.take(tokens, rows)
        if req.done:
            for drafter in self.proposer.drafters.values():
                drafter.end(req)
            self._prefixes.save(req.ctx[: req.cache.length], req.cache, req.salt)  # entry i: ctx[i]'s keys, values
        return event

    def take_prompt(self, req: Request) -> int:
        """A new request's prompt, before its prefill (here or in chunks): the drafters see it, and a plain prefill
        starts after its longest stored beginning, copied into its cache (returns that length)."""
        for drafter in self.proposer.drafters.values():
            drafter.begin(req)
        if self.plain_prefill():
            req.stats.cached_prompt_tokens = self._prefixes.restore(req.ids, req.cache, req.salt)
        return req.stats.cached_prompt_tokens

    def plain_prefill(self) -> bool:
        """Whether a prompt's prefill is a plain forward, which may then run in chunks beside other requests (no
        drafter must read it)."""
        return self.proposer.prefill_reader() is None

    # ---- what a server reads of the engine, beside the above ---------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """A raw prompt's token ids (no chat template), checked against the vocabulary and the context."""
        return self._prompts.encode(prompt, False)

    def decode(self, ids: list[int]) -> str:
        return self._prompts.decode(ids)

    def codec(self) -> Prompts:
        """A prompt codec on a copy of the tokenizer, for another thread (a tokenizer is not shared by threads)."""
        return Prompts(copy.deepcopy(self.tokenizer), self.sm.vocab_size, self.sm.max_length)

    def save_prefix(self, ids: list[int], cache: SwiftCache, salt: str | None) -> None:
        """Keep a sequence's cache entries (entry i: ids[i]) for later prompts of the same salt."""
        self._prefixes.save(ids, cache, salt)

    def memory(self) -> dict[str, int]:
        """Bytes kept across requests: the prefix cache's (and its budget: 0 where off or unavailable), drafters'."""
        drafted = sum(d.kept_bytes() for d in self.proposer.drafters.values())
        return {"prefix_cache": self._prefixes.bytes, "prefix_budget": self._prefixes.budget, "drafters": drafted}

    @property
    def max_length(self) -> int:
        """The model's context length (tokens)."""
        return self.sm.max_length

    def kv_cost(self) -> tuple[Callable[[int], int], bool]:
        """The KV bytes of a cache of n entries (`KVLayout.bytes`), and whether an evicted cache is recomputed
        exactly (our kernels run the layers)."""
        return self.sm.kv_layout().bytes, self.sm.layer_loop() != "transformers"

    def prompt_scorer(self, ids: list[int], k: int) -> PromptScorer:
        """The prompt's logprobs entries (k alternatives each), scored a chunk per `step()`."""
        return PromptScorer(self.sm, ids, k)

    def warm_up(self) -> None:
        """The first forwards, from the calling thread: the one that will decode (`runtime.model.warm_up`)."""
        warm_up(self.sm)
