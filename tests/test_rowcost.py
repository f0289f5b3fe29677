"""Which copied tokens a round verifies (rowcost): the cost line fitted from forwards, acceptance by depth scored
against what was generated, and the rule that adds a copied token (a node of the candidates' tree) only while it
raises tokens per second."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swiftdecode.drafters.base import Branch
from swiftdecode.drafters.ngram import FORCED, NgramDrafter, ngram_continuation
from swiftdecode.drafters.rowcost import CostLine, DepthAcceptance, nodes_that_pay


def fitted(a: float, b: float, rows=(1, 2, 4, 8, 12, 16)) -> CostLine:
    line = CostLine()
    for _ in range(5):
        for r in rows:
            line.record(r, a + b * r)
    return line


def profile(accepted: int, proposed: int, times: int = 300) -> DepthAcceptance:
    acc = DepthAcceptance()
    for _ in range(times):
        acc.record(proposed, accepted)
    return acc


def tokens_that_pay(line: CostLine, accept, rows: int, cap: int) -> int:
    """How many tokens of one candidate chain (as long as cap) the planner verifies."""
    chains = nodes_that_pay(line, [Branch(list(range(100, 100 + cap)), accept)], rows, cap)
    assert len(chains) <= 1
    return len(chains[0]) if chains else 0


def test_line_recovers_the_cost_of_a_row():
    a, b = fitted(0.010, 0.0012).line()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0012)


def test_no_slope_until_rows_vary():
    line = CostLine()
    for _ in range(10):
        line.record(8, 0.02)
    assert line.line() is None
    assert tokens_that_pay(line, DepthAcceptance().accept, 8, cap=3) == 3  # copy, so that rows vary and the slope shows


def test_acceptance_by_depth():
    acc = profile(accepted=1, proposed=3)
    assert acc.accept(1) > 0.95 and acc.accept(2) < 0.05 and acc.accept(3) < 0.05
    assert acc.accept(5) == pytest.approx(0.5**5)  # never proposed: the prior, halving with each depth


def test_copied_tokens_pay_while_they_raise_tokens_per_second():
    cheap, steep = fitted(0.010, 0.0005), fitted(0.010, 0.0022)  # a row costs 5% / 22% of the weights' pass
    sure = profile(accepted=2, proposed=4)  # depths 1-2 always accepted, 3-4 never
    # alone: the accepted depths pay, the rejected ones do not
    assert tokens_that_pay(cheap, sure.accept, 1, cap=15) == 2
    assert tokens_that_pay(steep, sure.accept, 1, cap=15) == 2
    # 8 requests: a forward already yields 8 tokens in 0.0276 s; a row costs 0.0022 s, so a copied token must be
    # accepted with chance > 0.64 to raise tokens per second
    assert tokens_that_pay(steep, sure.accept, 8, cap=1) == 1
    coin = profile(accepted=1, proposed=1, times=0)
    for _ in range(300):
        coin.record(1, 0)
        coin.record(1, 1)
    assert 0.4 < coin.accept(1) < 0.6
    assert tokens_that_pay(steep, coin.accept, 8, cap=1) == 0
    assert tokens_that_pay(cheap, coin.accept, 8, cap=1) == 1  # a cheap row still pays at that chance


def test_a_candidate_beside_the_best_joins_the_tree_where_its_odds_pay():
    """Nodes join by their chance of being generated: an alternative's tokens are verified once their odds beat
    the rows they cost, beginnings shared with the best candidate count once, and `cap` bounds the nodes."""
    steep = fitted(0.010, 0.0022)
    best = profile(accepted=2, proposed=4)  # its first 2 tokens always generated, then never
    likely, unlikely = profile(accepted=3, proposed=3), profile(accepted=0, proposed=3)
    main, other = Branch([1, 2, 3, 4], best.accept), [5, 6, 7]
    assert nodes_that_pay(steep, [main, Branch(other, likely.accept)], 1, cap=16) == [[1, 2], other]
    assert nodes_that_pay(steep, [main, Branch(other, unlikely.accept)], 1, cap=16) == [[1, 2]]
    assert nodes_that_pay(steep, [main, Branch(other, likely.accept)], 1, cap=3) == [[1, 2], [5]]
    shared = Branch([1, 2, 8], likely.accept)  # shares the best's first two tokens: one more node, not three
    assert nodes_that_pay(steep, [main, shared], 1, cap=3) == [[1, 2], [1, 2, 8]]
    # an alternative's deeper node is worth no more than its parent, so the tree stays connected
    rising = Branch([5, 6], lambda d: 0.01 if d == 1 else 0.99)
    assert nodes_that_pay(steep, [main, rising], 1, cap=16) == [[1, 2]]


def request(ctx: list[int], constraint=None) -> SimpleNamespace:
    """What the n-gram drafter reads of a Request."""
    return SimpleNamespace(ctx=ctx, drafts={}, sampler=SimpleNamespace(constraint=constraint))


def test_copies_are_scored_against_what_was_generated():
    """A copy is scored once its fate is known (a mismatch, or every token generated), verified or not."""
    drafter = NgramDrafter(None, None)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # ends with the 3-gram 1 2 3: the copy is 4 5 9 1 ...
    req = request(ctx)
    copy = drafter.copy(req, 3)
    pending = req.drafts["ngram"]
    assert copy.tokens == [4, 5, 9] and pending == [(9, [4, 5, 9], 3)]
    drafter.resolve(ctx + [4], pending)  # one token generated, as copied: not yet decided
    assert pending == [(9, [4, 5, 9], 3)]
    drafter.resolve(ctx + [4, 7], pending)  # the second one differs: scored as 1 accepted of 3
    assert pending == []
    acc = drafter.acceptance[3]
    assert acc.accept(1) > 0.5 > acc.accept(2) >= acc.accept(3)
    assert copy.branches[0].accept(1) == acc.accept(1)  # the proposal's odds are the table's
    assert drafter.copy(request([1, 2, 3, 4]), 3) is None  # no repeat: no copy


def test_tokens_a_grammar_forces_come_before_an_ngram_copy():
    """With a grammar that forces tokens (a tool call's frame), they are the branch, scored under FORCED."""
    forced = SimpleNamespace(forced=lambda limit: [7, 8, 9, 6][:limit])
    req = request([1, 2, 3, 4, 5, 9, 1, 2, 3], forced)
    drafter = NgramDrafter(None, None)
    assert drafter.copy(req, 3).tokens == [7, 8, 9] and req.drafts["ngram"] == [(9, [7, 8, 9], FORCED)]
    drafter.resolve(req.ctx + [7, 8, 9], req.drafts["ngram"])
    assert drafter.acceptance[FORCED].accept(3) > 0.5 and 3 not in drafter.acceptance


def test_ngram_continuation_matches_a_plain_scan():
    """The byte search finds what scanning every earlier window finds (latest occurrence of the longest suffix
    n-gram, token-aligned), on contexts whose 4-byte tokens share bytes (small and huge ids)."""
    import random

    def scan(ctx, length, n_max=3, n_min=2):
        for n in range(min(n_max, len(ctx) - 1), n_min - 1, -1):
            hits = [i for i in range(len(ctx) - n) if ctx[i : i + n] == ctx[-n:]]
            if hits and length > 0 and len(ctx) > n_min:
                return ctx[hits[-1] + n : hits[-1] + n + length], n
        return [], 0

    rng = random.Random(1)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 256, 257, 70000, 2**31 - 1])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        length = rng.randint(0, 9)
        assert ngram_continuation(ctx, length) == scan(ctx, length), (ctx, length)
