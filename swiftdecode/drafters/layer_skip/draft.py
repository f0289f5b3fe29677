"""Drafting a token tree: the layer-skipped model's confidence-aware chain with top-k siblings, plus n-gram
continuations copied from the context, all on the full model's own KV cache."""

from __future__ import annotations

from array import array

import torch

from swiftdecode.base.config import DraftConfig
from swiftdecode.decoding.sampling import Sampler, probabilities
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.skip import SkipSet
from swiftdecode.runtime.tree import NGRAM, SKIP, Tree


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
        noise = sampler.noise_at(position, vocab) if ids is None else sampler.noise_of(position, ids)
        ratio = probabilities(logits, sampler.params) / noise
        best, top = torch.topk(ratio, max(2, *(k for _, k in cfg.topk)))
        r = (best / best[0]).tolist() if best[0] > 0 else [1.0] * len(best)
        k = candidates_for(1.0 - r[1], cfg.topk)
        top, odds = top[:k], [1.0 - r[1]] + [r[1] * ri for ri in r[1:k]]
    return odds, (top if ids is None else ids[top]).tolist()


def ngram_continuation(ctx: list[int], length: int, n_max: int = 3, n_min: int = 2) -> tuple[list[int], int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix n-gram of ctx
    (n_max ≥ n ≥ n_min), and that n; ([], 0) if none. ctx ends with the tree's root.

    Runs every round: the context is searched as 4-byte tokens with `bytes.rfind` (C speed: ~27 µs at 2000
    tokens, most of it packing them, where a numpy window scan took ~125 µs), keeping hits on token boundaries."""
    if length <= 0 or len(ctx) <= n_min:
        return [], 0
    data = array("i", ctx).tobytes()
    hay = len(data) - 4  # occurrences end before the last token (so a token follows them)
    for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
        needle, end = data[-4 * n :], hay
        while (at := data.rfind(needle, 0, end)) >= 0 and at % 4:
            end = at + 4 * n - 1  # a hit across token boundaries: look further back
        if at >= 0:
            start = at // 4 + n
            return ctx[start : start + length], n
    return [], 0


def add_chain(tree: Tree, tokens: list[int], max_nodes: int) -> None:
    """Add tokens as a path from the root, merging with nodes already there, while the tree holds at most
    `max_nodes` nodes (the root not counted)."""
    parent = -1
    for t in tokens:
        if len(tree.tokens) >= max_nodes and all(tree.tokens[i] != t for i in tree.children(parent)):
            return
        parent = tree.add(t, parent, NGRAM)  # merges with an existing child


class DraftVocab:
    """The draft vocabulary: the `size` tokens seen most often so far in prompts and outputs (0: the whole
    vocabulary). A request's prompt is always in; verification still scores the whole vocabulary."""

    def __init__(self, sm: SwiftModel, size: int):
        self.sm, self.size = sm, size
        self.counts = torch.zeros(sm.vocab_size)  # tokens seen in prompts and outputs: the draft vocabulary's prior

    def count(self, ids: list[int]) -> None:
        self.counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))

    def prompt(self, ids: list[int]) -> None:
        """Count a prompt and draft over the `size` tokens most seen so far (this prompt's always in), earlier
        ids first on ties (BPE ids roughly follow frequency)."""
        if not self.size:
            return
        self.count(ids)
        prior = 1.0 / (1.0 + torch.arange(len(self.counts), dtype=torch.float32))
        score = self.counts + prior
        score[torch.tensor(ids)] = float("inf")
        self.sm.set_draft_vocab(torch.topk(score, min(self.size, len(score))).indices)
