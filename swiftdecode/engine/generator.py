"""The generation engine: prefill, then rounds of propose (layer-skipped model and n-gram branch) → verify (full
model, one forward over the draft tree) → keep the accepted path, with on-the-fly search of the skip set between
rounds. Its parts: `config` (settings, presets), `scheduler` (round kinds), `tuning` (skip set and search), `profile`
(measurements the search starts from), `text` (prompts and output text), `drafting.DraftVocab`."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from swiftdecode.base.config import METHODS, PAPER_SEARCH, EngineConfig, preset
from swiftdecode.base.errors import UserError
from swiftdecode.base.params import check_params
from swiftdecode.base.text import Prompts, eos_ids
from swiftdecode.decoding.grammar import Grammars
from swiftdecode.decoding.request import GenerationResult, Request, StreamEvent
from swiftdecode.decoding.sampling import Sampler
from swiftdecode.decoding.tools import Tools, render
from swiftdecode.decoding.verification import verify
from swiftdecode.drafters.layer_skip.draft import DraftVocab, add_chain, draft
from swiftdecode.drafters.layer_skip.tuner import SkipTuner
from swiftdecode.drafters.rowcost import CopyPlanner
from swiftdecode.engine.scheduler import RoundScheduler
from swiftdecode.runtime.model import SwiftModel, warm_up
from swiftdecode.runtime.prefix import PrefixStore
from swiftdecode.runtime.skip import SkipSet
from swiftdecode.runtime.tree import Tree

__all__ = ["PAPER_SEARCH", "EngineConfig", "Generator", "preset"]


class Generator:
    """Lossless generation with one model. Not thread-safe; search state carries across calls. A round decodes
    one token plainly or runs `_tree_round`: propose, verify, keep. `schedule` picks each round's kind; `tuner`
    owns the draft's skip set and its search; `vocab` the draft vocabulary; `prefixes` finished sequences' cache
    entries for later prompts (`prefix_cache_gb`; none off our batch-invariant kernels, where reuse is not exact)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer, method: str = "swift", config: EngineConfig | None = None,
        prefix_cache_gb: float = 0.0,
    ):  # fmt: skip
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.tokenizer, self.sm = method, tokenizer, warm_up(SwiftModel(model))  # see warm_up
        self.cfg = cfg = config or (preset(method) if method != "ar" else None)
        self.prompts, self.eos = Prompts(tokenizer, self.sm.vocab_size, self.sm.max_length), eos_ids(model, tokenizer)
        self.grammars = Grammars(tokenizer, self.sm.vocab_size, self.eos)
        self.vocab = DraftVocab(self.sm, cfg.draft_vocab if cfg else 0)
        self.schedule = RoundScheduler(cfg.modes, cfg.adaptive) if cfg else None  # None: plain decoding (`ar`)
        self.tuner = SkipTuner(self.sm, cfg) if cfg and "draft" in cfg.modes else None  # None: no skip draft
        self.copies = CopyPlanner()  # forward cost by rows and copy acceptance: how much of an n-gram branch pays
        self.prefixes = PrefixStore(int(prefix_cache_gb * 2**30) if self.sm.layer_loop() != "transformers" else 0)
        if cfg is not None:  # draft settings for greedy (True) and sampling (False), built once
            self.draft_cfg = {True: cfg.draft, False: replace(cfg.draft, topk=cfg.draft.sampling_topk)}

    @property
    def skip(self) -> SkipSet | None:
        """The skip set the draft uses now (None before one is chosen, or without the skip draft)."""
        return self.tuner.skip if self.tuner else None

    # ---- public API -------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, see tools.render) in the chat template, ready for the answer."""
        return self.prompts.chat_ids(*render(messages, tools, self.tokenizer))

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
        self, prompt: str | list[int], *, max_new_tokens: int = 128, seed: int | None = None, chat: bool = False,
        logprobs: int | None = None, stop: list[str] | None = None, grammar: dict | Tools | None = None,
        cache_salt: str | None = None, **sampling,
    ) -> Request:  # fmt: skip
        """A validated request, not started (UserError on bad input). `sampling`: `params.check_params`'s keywords;
        `logprobs` (0-20; None: off): each token's log-probability and that many alternatives; `grammar`: the
        answer's structure (or `tools.Tools`); `cache_salt`: entries are shared only by requests of one salt."""
        params = check_params(max_new_tokens, stop=stop, logprobs=logprobs, vocab=self.sm.vocab_size, **sampling)
        constraint, ids = self.grammars.constraint(grammar), self.prompts.encode(prompt, chat)  # ids < the context
        sampler = Sampler(params, seed if seed is not None else secrets.randbits(63), ids, constraint, self.eos)
        budget, eos = min(max_new_tokens, self.sm.max_length - len(ids)), set() if params.ignore_eos else self.eos
        return Request(ids, budget, sampler, stop, eos, self.prompts.decode, self.sm.n_layers, logprobs, cache_salt)

    def begin(self, req: Request) -> StreamEvent | None:
        """Prefill the request's prompt into its cache and take the first token."""
        self.sm.cache, t = req.cache, time.perf_counter()
        if (cached := self.take_prompt(req)) or self.tuner is None:
            logits = self.sm.logits(self.sm.prefill(req.ids[cached:])[-1:])[0]
        else:
            logits = self.tuner.prefill(req.ids)
        first = req.sampler.pick(logits, len(req.ids))
        req.stats.time_split["prefill"] = time.perf_counter() - t
        return self.advance(req, [first], logits[None])

    def step(self, req: Request) -> StreamEvent | None:
        """One decoding round of a started request."""
        self.sm.cache = req.cache
        return self.advance(req, *self._round(req))

    def advance(self, req: Request, tokens: list[int], rows: torch.Tensor | None = None) -> StreamEvent | None:
        """Give the request a round's tokens (`Request.take`); on completion, record its stats, keep its cache."""
        event = req.take(tokens, rows)
        if req.done:
            if self.skip is not None:
                search = self.tuner.search  # a skip set implies its tuner
                req.stats.skip, req.stats.search = self.skip.to_dict(), search.state if search else "off"
            self.vocab.count(req.new)
            self.prefixes.save(req.ctx[: req.cache.length], req.cache, req.salt)  # entry i: ctx[i]'s keys, values
        return event

    def take_prompt(self, req: Request) -> int:
        """A new request's prompt, before its prefill (here or in chunks): it informs the draft vocabulary, and a
        plain prefill starts after its longest stored beginning, copied into its cache (returns that length)."""
        self.vocab.prompt(req.ids)
        if self.plain_prefill():
            req.stats.cached_prompt_tokens = self.prefixes.restore(req.ids, req.cache, req.salt)
        return req.stats.cached_prompt_tokens

    def plain_prefill(self) -> bool:
        """Whether a prompt's prefill is a plain forward, which may then run in chunks beside other requests: no
        skip set to initialise from its collinearity, no sparsity thresholds to calibrate on it."""
        return self.tuner is None or (self.tuner.skip is not None and not self.tuner.sparse())

    # ---- one round --------------------------------------------------------------------------------------
    def _round(self, req: Request) -> tuple[list[int], torch.Tensor | None]:
        """One round from the last token of req.ctx (not yet cached): a copy from the context where its tokens pay
        for their rows (as measured), else a plain step or a skip-model draft. The new tokens and the logits
        rows that chose them (read for logprobs only; tree rounds give None without)."""
        ctx, room, sampler, stats = req.ctx, req.room, req.sampler, req.stats
        can_draft, t0, mode, branch = self.skip is not None, time.perf_counter(), "plain", []
        if self.cfg is not None and room > 1:
            branch, pays = self.copies.plan(req, 1, min(self.draft_cfg[sampler.params.greedy].ngram, room - 1))
            mode = self.schedule.kind(can_draft, pays > 0)
            branch = branch[:pays] if mode == "ngram" else branch
        out, rows = plain_step(self.sm, ctx, sampler) if mode == "plain" else self._tree_round(req, mode, branch)
        seconds = time.perf_counter() - t0
        if mode == "plain":
            self.copies.line.record(1, seconds)
            stats.time_split["verify"] += seconds
        stats.round_kinds[mode] += 1
        stats.round_seconds[mode] += seconds
        if self.cfg is not None:
            self.schedule.record(mode, len(out), seconds, can_draft)
            if self.tuner is not None:
                self.tuner.after_round(ctx, out, mode, stats, self.schedule)
        return out, rows

    def _tree_round(self, req: Request, mode: str, branch: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Propose a tree (the skip model's draft if mode == "draft", the n-gram `branch` always), verify it in
        one full forward, keep the accepted path's cache entries; returns the accepted tokens and the bonus."""
        ctx, room, sampler, stats = req.ctx, req.room, req.sampler, req.stats
        sm, P, cfg = self.sm, self.sm.cache.length, self.draft_cfg[sampler.params.greedy]
        t0 = time.perf_counter()
        tree, steps = Tree(ctx[-1]), 0
        if mode == "draft":
            cost = self.tuner.step_cost(self.schedule.draft_step_cost()) if self.tuner else 0.0
            steps = draft(sm, tree, P, self.skip, cfg, room - 1, cost, sampler)
        add_chain(tree, branch, cfg.max_nodes)
        sm.cache.truncate(P)  # the draft's own cache entries
        t1 = time.perf_counter()
        logits = sm.logits(sm.forward(tree.input_ids(), tree.positions(P), tree.ancestry()))
        path, bonus = verify(tree, logits, sampler, P)
        kept = [0] + [i + 1 for i in path]  # rows of the root and the accepted nodes: each chose the next token
        sm.cache.keep(P, kept)
        stats.time_split["verify"] += (verify_s := time.perf_counter() - t1)
        self.copies.line.record(len(tree) + 1, verify_s)
        stats.time_split["draft"] += t1 - t0
        stats.draft_steps += steps
        stats.count_tree(tree, path)
        if steps:
            self.schedule.record_draft((t1 - t0) / steps)
        return [tree.tokens[i] for i in path] + [bonus], logits[kept] if req.top_logprobs is not None else None


def refill(sm: SwiftModel, req: Request) -> None:
    """Recompute an evicted request's cache (`Request.evict`): a prefill of its context but the last token."""
    sm.cache, t = req.cache, time.perf_counter()
    sm.prefill(req.ctx[:-1])
    req.stats.time_split["prefill"] += time.perf_counter() - t


def plain_step(sm: SwiftModel, ctx: list[int], sampler: Sampler) -> tuple[list[int], torch.Tensor]:
    """Plain decoding: one full forward of the last token (ctx[-1], not yet in sm.cache); the token and its
    logits [1, V]."""
    P = sm.cache.length
    logits = sm.logits(sm.forward([ctx[-1]], torch.tensor([P]), torch.ones(1, 1, dtype=torch.bool)))
    return [sampler.pick(logits[0], P + 1)], logits
