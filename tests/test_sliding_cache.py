"""Sliding-window layers' caches hold a bounded window: the keys beyond it are dropped (runtime/cache.py), and
every forward, answer and prefix reuse is the bits of a cache that keeps them all."""

from __future__ import annotations

import pytest
import torch

from swiftdecode import Generator
from swiftdecode.runtime.cache import WINDOW_SLACK, SwiftCache
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.prefix import PrefixStore
from swiftdecode.runtime.skip import SkipSet

GEMMAS = ["tiny-gemma3", "tiny-gemma2"]  # 16-token windows
ONE = torch.ones(1, 1, dtype=torch.bool)
TREE = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children


def _filled(windows: list[int | None], n: int) -> SwiftCache:
    """A cache of `windows` whose entry t holds keys t and values −t, appended one at a time."""
    cache = SwiftCache(windows)
    for t in range(n):
        k = torch.full((1, 1, 1, 2), float(t))
        for layer in cache.layers:
            layer.update(k, -k)
    return cache


def test_a_sliding_layer_drops_only_keys_beyond_window_and_slack():
    window, n = 4, 3 * (4 + WINDOW_SLACK)
    cache = _filled([None, window], n)
    full, sliding = cache.layers
    assert full.first == 0 and full.keys[0, 0, :, 0].tolist() == list(range(n))
    assert 0 < sliding.first <= n - window - WINDOW_SLACK and sliding.capacity <= 2 * (window + WINDOW_SLACK)
    assert sliding.keys[0, 0, :, 0].tolist() == list(range(sliding.first, n))
    cache.check_window(sliding.first + window - 1)  # the lowest row whose keys are all held
    with pytest.raises(RuntimeError, match="dropped"):
        cache.check_window(sliding.first + window - 2)
    cache.keep(n - 3, [0, 2])  # a tree's accepted path, within the held entries
    assert sliding.keys[0, 0, -2:, 0].tolist() == [n - 3, n - 1] and cache.length == n - 1
    with pytest.raises(ValueError, match="dropped"):
        cache.truncate(sliding.first - 1)


def test_a_sliding_layer_grown_by_one_long_append_shrinks_back_when_it_drops():
    window, n = 4, 5 * (4 + WINDOW_SLACK)
    cache = SwiftCache([None, window])
    t = torch.arange(n, dtype=torch.float32).view(1, 1, -1, 1)
    cache.extend([(0, t, -t), (0, t, -t)])  # a prompt read in one forward: every row's keys at once
    assert cache.layers[1].capacity >= n
    one = torch.full((1, 1, 1, 1), float(n))
    for layer in cache.layers:
        layer.update(one, -one)
    sliding = cache.layers[1]
    assert sliding.capacity == 2 * (window + WINDOW_SLACK) and sliding.keys[0, 0, :, 0].tolist() == list(
        range(sliding.first, n + 1)
    )


def test_entries_carry_their_first_and_the_store_serves_only_prefixes_the_window_reaches():
    window, n = 4, 3 * (4 + WINDOW_SLACK)
    cache = _filled([None, window], n)
    first = cache.layers[1].first
    store = PrefixStore(budget=1 << 30)
    store.save(list(range(n)), cache)
    restored = SwiftCache([None, window])
    assert store.restore(list(range(n)) + [5], restored) == n
    assert [la.first for la in restored.layers] == [0, first]
    assert torch.equal(restored.layers[1].keys, cache.layers[1].keys)
    assert store.restore(list(range(first + window - 2)) + [5], SwiftCache([None, window])) == 0  # needs dropped keys


def _steps(sm: SwiftModel, cache: SwiftCache, ids: list[int], observe) -> list[torch.Tensor]:
    """Prompt chunks, then rounds of a layer-skipped draft chain (rolled back) and a verified tree (its accepted
    path kept) until the context is 2.5 retained windows long; the hidden states of every forward."""
    outs = [sm.prefill(ids[i : i + 100], cache, observe) for i in range(0, 300, 100)]
    skip = SkipSet(attn=frozenset({1, 2}), mlp=frozenset({2}))  # sliding layers' attention skipped: lengths lag
    while cache.length < 5 * (16 + WINDOW_SLACK) // 2:
        n, chain = cache.length, torch.ones(3, 3, dtype=torch.bool).tril_()
        outs.append(sm.forward(ids[n : n + 3], torch.arange(n, n + 3), chain, cache, skip=skip, observe=observe))
        cache.truncate(n)
        positions = torch.tensor([n, n + 1, n + 1])
        outs.append(sm.forward(ids[n : n + 3], positions, TREE, cache, observe=observe))
        cache.keep(n, [0, 2])
    outs.append(sm.forward([ids[cache.length]], torch.tensor([cache.length]), ONE, cache, observe=observe))
    return outs


