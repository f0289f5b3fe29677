"""The layer-skip drafter: the model with the skip set's sublayers left out drafts a tree on the request's own
cache (`draft`), over the draft vocabulary (`vocab`); the skip set and its on-the-fly search are the tuner's."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.base import Drafter
from swiftdecode.drafters.budget import TimeBudget, ema
from swiftdecode.drafters.layer_skip.draft import SOURCE, draft
from swiftdecode.drafters.layer_skip.tuner import SkipTuner
from swiftdecode.drafters.layer_skip.vocab import DraftVocab
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.tree import Tree

STEP_KEEP = 0.8  # a draft forward's seconds estimate keeps 80% per draft round (about 5 rounds of memory)


class LayerSkipDrafter(Drafter):
    """Drafts with the skip set the tuner holds (none before a first prompt with init "cosine"). Its draft
    settings for greedy (True) and sampled (False) requests differ in the siblings per depth."""

    kind, source = "draft", SOURCE

    def __init__(self, sm, cfg):
        super().__init__(sm, cfg)
        self.tuner = SkipTuner(sm, cfg)
        self.vocab = DraftVocab(sm, cfg.draft_vocab)
        self.settings = {True: cfg.draft, False: replace(cfg.draft, topk=cfg.draft.sampling_topk)}
        self.step_s: float | None = None  # measured seconds of one draft forward (EMA)

    def ready(self) -> bool:
        return self.tuner.skip is not None

    def reads_prefill(self) -> bool:
        """A prompt's prefill sets the first skip set (its collinearity) and, for sparse drafts, the thresholds."""
        return self.tuner.skip is None or self.tuner.sparse()

    def prefill(self, ids: list[int], cache: SwiftCache) -> torch.Tensor:
        return self.tuner.prefill(ids, cache)

    def begin(self, req: Request) -> None:
        self.vocab.prompt(req.ids)

    def grow(self, req: Request, tree: Tree, length: int, plain_rate: float | None) -> int:
        """Draft while a chain's odds pay for one more draft forward, whose cost relative to a plain step is
        measured on live rounds (`plain_rate`: plain rounds' tokens/s) once both have run."""
        measured = self.step_s * plain_rate if self.step_s and plain_rate else None
        start, t = req.cache.length, time.perf_counter()
        settings, sampler = self.settings[req.sampler.params.greedy], req.sampler
        steps = draft(
            self.sm, req.cache, tree, self.tuner.skip, settings, length, self.tuner.step_cost(measured), sampler
        )
        req.cache.truncate(start)  # the draft's own cache entries
        if steps:
            self.step_s = ema(self.step_s, (time.perf_counter() - t) / steps, STEP_KEEP)
        return steps

    def observe(self, req: Request, tokens: list[int], kind: str, budget: TimeBudget) -> None:
        self.tuner.after_round(req, tokens, kind, budget)

    def end(self, req: Request) -> None:
        if self.tuner.skip is not None:
            search = self.tuner.search
            req.stats.skip, req.stats.search = self.tuner.skip.to_dict(), search.state if search else "off"
        self.vocab.count(req.new)
