"""The suffix drafter: the longest match in the request's context or its tenant's pool of finished sequences; the
pool is bounded and never crosses tenants; drafting from it leaves every answer exactly plain decoding's."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
from conftest import batched_and_solo

from swiftdecode import Generator
from swiftdecode.drafters.pool import CopyPool
from swiftdecode.drafters.suffix import MAX_MATCH, MIN_MATCH, SuffixDrafter, longest_match

CODE = """def running_max(values):
    best = None
    out = []
    for v in values:
        if best is None or v > best:
            best = v
        out.append(best)
    return out
"""
EDIT = f"Here is a function:\n```python\n{CODE}```\nRename the variable `best` to `top`; reply with the function."


def brute_longest(hay: list[int], tail: list[int]) -> int:
    """The longest suffix of tail (at least MIN_MATCH) that occurs in hay, by trying every length."""
    best = 0
    for n in range(MIN_MATCH, len(tail) + 1):
        needle = tail[-n:]
        if any(hay[i : i + n] == needle for i in range(len(hay) - n + 1)):
            best = n
    return best


def test_longest_match_is_the_longest_latest_occurrence():
    rng = random.Random(0)
    for _ in range(200):
        hay = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        tail = [rng.randrange(4) for _ in range(rng.randrange(1, MAX_MATCH))]
        data = array("i", hay).tobytes()
        after, n = longest_match(data, array("i", tail).tobytes(), len(data))
        assert n == brute_longest(hay, tail)
        if n:
            assert hay[after - n : after] == tail[-n:]
            later = [i for i in range(after - n + 1, len(hay) - n + 1) if hay[i : i + n] == tail[-n:]]
            assert not later  # the latest occurrence


def test_pool_is_bounded_and_drops_the_oldest_first():
    pool = CopyPool(max_tokens=20)
    for k in range(6):
        pool.add([100 + k] * 5, salt=None)  # 6 tokens each with the separator
        assert pool.tokens <= 20 and pool.bytes == 4 * pool.tokens
    kept = array("i", pool.blob(None)).tolist()
    assert kept == [103] * 5 + [-1] + [104] * 5 + [-1] + [105] * 5 + [-1]
    assert pool.following(None, 5, 10) == []  # stops at a separator
    assert pool.following(None, 12, 3) == [105, 105, 105]
    off = CopyPool(max_tokens=0)
    off.add([1, 2, 3], salt=None)
    assert off.bytes == 0


def test_pool_keeps_tenants_apart():
    pool = CopyPool(max_tokens=100)
    pool.add([1, 2, 3, 4], salt="a")
    pool.add([5, 6, 7, 8], salt="b")
    assert array("i", pool.blob("a")).tolist() == [1, 2, 3, 4, -1]
    assert array("i", pool.blob("b")).tolist() == [5, 6, 7, 8, -1]
    assert pool.blob(None) == b""


@pytest.mark.parametrize("method", ["suffix", "swift"])
def test_copy_heavy_answers_equal_plain_decoding(smollm, method):
    gen, ar = Generator(*smollm, method=method), Generator(*smollm, method="ar")
    want = ar.generate(EDIT, chat=True, max_new_tokens=96)
    got = gen.generate(EDIT, chat=True, max_new_tokens=96)
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_by_source["suffix"] > 0  # the edited function is copied from the prompt
    sampled = dict(max_new_tokens=48, seed=11, temperature=0.7)
    assert gen.generate(EDIT, chat=True, **sampled).token_ids == ar.generate(EDIT, chat=True, **sampled).token_ids


def test_pool_drafts_only_for_its_own_tenant_and_stays_lossless(smollm, monkeypatch):
    gen, ar = Generator(*smollm, method="suffix"), Generator(*smollm, method="ar")
    pool = gen.proposer.drafters["suffix"].pool
    used = []
    real = CopyPool.following
    monkeypatch.setattr(CopyPool, "following", lambda self, salt, *a: used.append(salt) or real(self, salt, *a))
    prompt = "Write a haiku about autumn leaves."
    first = gen.generate(prompt, chat=True, max_new_tokens=40, cache_salt="a")
    assert pool.blob("a") and not pool.blob("b")
    other = gen.generate(prompt, chat=True, max_new_tokens=40, cache_salt="b")
    assert "a" not in used  # tenant b's request never copied tenant a's text
    again = gen.generate(prompt, chat=True, max_new_tokens=40, cache_salt="a")
    assert "a" in used and again.stats.accepted_by_source["suffix"] > 0  # its own tenant's answer is copied
    want = ar.generate(prompt, chat=True, max_new_tokens=40).token_ids
    assert first.token_ids == other.token_ids == again.token_ids == want


def test_batched_suffix_copies_equal_solo_answers(smollm):
    gen = Generator(*smollm, method="swift")
    mix = [(EDIT, {}), ("List three colours.", {}), (EDIT.replace("`top`", "`peak`"), dict(temperature=0.7, seed=2))]
    reqs, solo = batched_and_solo(gen, mix, 64)
    assert [r.new for r in reqs] == solo and sum(r.stats.batched_rounds for r in reqs) > 0
    assert sum(r.stats.accepted_by_source["suffix"] for r in reqs) > 0


def test_candidates_are_other_occurrences_continuations_longest_match_first():
    """Beside the longest, latest match's continuation, other earlier occurrences' distinct continuations are
    candidates (latest first, each keyed by its rank); a longer match in the tenant's pool leads."""
    drafter = SuffixDrafter(None, SimpleNamespace(copy_pool=100))
    ctx = [1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 9, 0, 1, 2, 3]
    req = SimpleNamespace(ctx=ctx, salt=None)
    assert drafter.continuations(req, 2) == [
        ([4, 6], ("own", 3, 0)),
        ([4, 5], ("own", 3, 1)),
        ([7, 8], ("own", 3, 2)),
    ]
    assert [c for c, _ in drafter.continuations(req, 1)] == [[4], [7]]  # a repeated continuation is one candidate
    drafter.pool.add([0, 1, 2, 3, 5, 5], salt=None)
    assert drafter.continuations(req, 2)[:2] == [([5, 5], ("pool", 4, 0)), ([4, 6], ("own", 3, 1))]
    drafter.pool.add([0, 1, 2, 3, 5, 5], salt="other")  # another tenant's text is never a candidate
    mine = SimpleNamespace(ctx=ctx, salt="mine", drafts={}, sampler=SimpleNamespace(constraint=None))
    copy = drafter.copy(mine, 2)
    assert [b.tokens for b in copy.branches] == [[4, 6], [4, 5], [7, 8]]
    assert copy.branches[0].accept(1) == 0.5 > copy.branches[1].accept(1)  # an alternative starts less trusted
