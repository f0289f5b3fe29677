"""Prompt prefix reuse: copied cache entries are the bits a prefill writes, so every answer is what it is without
the store; the store stays within its budget and keeps one entry per distinct beginning."""

from __future__ import annotations

import pytest
import torch

from swiftdecode import Generator
from swiftdecode.engine.batch import Batch
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.prefix import PrefixStore


def filled(tokens: list[int], layers: int = 2) -> SwiftCache:
    """A cache whose entry i holds keys/values that are a function of tokens[i] (stands for a prefill), in
    buffers of exactly len(tokens) entries (a store counts whole buffers)."""
    cache = SwiftCache(layers, limit=len(tokens))
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 2, -1, 4)
    cache.extend([(0, t + i, -t) for i in range(layers)])
    return cache


def test_store_matches_longest_prefix_and_keeps_its_budget():
    per_token = 2 * 2 * 2 * 4 * 4  # layers x (k, v) x heads x dim x fp32 bytes
    store = PrefixStore(budget=30 * per_token)
    store.save([1, 2, 3, 4, 5], filled([1, 2, 3, 4, 5]))
    store.save([1, 2, 3, 4, 5, 6, 7], filled([1, 2, 3, 4, 5, 6, 7]))  # subsumes the first
    store.save([1, 2, 3], filled([1, 2, 3]))  # already covered
    store.save([9, 9, 9, 9], filled([9, 9, 9, 9]))
    assert len(store) == 2 and store.bytes == 11 * per_token
    cache = SwiftCache(2)
    assert store.restore([1, 2, 3, 4, 8, 8], cache) == 4 and cache.length == 4
    assert torch.equal(cache.layers[1].keys, filled([1, 2, 3, 4]).layers[1].keys)
    assert store.restore([1, 2, 3, 4, 5, 6, 7], SwiftCache(2)) == 6  # the last prompt token is always computed
    assert store.restore([5, 1, 2], SwiftCache(2)) == 0
    store.save(list(range(20, 40)), filled(list(range(20, 40))))  # over budget: the least recently used goes
    assert store.bytes <= store.budget and store.restore([9, 9, 9, 9, 1], SwiftCache(2)) == 0
    assert store.restore([1, 2, 3, 1], SwiftCache(2)) == 3
    store.save(list(range(100, 140)), filled(list(range(100, 140))))  # alone larger than the budget: not kept
    assert store.bytes <= store.budget and store.restore(list(range(100, 140)), SwiftCache(2)) == 0


def test_reused_entries_are_the_bits_a_prefill_writes(smollm):
    """Prefill of A+B from scratch, and of B after A's entries copied from a cache that computed A then more,
    write the same keys and values in every layer and give the same logits."""
    sm = SwiftModel(smollm[0])
    a, b, other = list(range(300, 340)), list(range(500, 523)), [7, 8, 9, 10, 11]
    cold, first, warm_cache = (SwiftCache(sm.n_layers) for _ in range(3))
    whole = sm.logits(sm.prefill(a + b, cold)[-1:])
    sm.prefill(a, first)
    sm.prefill(other, first)  # A was computed in a forward of its own, then something else followed it
    store = PrefixStore(2**30)
    store.save(a + other, first)
    assert store.restore(a + b, warm_cache) == len(a)
    warm = sm.logits(sm.prefill(b, warm_cache)[-1:])
    assert torch.equal(whole, warm)
    for x, y in zip(cold.layers, warm_cache.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


CHAT = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."}]
TURNS = ["What is a prime number?", "Give an example of one.", "And one that is even?"]


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, top_p=0.9, seed=4)])
def test_chat_turns_reuse_earlier_turns_and_answer_the_same(smollm, params):
    warm = Generator(*smollm, method="swift", prefix_cache_gb=0.25)
    cold = Generator(*smollm, method="swift")
    history, cached = list(CHAT), []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        got = warm.generate(warm.chat_ids(history), max_new_tokens=40, **params)
        want = cold.generate(cold.chat_ids(history), max_new_tokens=40, **params)
        assert got.token_ids == want.token_ids
        cached.append(got.stats.cached_prompt_tokens)
        history.append({"role": "assistant", "content": got.text})
    assert cached[0] == 0 and all(n > 20 for n in cached[1:])  # the system prompt and earlier turns
    assert warm.memory()["prefix_cache"] > 0 and cold.memory()["prefix_cache"] == 0


def test_batched_joiners_reuse_a_shared_prompt(smollm):
    """Requests joining a batch copy the shared system prompt and still give their solo answers."""
    gen = Generator(*smollm, method="swift", prefix_cache_gb=0.25)
    prompts = [gen.chat_ids(CHAT + [{"role": "user", "content": t}]) for t in TURNS]
    solo = [Generator(*smollm, method="swift").generate(p, max_new_tokens=24).token_ids for p in prompts]
    gen.generate(prompts[0], max_new_tokens=24)  # stores the system prompt (and that answer)
    batch, reqs = Batch(gen), [gen.request(p, max_new_tokens=24) for p in prompts]
    for r in reqs:
        batch.add(r)
    while len(batch):
        batch.step()
    assert [r.new for r in reqs] == solo
    assert all(r.stats.cached_prompt_tokens > 10 for r in reqs)


def test_prefix_cache_is_off_where_reuse_would_not_be_exact(smollm_torch):
    """On torch's path the layers run through transformers' modules (not batch-invariant): no prefixes kept."""
    assert Generator(*smollm_torch, method="ar", prefix_cache_gb=1.0).memory()["prefix_budget"] == 0
