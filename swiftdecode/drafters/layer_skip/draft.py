"""Drafting a token tree with the layer-skipped model: a confidence-aware chain with top-k siblings, on the full
model's own KV cache."""

from __future__ import annotations

import torch

from swiftdecode.base.config import DraftConfig
from swiftdecode.decoding.sampling import Sampler, probabilities
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.skip import SkipSet
from swiftdecode.runtime.tree import Tree

SOURCE = "skip"  # the draft's nodes' source name (Tree.sources)


def candidates_for(confidence: float, topk: tuple[tuple[float, int], ...]) -> int:
    return next(k for threshold, k in topk if confidence > threshold or threshold == 0.0)


def draft(
    sm: SwiftModel,
    cache: SwiftCache,
    tree: Tree,
    skip: SkipSet,
    cfg: DraftConfig,
    max_depth: int,
    min_prefix: float = 0.0,
    sampler: Sampler | None = None,
) -> int:
    """Grow `tree` from its root (at position `start`, the cache's length) with the skip model: a chain of best
    tokens (top-1, or when sampling the coupled sample, see `_candidates`), stopping
    below confidence ε, once the chain's probability falls below `min_prefix` (the cost of one more draft step,
    in full forwards) or at `max_depth`, plus top-k siblings per depth; keep the `max_nodes` candidates most
    likely to be accepted (chain prefix probability × own probability; parents always rank above children).

    Writes draft KV entries after position `start` into the cache; the caller truncates them. Returns the
    number of draft forwards run.
    """
    token, prefix, steps, start = tree.root, 1.0, 0, cache.length
    layers: list[list[tuple[float, int]]] = []  # per depth: (estimated acceptance probability, token), best first
    while steps < min(cfg.max_depth, max_depth):
        position, one = torch.tensor([start + steps]), torch.ones(1, 1, dtype=torch.bool)
        hidden = sm.forward([token], position, one, cache, skip=skip)
        logits, ids = sm.draft_logits(hidden)
        steps += 1
        odds, top = _candidates(logits[0], ids, cfg, sampler, start + steps, sm.vocab_size)
        layers.append([(prefix * p, t) for p, t in zip(odds, top, strict=True)])
        if odds[0] < cfg.epsilon or prefix * odds[0] < min_prefix:
            break
        token, prefix = top[0], prefix * odds[0]
    if not layers:
        return steps
    cutoff = sorted((v for layer in layers for v, _ in layer), reverse=True)[: cfg.max_nodes][-1]
    parent = -1
    for layer in layers:
        kept = [t for v, t in layer if v >= cutoff]
        if not kept:
            break
        chain = tree.add(kept[0], parent, SOURCE)
        for t in kept[1:]:
            tree.add(t, parent, SOURCE)
        parent = chain
    return steps


def _candidates(
    logits: torch.Tensor, ids: torch.Tensor | None, cfg: DraftConfig, sampler: Sampler | None, position: int, vocab: int
) -> tuple[list[float], list[int]]:
    """The draft's candidates for `position`, best first, with estimated acceptance probabilities.

    Greedy: the top tokens of the draft distribution q, scored by q. Sampling: the target picks argmax p/E with
    the position's seeded noise E (`Sampler`), so the draft ranks by q/E with the same noise (coupled drafting:
    where q ≈ p both pick the same token). Its score is the margin 1 − s₂/s₁ of the best two ratios s; the
    i-th candidate's is r₂·rᵢ with rᵢ = sᵢ/s₁.
    """
    if sampler is None or sampler.params.greedy:
        probs = torch.softmax(logits, dim=-1)
        top_p, top = torch.topk(probs, candidates_for(float(probs.max()), cfg.topk))
        odds = top_p.tolist()
    else:
        noise = sampler.noise_at(position, vocab) if ids is None else sampler.noise_of(position, ids)
        ratio = probabilities(logits, sampler.params) / noise
        best, top = torch.topk(ratio, max(2, *(k for _, k in cfg.topk)))
        r = (best / best[0]).tolist() if best[0] > 0 else [1.0] * len(best)
        k = candidates_for(1.0 - r[1], cfg.topk)
        top, odds = top[:k], [1.0 - r[1]] + [r[1] * ri for ri in r[1:k]]
    return odds, (top if ids is None else ids[top]).tolist()
