"""Lossless acceptance of a draft tree from one full-model forward over it.

At each accepted node, the full model's token for the next position is chosen exactly as plain decoding would
choose it (`Sampler.pick`: argmax, or the seeded exponential-race sample); the child holding that token is
accepted, and the round ends at the first position no child matches, with the chosen token as the bonus.
The emitted sequence is therefore exactly plain decoding's, token for token, for greedy and sampling alike.

For sampling this is multi-candidate speculative sampling with deterministic draft candidates: candidate x is
accepted with probability p(x) under the residual left by the candidates before it (min(1, p/q) with q = δ_x,
residual ∝ max(p − q, 0)), i.e. with total probability Σ p(candidates) — realised through shared noise.
"""

from __future__ import annotations

import torch

from swiftdecode.decoding.sampling import Sampler
from swiftdecode.runtime.tree import Tree


def verify(tree: Tree, logits: torch.Tensor, sampler: Sampler, root_position: int) -> tuple[list[int], int]:
    """Accepted node indices (a root-to-node path) and the bonus token, from logits [len(tree)+1, V] whose
    row 0 is the root (at `root_position`) and row i+1 is node i."""
    path: list[int] = []
    taken: list[int] = []  # the path's tokens: the picks after them penalize them (Sampler.pick's `after`)
    node = -1
    while True:
        target = sampler.pick(logits[node + 1], root_position + len(path) + 1, taken)
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == target), None)
        if nxt is None:
            return path, target
        path.append(nxt)
        taken.append(target)
        node = nxt
