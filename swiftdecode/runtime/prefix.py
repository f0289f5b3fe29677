"""Prompt prefix reuse: the KV entries of finished sequences, kept so that a later prompt beginning with the same
tokens (a shared system prompt, a chat's earlier turns) copies them instead of computing them again.

Why this is lossless: on our kernels a token's keys and values depend only on the tokens before it, never on the
other rows of the forward that computed them (batch-invariant products, per-row attention over visible keys in
order), so entries from any earlier forward are the bits this prompt's prefill would write. The store is used
only where that holds: where our kernels run the layers (`SwiftModel.layer_loop` is not "transformers").
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from swiftdecode.runtime.cache import SwiftCache

Entries = list[tuple[int, torch.Tensor, torch.Tensor]]  # per layer: first entry held, keys, values (SwiftCache.entries)


class PrefixStore:
    """Token sequences with their KV entries, the least recently used dropped first beyond `budget` bytes (0: the
    store keeps nothing). Each sequence belongs to a `salt` (a tenant: the server's API key and the request's
    cache_salt or user): a prompt reuses only sequences of its own salt, so how much of a prompt was cached
    never tells one tenant what another sent or received."""

    def __init__(self, budget: int):
        self.budget, self.bytes = budget, 0
        # tokens, entries, bytes, and the shortest prefix they serve (a sliding layer's window must reach its first)
        self.seqs: OrderedDict[int, tuple[np.ndarray, Entries, int, int]] = OrderedDict()
        self.salts: dict[int, str | None] = {}  # key -> the salt of its sequence
        self._next = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def match(self, ids: list[int], salt: str | None = None) -> tuple[int | None, int]:
        """The stored sequence of `salt` sharing the longest prefix with `ids` that it can serve, and that length;
        at most len(ids) - 1, as the prompt's last token must be computed for its logits."""
        want, best = np.asarray(ids[:-1], dtype=np.int64), (None, 0)
        for key, (tokens, _, _, floor) in self.seqs.items():
            if self.salts[key] != salt:
                continue
            n = min(len(tokens), len(want))
            differ = np.flatnonzero(tokens[:n] != want[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared > best[1] and shared >= floor:
                best = (key, shared)
        return best

    def restore(self, ids: list[int], cache: SwiftCache, salt: str | None = None) -> int:
        """Append the entries of the longest stored prefix of `ids` (of `salt`) to an empty `cache`; returns their
        count."""
        key, n = self.match(ids, salt)
        if key is None:
            return 0
        self.seqs.move_to_end(key)
        cache.extend([(first, k[:, :, : n - first], v[:, :, : n - first]) for first, k, v in self.seqs[key][1]])
        return n

    def save(self, tokens: list[int], cache: SwiftCache, salt: str | None = None) -> None:
        """Keep the entries of `tokens` (the first len(tokens) of `cache`) for `salt`, unless a stored sequence of
        that salt already begins with them; stored sequences of it they begin with are dropped. The cache is handed
        over: its buffers are kept, not copied (copying 700 tokens of SmolLM2's held the worker 0.7 ms, keeping
        them 0.13 ms), so it must not be written again; they count whole against the budget."""
        if not self.budget:
            return
        new = np.asarray(tokens, dtype=np.int64)
        for key, (old, *_) in list(self.seqs.items()):
            n = min(len(old), len(new))
            if self.salts[key] == salt and np.array_equal(old[:n], new[:n]):
                if len(old) >= len(new):
                    self.seqs.move_to_end(key)
                    return
                self._drop(key)
        entries = cache.entries(len(new))
        size = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for _, k, v in entries)
        if size > self.budget:
            return
        floor = max((first + w - 1 for (first, *_), w in zip(entries, cache.windows, strict=True) if first), default=0)
        self.seqs[self._next], self.salts[self._next], self._next = (new, entries, size, floor), salt, self._next + 1
        self.bytes += size
        while self.bytes > self.budget:
            self._drop(next(iter(self.seqs)))

    def _drop(self, key: int) -> None:
        self.bytes -= self.seqs.pop(key)[2]
        del self.salts[key]
