"""The suffix drafter: copies what followed the longest earlier match of the context's end, found in the request's
own context (prompt and answer so far) or in a bounded pool of the same tenant's recent sequences (`CopyPool`),
and as candidates beside it what followed other earlier occurrences (of that match, then of shorter ones); as the
n-gram drafter, it also copies the tokens a grammar forces, and learns each candidate's acceptance by depth.

Why beyond the n-gram drafter: a 2-3 token match says little about what follows (code repeats short n-grams
everywhere), while the longest match finds the text the model is reproducing (the function it edits, the source
it quotes, an earlier answer) and how far to trust it: acceptance is learned per match length, so the row-cost
planner verifies long copies where long matches keep being accepted and short ones elsewhere (SuffixDecoding,
Oliaro et al. 2025, scores its suffix tree's candidates by frequency; here the longest, latest match leads). Other
occurrences continue differently where the text varies (a record's fields, a renamed variable): the planner
verifies their tokens as further branches of the tree while their own learned odds pay for the rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from itertools import islice

from swiftdecode.decoding.request import Request
from swiftdecode.drafters.ngram import NgramDrafter, latest
from swiftdecode.drafters.pool import CopyPool
from swiftdecode.drafters.rowcost import PRIOR_P

MIN_MATCH = 2  # shorter matches predict too little (as the n-gram drafter's)
POOL_MIN_MATCH = 4  # in a pool of many sequences a shorter match is found by chance
MAX_MATCH = 32  # longest match looked for: beyond it a longer match predicts no better, and costs searches
# Acceptance tables by match length: a match of n tokens counts under the largest bound ≤ n.
BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
# Candidates beside the longest match's, and earlier occurrences looked at per match length. Replaying greedy
# Qwen2.5-Coder-1.5B answers, 4 candidates left 4-5% fewer rounds than one on code editing and summarization and
# 13% fewer on JSON records, row costs aside; with them (the planner keeps the branches that pay), decoding ran
# 1.031x (code editing) and 1.018x (JSON records) as fast as with one (A/B in one process, 10 prompts each).
ALTERNATIVES, OCCURRENCES = 3, 8
# An alternative's table starts at a quarter of the leading candidate's chance: with the same even chance, its
# first tokens went out on every new table's first rounds (up to 54: where x bucket x rank) and cost more rows
# than they saved (Qwen2.5-Coder-0.5B, JSON records: 17% more nodes for 9% fewer rounds; a quarter: 13% / 8%).
ALTERNATIVE_PRIOR = PRIOR_P / 4


class SuffixDrafter(NgramDrafter):
    """Copies from the longer of the request's own match and its tenant's pool match (the own one on a tie: it is
    the request's text), with other occurrences' continuations as further candidates; keys its acceptance tables
    by (where, match length bucket, candidate rank). Finished requests' sequences join the pool (`end`), under
    their salt."""

    kind = source = "suffix"

    def __init__(self, sm, cfg):
        super().__init__(sm, cfg)
        self.pool = CopyPool(cfg.copy_pool)

    def continuations(self, req: Request, length: int) -> list[tuple[list[int], object]]:
        """What followed earlier occurrences of the context's end, longest match first (the request's own on a
        tie: it is the request's text), latest first at each length; distinct, at most 1 + ALTERNATIVES. Keys:
        (where, match length bucket, rank)."""
        ctx = req.ctx
        if length <= 0 or len(ctx) <= MIN_MATCH:
            return []
        tail, hay, end = array("i", ctx[-MAX_MATCH:]).tobytes(), array("i", ctx).tobytes(), (len(ctx) - 1) * 4
        n = longest_match(hay, tail, end)[1]
        walks = [(m, "own", hay, end) for m in shorter(n)]
        if (pool := self.pool.blob(req.salt)) and (m := longest_match(pool, tail, len(pool))[1]) >= POOL_MIN_MATCH:
            walks.append((m, "pool", pool, len(pool)))
        found: list[tuple[list[int], object]] = []
        for m, where, blob, end in sorted(walks, key=lambda w: -w[0]):  # stable: own first on a tie
            for at in islice(occurrences(blob, tail[-4 * m :], end), OCCURRENCES):
                chain = ctx[at : at + length] if where == "own" else self.pool.following(req.salt, at, length)
                if chain and not any(c[: len(chain)] == chain for c, _ in found):
                    found.append((chain, (where, bucket(m), len(found))))
                if len(found) > ALTERNATIVES:
                    return found
        return found

    def prior(self, key: object) -> float:
        return ALTERNATIVE_PRIOR if isinstance(key, tuple) and key[-1] > 0 else super().prior(key)

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


def occurrences(hay: bytes, needle: bytes, end: int) -> Iterator[int]:
    """The token index just after each occurrence of `needle` (4-byte tokens) wholly in hay[:end], latest first."""
    while (at := latest(hay, needle, end)) >= 0:
        yield at + len(needle) // 4
        end = at * 4 + len(needle) - 1  # the next one starts before this one


def shorter(n: int) -> list[int]:
    """Match lengths to look for occurrences of: n, then the bucket bounds below it ([] for no match)."""
    return [n, *(b for b in reversed(BUCKETS) if b < n)] if n else []


def bucket(n: int) -> int:
    """The acceptance table's bound for a match of n tokens."""
    return max(b for b in BUCKETS if b <= n)
