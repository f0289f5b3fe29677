"""Confidence-aware tree drafting with the layer-skipped model, on the full model's own KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftdecode.model import SwiftModel
from swiftdecode.skip import SkipSet
from swiftdecode.tree import Tree

# SWIFT's mapping from the draft's top-1 probability to the number of candidates at a depth:
# the more confident the draft, the fewer siblings it needs.
GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))


@dataclass(frozen=True)
class DraftConfig:
    max_depth: int = 8  # draft forwards per round at most
    epsilon: float = 0.8  # stop drafting once the draft's top-1 probability falls below this
    max_nodes: int = 24  # tree size bound (the verification forward scores max_nodes + 1 tokens)
    topk: tuple[tuple[float, int], ...] = GREEDY_TOPK


def candidates_for(confidence: float, topk: tuple[tuple[float, int], ...]) -> int:
    return next(k for threshold, k in topk if confidence > threshold or threshold == 0.0)


def draft(sm: SwiftModel, tree: Tree, start: int, skip: SkipSet, cfg: DraftConfig, max_depth: int) -> int:
    """Grow `tree` with a chain of the skip model's top-1 tokens from its root at position `start`, plus top-k
    siblings at each depth; stop below confidence ε, at `max_depth` or at the node budget.

    Writes draft KV entries after position `start` into the cache; the caller truncates them. Returns the
    number of draft forwards run.
    """
    token, parent, steps = tree.root, -1, 0
    while steps < min(cfg.max_depth, max_depth) and len(tree) < cfg.max_nodes:
        hidden = sm.forward(
            [token], torch.tensor([start + steps]), torch.ones(1, 1, dtype=torch.bool), skip=skip
        )
        logits, ids = sm.draft_logits(hidden)
        probs = torch.softmax(logits[0], dim=-1)
        steps += 1
        k = min(candidates_for(float(probs.max()), cfg.topk), cfg.max_nodes - len(tree))
        top_p, top = torch.topk(probs, k)
        top = (top if ids is None else ids[top]).tolist()
        chain = tree.add(top[0], parent)
        for t in top[1:]:
            tree.add(t, parent)
        if float(top_p[0]) < cfg.epsilon:
            break
        token, parent = top[0], chain
    return steps
