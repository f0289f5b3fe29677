"""KV cache over preallocated buffers, with the two operations speculative decoding needs: truncate and keep.

Every layer holds keys/values of shape [batch, heads, capacity, head_dim]; `keys`/`values` are views of the first
`length` slots. Layers may differ in length while a draft skips their attention; `truncate` brings them back.
A cache's per-layer buffer addresses and lengths live in one native table (`SwiftCache.table`), which the native
layer loop reads and advances itself: a forward costs no Python work per layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from swiftdecode.kernels.decoder import KVEntry


def _filled(buffer: str) -> property:
    """A read-only view of the filled part of buffer `buffer` ([..., :length, :]), taken when read: lengths change
    every step (per layer, ~60 times a forward on small models) and most steps never read the views (the native
    layer loop). transformers' layer base class clears keys/values by assigning None, which is all it may set."""

    def get(self) -> torch.Tensor | None:
        buf = getattr(self, buffer)
        return buf[:, :, : self.length] if buf is not None else None

    def set_(self, value) -> None:
        if value is not None:
            raise NotImplementedError("a BufferLayer's keys and values are views of its buffers, not assignable")

    return property(get, set_)


class BufferLayer(DynamicLayer):
    """One layer's KV entries in a buffer that grows by doubling (from 256 entries), never past `limit` entries
    unless an append needs more; appends copy only the new entries."""

    def __init__(self, limit: int | None, entry: KVEntry):
        self.entry = entry  # buffer addresses, head stride and length, in its cache's native table
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        super().__init__()
        self.limit = limit

    @property
    def length(self) -> int:
        return self.entry.length

    @length.setter
    def length(self, n: int) -> None:
        self.entry.length = n

    @property
    def capacity(self) -> int:
        return self._k.shape[2] if self._k is not None else 0

    def _bind(self) -> None:
        """Point the native entry at the (new) buffers."""
        self.entry.k, self.entry.v, self.entry.head_stride = self._k.data_ptr(), self._v.data_ptr(), self._k.stride(1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = key_states.shape
        self._allocate(shape[:2], shape[-2], shape[-1], key_states.dtype, key_states.device)

    def _allocate(self, lead: tuple, entries: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        n = max(min(256, self.limit or 256), entries)
        self._k = torch.empty((*lead, n, dim), dtype=dtype, device=device)
        self._v = torch.empty((*lead, n, dim), dtype=dtype, device=device)
        self._bind()
        self.length = 0
        self.is_initialized = True

    keys = _filled("_k")
    values = _filled("_v")

    def _room(self, end: int) -> None:
        """Grow the buffers to hold `end` entries (doubling, capped at `limit` unless `end` needs more)."""
        if end > self._k.shape[2]:
            doubled = 2 * self._k.shape[2] if self.limit is None else min(2 * self._k.shape[2], self.limit)
            grow = max(end, doubled) - self._k.shape[2]
            self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], 2)
            self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], 2)
            self._bind()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._room(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def reserve(self, n: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        """Room for n more entries (CPU buffers [1, heads, ·, dim] of `dtype`) for a native writer, which writes
        them at `entry` and advances its length."""
        if not self.is_initialized:
            self._allocate((1, heads), n, dim, dtype, torch.device("cpu"))
        self._room(self.length + n)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.truncate(self.get_seq_length() - abs(tokens_to_remove))

    def truncate(self, length: int) -> None:
        if self.is_initialized and length < self.length:
            self.length = max(length, 0)

    @torch.inference_mode()
    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep entries start+index (ascending) at start..start+len(index)-1; drop everything after."""
        if not self.is_initialized:
            return
        src = start + index
        self._k[:, :, start : start + len(index)] = self._k[:, :, src]
        self._v[:, :, start : start + len(index)] = self._v[:, :, src]
        self.length = start + len(index)


class SwiftCache(Cache):
    """Cache for one sequence. `length` is layer 0's length (layer 0 is never skipped). `limit`: the most
    entries a layer's buffer grows to (beyond it only as appends require), so memory stays within a bound known
    up front."""

    def __init__(self, num_layers: int, limit: int | None = None):
        self.table = (KVEntry * num_layers)()  # the layers' native entries, in layer order
        super().__init__(layers=[BufferLayer(limit, self.table[i]) for i in range(num_layers)])
        self._min_capacity = 0  # every layer's buffer holds at least this many entries (buffers only grow)

    @property
    def length(self) -> int:
        return self.layers[0].get_seq_length()

    def limit(self, n: int) -> None:
        """From now on no layer's buffer grows past n entries (unless an append needs more)."""
        for layer in self.layers:
            layer.limit = n

    def reserve(self, n: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        """Room for n more entries in every layer (each at most layer 0's length) for the native layer loop;
        O(1) while the buffers have room."""
        if self.length + n > self._min_capacity:
            for layer in self.layers:
                layer.reserve(n, heads, dim, dtype)
            self._min_capacity = min(layer.capacity for layer in self.layers)

    def entries(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's first n keys and values ([batch, heads, n, dim] each; every layer holds ≥ n), as views of
        its buffers, not copies: valid while the cache is not written again (a finished request's)."""
        if any(layer.get_seq_length() < n for layer in self.layers):
            raise ValueError(f"a layer holds fewer than {n} entries")
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in self.layers]

    def extend(self, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append each layer's keys and values (as `entries` returns them) after its entries."""
        for layer, (k, v) in zip(self.layers, entries, strict=True):
            layer.update(k, v)

    def truncate(self, length: int) -> None:
        """Drop every entry at index ≥ length (e.g. all a draft wrote); nothing to do when layer 0, which holds
        the most entries (a draft never skips the first layer), holds no more than `length`."""
        if length >= self.length:
            return
        for layer in self.layers:
            layer.truncate(length)

    def keep(self, start: int, index: list[int]) -> None:
        """Compact the entries after `start` to those at start+index (the accepted path of a verified tree,
        ascending). A path that is already in place (index 0..n−1: a chain, or the root alone) only truncates."""
        if index[-1] == len(index) - 1:
            self.truncate(start + len(index))
            return
        rows = torch.tensor(index)
        for layer in self.layers:
            layer.keep(start, rows)