@pytest.mark.parametrize("tiny", GEMMAS, indirect=True)
def test_sliding_layers_hold_a_bounded_window_with_the_bits_of_a_full_cache(tiny):
    """Both loops: prompt chunks, drafts that skip sliding layers, trees; every forward's bits equal those on a
    cache that keeps every entry, and each sliding layer's buffer stays within 2 × (window + WINDOW_SLACK)."""
    name, _, _, (model, _) = tiny
    sm = SwiftModel(model)
    windows, ids = sm.kv_layout().windows, [(7 * i) % 400 + 3 for i in range(2000)]
    assert any(windows) and not all(windows), name  # sliding and global layers
    for observe in (None, lambda i, before, after: None):  # the native loop, the Python loop
        trimmed, full = SwiftCache(windows), SwiftCache(sm.n_layers)
        with torch.inference_mode():
            got, want = _steps(sm, trimmed, ids, observe), _steps(sm, full, ids, observe)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
        held = [(la.first, la.capacity) for la, w in zip(trimmed.layers, windows, strict=True) if w]
        assert all(first > 0 and cap <= 2 * (16 + WINDOW_SLACK) for first, cap in held), held


@pytest.mark.parametrize("tiny", GEMMAS, indirect=True)
def test_every_method_is_ar_past_the_window(tiny):
    """600 tokens (sliding layers drop keys from 2 × (16 + WINDOW_SLACK) on): swift, suffix and skip-only equal ar."""
    name, _, _, (model, tok) = tiny
    prompt = "one two three one two three one two"
    want = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=600).token_ids
    assert len(want) == 600
    for method in ("swift", "suffix", "skip-only"):
        assert Generator(model, tok, method=method).generate(prompt, max_new_tokens=600).token_ids == want, method


@pytest.mark.parametrize("tiny", GEMMAS, indirect=True)
def test_a_stored_prefix_whose_sliding_layers_dropped_keys_is_a_prefills_bits(tiny):
    name, _, _, (model, _) = tiny
    sm = SwiftModel(model)
    ids, more = list(range(3, 703)), [5, 6, 7]
    store, saved, warm, cold = PrefixStore(1 << 30), *(SwiftCache(sm.kv_layout().windows) for _ in range(3))
    with torch.inference_mode():
        for i in range(0, len(ids), 100):  # in chunks, as a server reads a prompt: the first ones are dropped
            sm.prefill(ids[i : i + 100], saved)
        store.save(ids, saved)
        assert max(la.first for la in saved.layers) > 0
        assert store.restore(ids + more, warm) == len(ids)
        got, want = sm.prefill(more, warm), sm.prefill(ids + more, cold)[len(ids) :]
    assert torch.equal(got, want), name


@pytest.mark.parametrize("tiny", ["tiny-gemma3"], indirect=True)
def test_the_servers_kv_budget_counts_a_sliding_layers_bounded_buffer(tiny):
    """A long request costs its global layers' entries and its sliding layers' bounded buffers: the server admits
    it within a budget that every layer holding every entry would exceed."""
    import threading
    from types import SimpleNamespace

    from swiftdecode.apps.server.reservations import Reservations
    from swiftdecode.decoding.request import ROUND_SLACK

    layout, n = SwiftModel(tiny[3][0]).kv_layout(), 100_000
    sliding = sum(w is not None for w in layout.windows)
    held = (len(layout.windows) - sliding) * n + sliding * 2 * (16 + WINDOW_SLACK)
    assert layout.bytes(n) == layout.entry_bytes * held and layout.sliding() == (sliding, 2 * (16 + WINDOW_SLACK))
    assert layout.bytes(100) == 100 * layout.bytes(1) == 100 * len(layout.windows) * layout.entry_bytes
    reserved = Reservations(layout.bytes(n), layout.bytes, True, threading.Condition())
    assert layout.bytes(1) * n > reserved.budget
    assert reserved.first(SimpleNamespace(capacity=n, ctx=[0] * 50)) == 50 + ROUND_SLACK


def test_gemma3_270m_past_its_window_is_ar_and_a_full_caches_argmax(gemma):
    """The registry's Gemma-3-270M (window 512) over ~1,650 tokens, so its sliding layers drop keys: swift equals
    ar, and ar's tokens are the argmax of a teacher-forced prefill on a cache that keeps every entry."""
    from pathlib import Path

    model, tok = gemma
    prompt = (Path(__file__).parents[1] / "README.md").read_text()[:5000]
    want = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=150)
    assert want.stats.prompt_tokens + 150 > 2 * (512 + WINDOW_SLACK)
    assert Generator(model, tok, method="swift").generate(prompt, max_new_tokens=150).token_ids == want.token_ids
    sm, ids = SwiftModel(model), tok(prompt)["input_ids"]
    assert len(ids) == want.stats.prompt_tokens
    full = ids + want.token_ids
    with torch.inference_mode():
        hidden = sm.prefill(full[:-1], SwiftCache(sm.n_layers))
        assert sm.logits(hidden[len(ids) - 1 :]).argmax(-1).tolist() == want.token_ids
