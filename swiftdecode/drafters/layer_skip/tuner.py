"""The draft's skip set and its on-the-fly search: the initial set (the prompt's most collinear sublayers, or a
uniform one), then between rounds one search step at a time, within the search's overhead cap."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import numpy as np
import torch

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.budget import TimeBudget
from swiftdecode.drafters.layer_skip.draft import SOURCE
from swiftdecode.drafters.layer_skip.profile import Collinearity, draft_cost
from swiftdecode.drafters.layer_skip.search import DraftCost, LayerSearch
from swiftdecode.runtime import fastpath
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.skip import SkipSet

if TYPE_CHECKING:
    from swiftdecode.base.config import EngineConfig

FIRST_STEP_TOKENS = 3.0  # a search step (1-2 forwards of a 32-token window), guessed in per-token decoding time
# A search step's expected seconds: the last step's, or this share of the previous estimate if that is larger (a
# decaying maximum: one slow step holds the next ones back only for a few steps).
STEP_DECAY = 0.8


class SkipTuner:
    """The skip set the draft uses now (`skip`) and the search for a better one (`search`, None when the config
    has none). Its state lives across requests."""

    def __init__(self, sm: SwiftModel, cfg: EngineConfig):
        self.sm, self.cfg = sm, cfg
        self.skip: SkipSet | None = None
        self.search: LayerSearch | None = None
        self.step_s: float | None = None  # seconds of a search step: the last, or a decaying maximum
        # Looked up once: the model's kernels are fixed when it is loaded, and walking its modules takes ~0.2 ms
        # (SmolLM2-135M, ~400 modules), twice per request (when it joins a batch and before its prefill).
        self._sparse = cfg.sparsity > 0 and fastpath.sparse_capable(sm.model)
        if cfg.init == "uniform":
            self.start(SkipSet.uniform(sm.n_layers, cfg.init_ratio))

    def sparse(self) -> bool:
        """Whether drafts may be activation-sparse: the config asks and the MLPs run on the sparse kernel."""
        return self._sparse

    def prefill(self, ids: list[int], cache: SwiftCache) -> torch.Tensor:
        """Full forward of the prompt into `cache` (sparsity thresholds calibrated on it when drafts may be
        sparse); on first use with init "cosine", the initial skip set is the inner sublayers whose output is most
        collinear with their input, and the search starts from it. Returns the last logits [V]."""
        sm, sparse, start = self.sm, self.sparse(), None
        with self.sm.calibrating() if sparse else nullcontext():  # sparsity thresholds follow this prompt
            if self.search is None and self.cfg.init == "cosine":
                with Collinearity(sm) as (observe, cos):
                    hidden = sm.prefill(ids, cache, observe)
                n = round(self.cfg.init_ratio * (sm.n_layers - 2))
                layers = frozenset(int(i) + 1 for i in np.argsort(-cos()[1:-1])[:n])
                start = SkipSet(layers, layers, self.cfg.sparsity if sparse else 0)
            else:
                hidden = sm.prefill(ids, cache)
        logits = sm.logits(hidden[-1:])[0]
        if start is not None:  # after calibration: the search's cost timing must not set the thresholds
            self.start(start, cache)
        return logits

    def start(self, init: SkipSet, cache: SwiftCache | None = None) -> None:
        """Draft with `init` and, if the config searches, search from it (its cost model timed now, after `cache`:
        the prompt's, or an empty one)."""
        self.skip, sm = init, self.sm
        if self.cfg.search is not None:
            timed = self.cfg.search.fixed_ratio is None  # SWIFT's mode scores matchness alone: no costs needed
            on = cache if cache is not None else SwiftCache(sm.kv_layout().windows)
            cost = draft_cost(sm, self.sparse(), on) if timed else DraftCost(0.0, np.zeros(0), np.zeros(0), 0.0)
            self.search = LayerSearch(self.sm.n_layers, cost, self.cfg.search, init)

    def step_cost(self, measured: float | None) -> float:
        """Cost of one draft forward relative to a plain decoding step: `measured` on live rounds once both kinds
        have run, until then the search's cost model (timed at its start); 0 when drafts stop on confidence only."""
        if self.search is None or self.search.cfg.fixed_ratio is not None:
            return 0.0
        return measured if measured is not None else self.search.cost(self.skip)

    def after_round(self, req: Request, out: list[int], kind: str, budget: TimeBudget) -> None:
        """Tell the search a round's acceptance (`out`: its tokens, not yet in req.ctx), then take one search step
        on the request's cache if `_may_step` allows it (the request's search seconds: req.drafts[SOURCE])."""
        if self.search is None:
            return
        if kind != "plain":
            self.search.observe_acceptance(len(out))
        searched = req.drafts.get(SOURCE, 0.0)
        if self._may_step(req, searched, budget):
            t = time.perf_counter()
            self.step(req.ctx + out[:-1], out[-1], req.cache)
            spent = time.perf_counter() - t
            self.step_s = spent if self.step_s is None else max(spent, STEP_DECAY * self.step_s)
            req.drafts[SOURCE] = searched + spent
            req.stats.time_split["optimize"] += spent  # reported, not read back
            budget.searched(spent)

    def _may_step(self, req: Request, searched: float, budget: TimeBudget) -> bool:
        """Whether to take a search step: while searching, once this request has generated a whole matchness
        window (so windows hold its own output only), within the overhead cap both over recent rounds and within
        this request: its search seconds (`searched`), this step's included (its expected cost), stay below the
        cap's share of its decoding seconds, so short answers cannot overspend."""
        cap, generated, decoded = self.search.cfg.max_overhead, len(req.new), req.decode_s
        first_guess = FIRST_STEP_TOKENS * decoded / max(generated, 1)  # before one is measured
        step = self.step_s if self.step_s is not None else first_guess
        within = budget.within(cap) and searched + step <= cap * decoded
        return self.search.searching and within and generated >= self.cfg.window

    def step(self, ctx: list[int], pending: int, cache: SwiftCache) -> None:
        """Score one candidate skip set on the live context (cached in `cache`, then `pending`) and adopt the best
        set found so far."""
        if cache.length < 2:
            return
        search, window, seq = self.search, self.cfg.window, ctx + [pending]
        candidate = search.propose()
        alpha = matchness(self.sm, candidate, seq, window, cache)
        challenger = search.challenges(candidate, alpha)  # then score the best set on the same window
        search.record(candidate, alpha, matchness(self.sm, search.best, seq, window, cache) if challenger else None)
        self.skip = search.best


def matchness(sm: SwiftModel, skip: SkipSet, ctx: list[int], window: int, cache: SwiftCache) -> float:
    """Fraction of the last `window` cached positions where the skip model's top-1 equals the real next token.

    One forward over the window, appended after the cache and rolled back: query i sits at its real position
    s+i and sees the full model's cached entries before it (what a depth-1 draft sees) and itself.
    ctx holds the cached tokens followed by the pending one (len(ctx) == cache length + 1).
    """
    P = cache.length
    s = max(P - window, 0)
    pos = torch.arange(s, P)
    hidden = sm.forward(ctx[s:P], pos, torch.eye(P - s, dtype=torch.bool), cache, visible=pos, skip=skip)
    cache.truncate(P)
    logits, ids = sm.draft_logits(hidden)
    pred = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
    return float((pred.cpu() == torch.tensor(ctx[s + 1 : P + 1])).float().mean())
