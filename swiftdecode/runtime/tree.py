"""Draft token trees and the attention masks that let one forward score a whole tree on top of the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SEVERAL = "both"  # the source of a node that more than one drafter proposed


@dataclass
class Tree:
    """Draft tokens below a root (the last accepted token, not yet in the cache).

    Node i has token `tokens[i]`, parent `parents[i]` (−1 = root), depth `depths[i]` ≥ 1 and `sources[i]`, the
    source name of the drafter that proposed it (SEVERAL if more than one did); parents precede children.
    `children(−1)` lists the root's children in candidate order (best first).
    """

    root: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, source: str) -> int:
        """Append a child of `parent` proposed by drafter `source` unless that token is already one (then mark
        it proposed by `source` too); return the node index."""
        for i in self.children(parent):
            if self.tokens[i] == token:
                self.sources[i] = source if self.sources[i] == source else SEVERAL
                return i
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.sources.append(source)
        return len(self.tokens) - 1

    def add_chain(self, tokens: list[int], max_nodes: int, source: str) -> None:
        """Add tokens as a path from the root, merging with nodes already there, while the tree holds at most
        `max_nodes` nodes (the root not counted)."""
        parent = -1
        for t in tokens:
            if len(self.tokens) >= max_nodes and all(self.tokens[i] != t for i in self.children(parent)):
                return
            parent = self.add(t, parent, source)  # merges with an existing child

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def input_ids(self) -> list[int]:
        """Root then nodes: the tokens of the verification forward (row 0 = root, row i+1 = node i)."""
        return [self.root, *self.tokens]

    def positions(self, start: int) -> torch.Tensor:
        """Position ids [n+1] of root and nodes when the root sits at position `start`."""
        return torch.tensor([start, *(start + d for d in self.depths)])

    def ancestry(self) -> torch.Tensor:
        """Bool [n+1, n+1]: entry (i, j) is True iff row j is row i or an ancestor of it (row 0 = root)."""
        n = len(self.tokens) + 1
        if n == 1:  # the root alone: a plain step, the commonest row of a batched round
            return torch.ones(1, 1, dtype=torch.bool)
        anc = torch.eye(n, dtype=torch.bool)
        anc[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i + 1] |= anc[p + 1]
        return anc


def attention_mask(
    q_pos: torch.Tensor,
    prefix_len: int,
    visible: torch.Tensor | int,
    new_allowed: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask [1, 1, q, prefix_len + q] for q new tokens appended after `prefix_len` cached entries.

    Query i sees cached entries j < visible[i] (cache index = position there) and new token j where
    new_allowed[i, j]; with a sliding `window`, only keys less than `window` positions back.
    """
    q = len(q_pos)
    if window is None and isinstance(visible, int) and visible >= prefix_len:  # the common case, built cheaply
        mask = torch.zeros((1, 1, q, prefix_len + q), dtype=dtype)
        mask[0, 0, :, prefix_len:].masked_fill_(~new_allowed, torch.finfo(dtype).min)
        return mask
    kv_pos = torch.cat([torch.arange(prefix_len), q_pos])
    vis = torch.as_tensor(visible).reshape(-1, 1)
    allowed = torch.cat([(torch.arange(prefix_len)[None, :] < vis).expand(q, -1), new_allowed], dim=1)
    if window is not None:
        allowed &= (q_pos[:, None] - kv_pos[None, :]) < window
    mask = torch.zeros((1, 1, q, prefix_len + q), dtype=dtype)
    return mask.masked_fill_(~allowed[None, None], torch.finfo(dtype).min)
