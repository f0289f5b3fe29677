"""KV cache over preallocated buffers, with the two operations speculative decoding needs: truncate and keep.

Every layer holds keys/values of shape [batch, heads, capacity, head_dim]; `keys`/`values` are views of the
entries it holds. Layers may differ in length while a draft skips their attention; `truncate` brings them back.
A sliding-window layer (given its window) holds only its last entries: when its buffer is full it drops those
more than window + WINDOW_SLACK entries behind its end, so its memory stays bounded however long the context;
`first` is the first entry it still holds (entry t sits at buffer slot t − first). A cache's per-layer buffer
addresses and lengths live in one native table (`SwiftCache.table`), which the native layer loop reads and
advances itself: a forward costs no Python work per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from swiftdecode.kernels.decoder import KVEntry

# Entries a sliding-window layer keeps beyond its window. Forwards re-read positions behind the cache's end: a
# draft's chain is rolled back (up to its depth, 8), the skip search scores its 32-position window again
# (`tuner.matchness`); each needs the keys a window behind its first row. `SwiftCache.check_window` stops a
# forward that would need a dropped key.
WINDOW_SLACK = 256


def most_held(window: int | None) -> int | None:
    """The most entries a layer's buffer holds (beyond what one append needs): None (all) for a layer without a
    window, a sliding layer's 2 × (window + WINDOW_SLACK) (full, it drops to window + WINDOW_SLACK)."""
    return None if window is None else 2 * (window + WINDOW_SLACK)


@dataclass(frozen=True)
class KVLayout:
    """A model's caches: each layer's sliding window (None: it keeps every entry; `SwiftCache(layout.windows)`) and
    the bytes of one token's keys and values in one layer."""

    windows: tuple[int | None, ...]
    entry_bytes: int

    def bytes(self, entries: int) -> int:
        """The most bytes a cache of `entries` entries holds (a sliding layer's: `most_held`)."""
        held = (entries if (m := most_held(w)) is None else min(entries, m) for w in self.windows)
        return self.entry_bytes * sum(held)

    def sliding(self) -> tuple[int, int] | None:
        """How many layers drop the keys beyond their window, and the most entries one holds; None: none."""
        held = [most_held(w) for w in self.windows if w is not None]
        return (len(held), max(held)) if held else None


def _filled(buffer: str) -> property:
    """A read-only view of the filled part of buffer `buffer` ([..., :length − first, :]), taken when read: lengths
    change every step (per layer, ~60 times a forward on small models) and most steps never read the views (the
    native layer loop). transformers' layer base class clears keys/values by assigning None, which is all it may
    set."""

    def get(self) -> torch.Tensor | None:
        buf = getattr(self, buffer)
        return buf[:, :, : self.length - self.first] if buf is not None else None

    def set_(self, value) -> None:
        if value is not None:
            raise NotImplementedError("a BufferLayer's keys and values are views of its buffers, not assignable")

    return property(get, set_)


