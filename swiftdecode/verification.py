"""Lossless acceptance of a draft tree from one full-model forward over it.

Greedy: follow the children that equal the full model's argmax; the result is exactly plain greedy decoding.
Sampling: at each node, try its children in order; child x is accepted with probability p(x) under the current
residual p, else p ← normalise(p with x removed). This is multi-candidate rejection sampling with a deterministic
draft (q = δ_x: accept with min(1, p/q) = p(x), residual max(p − q, 0)), so every emitted token is distributed
exactly as the model's (temperature / top-k / top-p) distribution given the accepted prefix.
"""

from __future__ import annotations

import torch

from swiftdecode.sampling import SamplingParams, probabilities
from swiftdecode.tree import Tree


def verify(
    tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Accepted node indices (a root-to-node path) and the bonus token, from logits [len(tree)+1, V]
    whose row 0 is the root and row i+1 is node i."""
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        children = tree.children(node)
        if params.greedy:
            target = int(row.argmax())
            nxt = next((c for c in children if tree.tokens[c] == target), None)
            if nxt is None:
                return path, target
        else:
            nxt, p = _accept_one(children, tree, probabilities(row, params), generator)
            if nxt is None:
                return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(nxt)
        node = nxt


def _accept_one(
    children: list[int], tree: Tree, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """Try candidates in order; return the accepted child (or None) and the residual distribution."""
    for c in children:
        x = tree.tokens[c]
        if torch.rand((), generator=generator) < p[x]:
            return c, p
        p = p.clone()
        p[x] = 0.0  # rejected: p[x] < 1, so mass remains
        p /= p.sum()
    return None, p
