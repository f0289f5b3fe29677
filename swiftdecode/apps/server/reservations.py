"""The KV cache the running requests may hold: each request's reservation, in entries, within the server's budget.

A request reserves the entries of its context and one round's slack when it starts, and more as its cache grows,
doubling as its buffer doubles (the reservation is its cache's buffer limit, so memory never exceeds the budget).
It may grow to its capacity (prompt, max_tokens and a round's slack): one whose capacity alone exceeds the budget
is refused (413). A request that cannot grow sits out its rounds until another finishes or is preempted. Entries
cost what their cache holds: a sliding-window layer's no more than its bounded buffer (`KVLayout.bytes`).

Where the forward runs through transformers' modules (not batch-invariant) a dropped cache could not be recomputed
exactly, so each request reserves its whole capacity up front there and never needs to grow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from swiftdecode.apps.server.protocol import ApiError
from swiftdecode.decoding.request import ROUND_SLACK, Request


class Reservations:
    """Request -> KV entries it may hold; changed by the worker thread under `lock`, read by the event loop. `cost`:
    the bytes of a cache of n entries (`KVLayout.bytes`: a sliding-window layer's are bounded)."""

    def __init__(self, budget_bytes: int, cost: Callable[[int], int], grows: bool, lock: threading.Condition):
        self.budget, self.cost, self.grows, self.lock = budget_bytes, cost, grows, lock
        self.entries: dict[Request, int] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def bytes(self) -> int:
        return sum(map(self.cost, self.entries.values()))

    def free(self) -> int:
        """Bytes no running request has reserved."""
        return self.budget - self.bytes

    def fits(self, entries: int) -> bool:
        """Whether a new reservation of `entries` fits in what is free."""
        return self.cost(entries) <= self.free()

    def first(self, req: Request) -> int:
        """The entries a starting request reserves (ApiError 413 if it could never finish within the budget)."""
        if (need := self.cost(req.capacity)) > self.budget:
            raise ApiError(
                413,
                f"prompt and max_tokens need {need / 2**30:.2f} GB of KV cache; this server allows "
                f"{self.budget / 2**30:.2f} GB (--max-kv-gb)",
            )
        return min(req.capacity, len(req.ctx) + ROUND_SLACK) if self.grows else req.capacity

    def take(self, req: Request, entries: int) -> None:
        with self.lock:
            self.entries[req] = entries
        req.cache.limit(entries)

    def drop(self, req: Request) -> None:
        with self.lock:
            self.entries.pop(req, None)

    def grow(self, reqs: list[Request]) -> set[Request]:
        """Reserve this round's entries (the context and a round's slack) for each of `reqs`, in their order,
        doubling a reservation where the budget has room; those it has no room for are returned (they sit out)."""
        starved = set()
        for req in reqs if self.grows else ():
            have, need = self.entries[req], min(req.capacity, len(req.ctx) + ROUND_SLACK)
            if need <= have:
                continue
            grown = min(req.capacity, max(need, 2 * have))
            room = self.free() + self.cost(have)  # what this request may hold: its own and what is free
            grown = grown if self.cost(grown) <= room else need  # no room to double: this round's entries
            if self.cost(grown) > room:
                starved.add(req)
                continue
            self.take(req, grown)
        return starved