class BufferLayer(DynamicLayer):
    """One layer's KV entries in a buffer that grows by doubling (from 256 entries), never past `limit` entries
    unless an append needs more; appends copy only the new entries. With a `window` (a sliding-window layer), a full
    buffer first drops the entries more than window + WINDOW_SLACK behind the end, and grows no further than twice
    that (`most_held`)."""

    def __init__(self, limit: int | None, entry: KVEntry, window: int | None = None):
        self.entry = entry  # buffer addresses, head stride, length and first entry, in its cache's native table
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        super().__init__()
        self.limit, self.window = limit, window

    @property
    def length(self) -> int:
        return self.entry.length

    @length.setter
    def length(self, n: int) -> None:
        self.entry.length = n

    @property
    def first(self) -> int:
        return self.entry.first

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
        self.length, self.entry.first = 0, 0
        self.is_initialized = True

    keys = _filled("_k")
    values = _filled("_v")

    def _room(self, end: int) -> None:
        """Room for the entries up to `end`: where the buffer is full, a sliding layer drops those more than window +
        WINDOW_SLACK behind its end; then grow (doubling, capped at `limit` and `most_held` unless `end` needs more)."""
        if end - self.first <= self.capacity:
            return
        if self.window is not None and (keep_from := self.length - self.window - WINDOW_SLACK) > self.first:
            self._drop_to(keep_from)
        if end - self.first > self.capacity:
            doubled = min([2 * self.capacity, *(c for c in (self.limit, most_held(self.window)) if c)])
            grow = max(end - self.first, doubled) - self.capacity
            self._k = torch.cat([self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], 2)
            self._v = torch.cat([self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], 2)
            self._bind()

    def _drop_to(self, first: int) -> None:
        """Drop the entries before `first`: the rest move to the buffer's start, into buffers of `most_held` where
        one long append (a prompt read in one forward) had grown them past it."""
        kept = slice(first - self.first, self.length - self.first)
        n, size = kept.stop - kept.start, min(self.capacity, most_held(self.window))
        k, v = self._k[:, :, kept].clone(), self._v[:, :, kept].clone()
        if size < self.capacity:
            self._k, self._v = (b.new_empty((*b.shape[:2], size, b.shape[-1])) for b in (self._k, self._v))
            self._bind()
        self._k[:, :, :n], self._v[:, :, :n] = k, v
        self.entry.first = first

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._room(end)
        self._k[:, :, self.length - self.first : end - self.first] = key_states
        self._v[:, :, self.length - self.first : end - self.first] = value_states
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
            if length < self.first:
                raise ValueError(
                    f"entries before {self.first} were dropped (sliding window): cannot truncate to {length}"
                )
            self.length = max(length, 0)

    @torch.inference_mode()
    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep entries start+index (ascending) at start..start+len(index)-1; drop everything after."""
        if not self.is_initialized:
            return
        src, at = start - self.first + index, start - self.first
        self._k[:, :, at : at + len(index)] = self._k[:, :, src]
        self._v[:, :, at : at + len(index)] = self._v[:, :, src]
        self.length = start + len(index)


class SwiftCache(Cache):
    """Cache for one sequence. `length` is layer 0's length (layer 0 is never skipped). `layers`: the number of
    layers, or each layer's sliding window (None: it keeps every entry; a window: it may drop keys more than
    window + WINDOW_SLACK entries behind its end). `limit`: the most entries a layer's buffer grows to (beyond it
    only as appends require), so memory stays within a bound known up front."""

    def __init__(self, layers: int | Sequence[int | None], limit: int | None = None):
        windows = [None] * layers if isinstance(layers, int) else list(layers)
        self.table = (KVEntry * len(windows))()  # the layers' native entries, in layer order
        super().__init__(layers=[BufferLayer(limit, self.table[i], w) for i, w in enumerate(windows)])
        self.windows = windows
        # the sliding layers and their windows, which `check_window` reads each forward
        self._sliding = [(layer, w) for layer, w in zip(self.layers, windows, strict=True) if w is not None]
        self._room_until = 0  # every layer's buffer has room up to this entry (until one drops or grows)

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
        if self.length + n > self._room_until:
            for layer in self.layers:
                layer.reserve(n, heads, dim, dtype)
            self._room_until = min(layer.first + layer.capacity for layer in self.layers)

    def check_window(self, position: int) -> None:
        """Raise unless each sliding layer still holds the keys a row at `position` (the lowest of a forward's
        rows) attends to: those less than its window behind."""
        for layer, window in self._sliding:
            if layer.first > max(position - window + 1, 0):
                raise RuntimeError(
                    f"a row at position {position} needs keys from {position - window + 1}, but its sliding-window "
                    f"layer dropped those before {layer.first} (more than WINDOW_SLACK behind the cache's end)"
                )

    def entries(self, n: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Every layer's first entry held and its keys and values up to entry n ([batch, heads, n − first, dim]
        each; every layer holds ≥ n), as views of its buffers, not copies: valid while the cache is not written
        again (a finished request's)."""
        if any(layer.get_seq_length() < n for layer in self.layers):
            raise ValueError(f"a layer holds fewer than {n} entries")
        return [(la.first, la.keys[:, :, : n - la.first], la.values[:, :, : n - la.first]) for la in self.layers]

    def extend(self, entries: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Append each layer's entries (as `entries` returns them: from entry `first` on) after its own; an empty
        layer takes them from `first` on, else `first` must be its length."""
        for layer, (first, k, v) in zip(self.layers, entries, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            if layer.length == 0:
                layer.length, layer.entry.first = first, first
            elif first != layer.length:
                raise ValueError(f"entries from {first} cannot follow a layer's {layer.length}")
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
