"""Measurements of the model that the skip-set search starts from: the draft's cost model, timed on the live
cache, and each decoder layer's collinearity (cos(input, output)) during a prefill."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from swiftdecode.drafters.layer_skip.search import DraftCost
from swiftdecode.runtime import fastpath
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.skip import SkipSet

TIMING_REPEATS = 2  # each one-token forward is timed this often and the fastest kept (the first may be cold)
COLLINEARITY_ROWS = 64  # cos(layer input, layer output) is averaged over the prompt's last 64 positions


def draft_cost(sm: SwiftModel, sparse: bool, cache: SwiftCache) -> DraftCost:
    """Each part's share of a one-token full forward's time, timed now on `cache` as it is (one-token forwards
    of: the full model, the dense draft, the draft without inner MLPs and without any inner sublayer), and the
    MLP bytes read per sparsity level (level 0 only unless `sparse`). Layers are assumed alike."""
    L, P = sm.n_layers, cache.length
    inner = frozenset(range(1, L - 1))

    def seconds(skip: SkipSet | None) -> float:
        best = math.inf
        for _ in range(TIMING_REPEATS):
            t = time.perf_counter()
            hidden = sm.forward([0], torch.tensor([P]), torch.ones(1, 1, dtype=torch.bool), cache, skip=skip)
            logits = sm.draft_logits(hidden)[0] if skip is not None else sm.logits(hidden)
            float(logits[0, 0])  # waits for the device (GPU kernels run asynchronously)
            best = min(best, time.perf_counter() - t)
            cache.truncate(P)
        return best

    full, dense, attn_only, none = (seconds(s) for s in (None, SkipSet(), SkipSet(mlp=inner), SkipSet(inner, inner)))
    mlp = max(dense - attn_only, 0.0) / (L - 2) / full
    attn = max(attn_only - none, 0.0) / (L - 2) / full
    read = (1.0,)
    if sparse:
        roles = [(m.role, m.weight.numel()) for m in sm.skipper.layers[0].mlp.modules() if getattr(m, "role", "")]
        down = sum(n for r, n in roles if r == "down") / sum(n for _, n in roles)
        read = tuple((1 - down) * (1 - s_in) + down * (1 - s_down) for s_in, s_down in fastpath.SPARSITY_LEVELS)
    return DraftCost(max(none / full - 2 * mlp, 0.0), np.full(L - 2, attn), np.full(L - 2, mlp), 2 * mlp, read)


class Collinearity:
    """Context manager hooking every decoder layer (transformers' forward) and yielding (observe, cos): pass
    `observe` to the lean forward (`SwiftModel.prefill`); cos() gives cos(layer input, layer output) [L]."""

    def __init__(self, sm: SwiftModel):
        self.sm, self.layers, self.cos, self.handles = sm, sm.skipper.layers, {}, []

    def _record(self, i: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        h_in, h_out = h_in.reshape(-1, h_in.shape[-1]), h_out.reshape(-1, h_out.shape[-1])
        rows = COLLINEARITY_ROWS
        self.cos[i] = float(torch.cosine_similarity(h_in[-rows:], h_out[-rows:], dim=-1).mean())

    def __enter__(self):
        def hook(i):
            def fn(module, args, kwargs, output):
                h_in = kwargs.get("hidden_states", args[0] if args else None)
                self._record(i, h_in, output[0] if isinstance(output, tuple) else output)

            return fn

        self.handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(self.layers)]
        return self._record, lambda: np.array([self.cos.get(i, 0.0) for i in range(len(self.layers))])

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
