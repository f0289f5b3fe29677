"""The n-gram drafter: copies what followed the latest earlier occurrence of the context's last 2-3 tokens, or the
tokens a grammar forces next; learns each copy's acceptance by depth, per n-gram order, from every copy it
proposed, verified or not (a copy is scored against the tokens actually generated)."""

from __future__ import annotations

from array import array

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.base import Copy, Drafter
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
        n-gram continuation, at most `length` tokens (None without either)."""
        ctx, constraint, pending = req.ctx, req.sampler.constraint, req.drafts.setdefault(self.source, [])
        self.resolve(ctx, pending)
        forced = constraint.forced(length) if constraint is not None else []
        copied, key = (forced, FORCED) if forced else self.continuation(req, length)
        if not key:
            return None
        pending.append((len(ctx), copied, key))
        if key not in self.acceptance:  # tokens a grammar forces are the only ones it allows: sure from the start
            self.acceptance[key] = DepthAcceptance(1.0 if key == FORCED else PRIOR_P)
        return Copy(copied, self.acceptance[key].accept)

    def continuation(self, req: Request, length: int) -> tuple[list[int], object]:
        """At most `length` tokens to copy after req.ctx and the key of their acceptance table (([], 0): none)."""
        return ngram_continuation(req.ctx, length)

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
