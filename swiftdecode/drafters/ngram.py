"""The n-gram drafter: copies what followed the latest earlier occurrence of the context's last 2-3 tokens, or the
tokens a grammar forces next; learns each copy's acceptance by depth, per n-gram order, from every copy it
proposed, verified or not (a copy is scored against the tokens actually generated)."""

from __future__ import annotations

from array import array

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.base import Branch, Copy, Drafter
from swiftdecode.drafters.rowcost import PRIOR_P, DepthAcceptance

FORCED = 99  # the acceptance table's key for the tokens a grammar forces (a tool call's frame), beside n-gram orders


class NgramDrafter(Drafter):
    """Copies from the request's own context. Acceptance tables (by n-gram order: a continuation's key) are learned
    across requests; a request's copies not yet scored wait in `req.drafts[source]` as (start, tokens, key). A
    subclass copies from elsewhere by overriding `continuation`."""

    kind = source = "ngram"
    copies = True

    def __init__(self, sm, cfg):
        super().__init__(sm, cfg)
        self.acceptance: dict[int, DepthAcceptance] = {}

    def copy(self, req: Request, length: int) -> Copy | None:
        """Score the request's pending copies its context now decides; then the tokens its grammar forces, else its
        continuations, at most `length` tokens each (None without either)."""
        ctx, constraint, pending = req.ctx, req.sampler.constraint, req.drafts.setdefault(self.source, [])
        self.resolve(ctx, pending)
        forced = constraint.forced(length) if constraint is not None else []
        found = [(forced, FORCED)] if forced else self.continuations(req, length)
        for copied, key in found:
            pending.append((len(ctx), copied, key))
            if key not in self.acceptance:
                self.acceptance[key] = DepthAcceptance(self.prior(key))
        return Copy([Branch(copied, self.acceptance[key].accept) for copied, key in found]) if found else None

    def prior(self, key: object) -> float:
        """A new acceptance table's chance for the first copied token (tokens a grammar forces are the only ones
        it allows: sure from the start)."""
        return 1.0 if key == FORCED else PRIOR_P

    def continuations(self, req: Request, length: int) -> list[tuple[list[int], object]]:
        """Chains of at most `length` tokens to copy after req.ctx, best first, each with the key of its acceptance
        table (none: [])."""
        copied, n = ngram_continuation(req.ctx, length)
        return [(copied, n)] if copied else []

    def resolve(self, ctx: list[int], pending: list) -> None:
        """Record each pending copy whose fate ctx tells (a mismatch, or all its tokens generated); keep the rest."""
        undecided = []
        for start, copied, key in pending:
            known = ctx[start : start + len(copied)]
            k = next((i for i, (a, b) in enumerate(zip(known, copied, strict=False)) if a != b), len(known))
            if k < len(known) or len(known) == len(copied):
                self.acceptance[key].record(len(copied), k)
            else:
                undecided.append((start, copied, key))
        pending[:] = undecided


def ngram_continuation(ctx: list[int], length: int, n_max: int = 3, n_min: int = 2) -> tuple[list[int], int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix n-gram of ctx
    (n_max ≥ n ≥ n_min), and that n; ([], 0) if none. ctx ends with the tree's root.

    Runs every round: the context is searched as 4-byte tokens with `bytes.rfind` (C speed: ~27 µs at 2000
    tokens, most of it packing them, where a numpy window scan took ~125 µs), keeping hits on token boundaries."""
    if length <= 0 or len(ctx) <= n_min:
        return [], 0
    data = array("i", ctx).tobytes()
    for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
        if (at := latest(data, data[-4 * n :], len(data) - 4)) >= 0:  # ending before the last token
            return ctx[at + n : at + n + length], n
    return [], 0


def latest(hay: bytes, needle: bytes, end: int) -> int:
    """The token index (4-byte tokens) of the latest occurrence of `needle` that lies wholly in hay[:end] and starts
    on a token boundary; -1 if none."""
    while (at := hay.rfind(needle, 0, end)) >= 0 and at % 4:
        end = at + len(needle) - 1  # a hit across token boundaries: look further back
    return at // 4 if at >= 0 else -1
