"""Drafting a token tree: the layer-skipped model's confidence-aware chain with top-k siblings, plus n-gram
continuations copied from the context, all on the full model's own KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from swiftdecode.model import SwiftModel
from swiftdecode.sampling import Sampler, probabilities
from swiftdecode.skip import SkipSet
from swiftdecode.tree import NGRAM, SKIP, Tree

# SWIFT's mapping from the draft's top-1 probability to the number of candidates at a depth:
# the more confident the draft, the fewer siblings it needs.
GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))
# On a CPU every verified token costs: fewer siblings, and the cheapest ones are chosen by acceptance odds.
COMPACT_TOPK = ((0.95, 1), (0.8, 2), (0.5, 3), (0.0, 4))


@dataclass(frozen=True)
class DraftConfig:
    max_depth: int = 8  # draft forwards per round at most
    epsilon: float = 0.8  # stop drafting once the draft's top-1 probability falls below this
    max_nodes: int = 24  # tree nodes at most; skip-draft nodes are kept best first by estimated acceptance
    topk: tuple[tuple[float, int], ...] = GREEDY_TOPK  # candidates per depth, greedy decoding
    sampling_topk: tuple[tuple[float, int], ...] = SAMPLING_TOPK  # ... when sampling
    ngram: int = 0  # longest n-gram continuation from the context added as a branch (0 = off)


def candidates_for(confidence: float, topk: tuple[tuple[float, int], ...]) -> int:
    return next(k for threshold, k in topk if confidence > threshold or threshold == 0.0)


def draft(
    sm: SwiftModel,
    tree: Tree,
    start: int,
    skip: SkipSet,
    cfg: DraftConfig,
    max_depth: int,
    min_prefix: float = 0.0,
    sampler: Sampler | None = None,
) -> int:
    """Grow `tree` from its root (at position `start`) with the skip model: a chain of best tokens (top-1, or
    when sampling the coupled sample, see `_candidates`), stopping
    below confidence ε, once the chain's probability falls below `min_prefix` (the cost of one more draft step,
    in full forwards) or at `max_depth`, plus top-k siblings per depth; keep the `max_nodes` candidates most
    likely to be accepted (chain prefix probability × own probability; parents always rank above children).

    Writes draft KV entries after position `start` into the cache; the caller truncates them. Returns the
    number of draft forwards run.
    """
    token, prefix, steps = tree.root, 1.0, 0
    layers: list[list[tuple[float, int]]] = []  # per depth: (estimated acceptance probability, token), best first
    while steps < min(cfg.max_depth, max_depth):
        hidden = sm.forward([token], torch.tensor([start + steps]), torch.ones(1, 1, dtype=torch.bool), skip=skip)
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
        chain = tree.add(kept[0], parent, SKIP)
        for t in kept[1:]:
            tree.add(t, parent, SKIP)
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
        noise = sampler.noise_at(position, vocab)
        ratio = probabilities(logits, sampler.params) / (noise if ids is None else noise[ids])
        best, top = torch.topk(ratio, max(2, *(k for _, k in cfg.topk)))
        r = (best / best[0]).tolist() if best[0] > 0 else [1.0] * len(best)
        k = candidates_for(1.0 - r[1], cfg.topk)
        top, odds = top[:k], [1.0 - r[1]] + [r[1] * ri for ri in r[1:k]]
    return odds, (top if ids is None else ids[top]).tolist()


def ngram_continuation(ctx: list[int], length: int, n_max: int = 3, n_min: int = 2) -> list[int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix n-gram of ctx
    (n_max ≥ n ≥ n_min); [] if none. ctx ends with the tree's root."""
    if length <= 0 or len(ctx) <= n_min:
        return []
    arr = np.asarray(ctx)
    for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ctx[start : start + length]
    return []


def add_chain(tree: Tree, tokens: list[int], max_nodes: int) -> None:
    """Add tokens as a path from the root, merging with nodes already there, while the tree holds at most
    `max_nodes` nodes (the root not counted)."""
    parent = -1
    for t in tokens:
        if len(tree.tokens) >= max_nodes and all(tree.tokens[i] != t for i in tree.children(parent)):
            return
        parent = tree.add(t, parent, NGRAM)  # merges with an existing child
