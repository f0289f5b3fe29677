"""The n-gram drafter: copies what followed the latest earlier occurrence of the context's last 2-3 tokens, or the
tokens a grammar forces next; learns each copy's acceptance by depth, per n-gram order, from every copy it
proposed, verified or not (a copy is scored against the tokens actually generated)."""

from __future__ import annotations

from array import array

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.base import Copy, Drafter
from swiftdecode.drafters.rowcost import DepthAcceptance

FORCED = 99  # the acceptance table's key for the tokens a grammar forces (a tool call's frame), beside n-gram orders


class NgramDrafter(Drafter):
    """Copies from the request's own context. Acceptance tables (by n-gram order) are learned across requests; a
    request's copies not yet scored wait in `req.drafts["ngram"]` as (start, tokens, order)."""

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
        copied, order = (forced, FORCED) if forced else ngram_continuation(ctx, length)
        if not order:
            return None
        pending.append((len(ctx), copied, order))
        return Copy(copied, self.acceptance.setdefault(order, DepthAcceptance()).accept)

    def resolve(self, ctx: list[int], pending: list) -> None:
        """Record each pending copy whose fate ctx tells (a mismatch, or all its tokens generated); keep the rest."""
        undecided = []
        for start, copied, order in pending:
            known = ctx[start : start + len(copied)]
            k = next((i for i, (a, b) in enumerate(zip(known, copied, strict=False)) if a != b), len(known))
            if k < len(known) or len(known) == len(copied):
                self.acceptance[order].record(len(copied), k)
            else:
                undecided.append((start, copied, order))
        pending[:] = undecided


def ngram_continuation(ctx: list[int], length: int, n_max: int = 3, n_min: int = 2) -> tuple[list[int], int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix n-gram of ctx
    (n_max ≥ n ≥ n_min), and that n; ([], 0) if none. ctx ends with the tree's root.

    Runs every round: the context is searched as 4-byte tokens with `bytes.rfind` (C speed: ~27 µs at 2000
    tokens, most of it packing them, where a numpy window scan took ~125 µs), keeping hits on token boundaries."""
    if length <= 0 or len(ctx) <= n_min:
        return [], 0
    data = array("i", ctx).tobytes()
    hay = len(data) - 4  # occurrences end before the last token (so a token follows them)
    for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
        needle, end = data[-4 * n :], hay
        while (at := data.rfind(needle, 0, end)) >= 0 and at % 4:
            end = at + 4 * n - 1  # a hit across token boundaries: look further back
        if at >= 0:
            start = at // 4 + n
            return ctx[start : start + length], n
    return [], 0
