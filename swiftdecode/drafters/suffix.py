"""The suffix drafter: copies what followed the longest earlier match of the context's end, found in the request's
own context (prompt and answer so far) or in a bounded pool of the same tenant's recent sequences (`CopyPool`);
as the n-gram drafter, it also copies the tokens a grammar forces, and learns each copy's acceptance by depth.

Why beyond the n-gram drafter: a 2-3 token match says little about what follows (code repeats short n-grams
everywhere), while the longest match finds the text the model is reproducing (the function it edits, the source
it quotes, an earlier answer) and how far to trust it: acceptance is learned per match length, so the row-cost
planner verifies long copies where long matches keep being accepted and short ones elsewhere (SuffixDecoding,
Oliaro et al. 2025, scores its suffix tree's candidates by frequency; here the longest, latest match leads).
"""

from __future__ import annotations

from array import array

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.ngram import NgramDrafter, latest
from swiftdecode.drafters.pool import CopyPool

MIN_MATCH = 2  # shorter matches predict too little (as the n-gram drafter's)
POOL_MIN_MATCH = 4  # in a pool of many sequences a shorter match is found by chance
MAX_MATCH = 32  # longest match looked for: beyond it a longer match predicts no better, and costs searches
# Acceptance tables by match length: a match of n tokens counts under the largest bound ≤ n.
BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)


class SuffixDrafter(NgramDrafter):
    """Copies from the longer of the request's own match and its tenant's pool match (the own one on a tie: it is
    the request's text); keys its acceptance tables by (where, match length bucket). Finished requests' sequences
    join the pool (`end`), under their salt."""

    kind = source = "suffix"

    def __init__(self, sm, cfg):
        super().__init__(sm, cfg)
        self.pool = CopyPool(cfg.copy_pool)

    def continuation(self, req: Request, length: int) -> tuple[list[int], object]:
        ctx = req.ctx
        if length <= 0 or len(ctx) <= MIN_MATCH:
            return [], 0
        data = array("i", ctx[-MAX_MATCH:]).tobytes()
        own, n = longest_match(array("i", ctx).tobytes(), data, (len(ctx) - 1) * 4)
        blob = self.pool.blob(req.salt)
        pooled, m = longest_match(blob, data, len(blob))
        if m >= POOL_MIN_MATCH and m > n:
            return self.pool.following(req.salt, pooled, length), ("pool", bucket(m))
        if n:
            return ctx[own : own + length], ("own", bucket(n))
        return [], 0

    def end(self, req: Request) -> None:
        self.pool.add(req.ctx, req.salt)

    def kept_bytes(self) -> int:
        return self.pool.bytes


def longest_match(hay: bytes, tail: bytes, end: int) -> tuple[int, int]:
    """The longest suffix of `tail` (4-byte tokens, MIN_MATCH..len) occurring in hay[:end], by binary search (a
    suffix that occurs has all its shorter suffixes occurring): (the token index just after its latest occurrence,
    its length in tokens); (0, 0) if none."""
    hi = len(tail) // 4
    if hi < MIN_MATCH or (at := latest(hay, tail[-4 * MIN_MATCH :], end)) < 0:
        return 0, 0
    lo = MIN_MATCH
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (found := latest(hay, tail[-4 * mid :], end)) >= 0:
            lo, at = mid, found
        else:
            hi = mid - 1
    return at + lo, lo


def bucket(n: int) -> int:
    """The acceptance table's bound for a match of n tokens."""
    return max(b for b in BUCKETS if b <= n)
