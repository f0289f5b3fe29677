"""Unit tests of the engine's parts: trees, masks, cache rollback, sampling law, matchness, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from swiftdecode import Generator, UserError
from swiftdecode.decoding.sampling import Sampler, SamplingParams, argmax, kept, probabilities
from swiftdecode.decoding.verification import verify
from swiftdecode.drafters.layer_skip.draft import DraftConfig
from swiftdecode.drafters.layer_skip.search import DraftCost, LayerSearch, SearchConfig, expected_speedup
from swiftdecode.drafters.layer_skip.tuner import matchness
from swiftdecode.engine.generator import EngineConfig
from swiftdecode.runtime import fastpath
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.skip import SkipSet
from swiftdecode.runtime.tree import Tree, attention_mask


def small_tree() -> Tree:
    """root → a(5) → d(7); root → b(6); a → e(8)."""
    t = Tree(root=1)
    a = t.add(5, -1, "skip")
    t.add(6, -1, "skip")
    t.add(7, a, "skip")
    t.add(8, a, "skip")
    assert t.add(5, -1, "ngram") == a  # duplicate child: not added again, marked proposed by both
    return t


def test_tree_structure_positions_and_ancestry():
    t = small_tree()
    assert t.tokens == [5, 6, 7, 8] and t.parents == [-1, -1, 0, 0] and t.depths == [1, 1, 2, 2]
    assert t.sources == ["both", "skip", "skip", "skip"]
    assert t.input_ids() == [1, 5, 6, 7, 8]
    assert t.positions(10).tolist() == [10, 11, 11, 12, 12]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(t.ancestry(), expected)


def test_attention_mask_prefix_visibility_tree_and_window():
    t = small_tree()
    m = attention_mask(t.positions(4), 4, 4, t.ancestry(), torch.float32)
    allowed = m[0, 0] == 0
    assert m.shape == (1, 1, 5, 9)
    assert allowed[:, :4].all()  # the whole cached prefix
    assert torch.equal(allowed[:, 4:], t.ancestry())
    per_query = attention_mask(torch.arange(2, 4), 4, torch.arange(2, 4), torch.eye(2, dtype=torch.bool), torch.float32)
    assert (per_query[0, 0] == 0).tolist() == [
        [True, True, False, False, True, False],
        [True] * 3 + [False, False, True],
    ]
    win = attention_mask(torch.tensor([4]), 4, 4, torch.ones(1, 1, dtype=torch.bool), torch.float32, window=2)
    assert (win[0, 0, 0] == 0).tolist() == [False, False, False, True, True]


def test_cache_truncate_and_keep():
    cache = SwiftCache(2)
    k = torch.arange(10.0).reshape(1, 1, 10, 1)
    cache.update(k[:, :, :6], -k[:, :, :6], 0)
    cache.update(k[:, :, :4], -k[:, :, :4], 1)  # layer 1 lags (its attention was skipped)
    assert cache.length == 6 and cache.layers[1].get_seq_length() == 4
    cache.truncate(3)
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2] and cache.layers[1].get_seq_length() == 3
    cache.update(k[:, :, 3:10], -k[:, :, 3:10], 0)  # a 7-node tree after position 3
    cache.keep(3, [0, 2, 5])
    assert cache.layers[0].keys.flatten().tolist() == [0, 1, 2, 3, 5, 8]
    assert cache.layers[0].values.flatten().tolist() == [0, -1, -2, -3, -5, -8]
    big = torch.zeros(1, 1, 600, 1)
    cache.update(big, big, 0)  # grows past the initial capacity
    assert cache.length == 606 and cache.layers[0].keys[0, 0, 4, 0] == 5


def test_verify_follows_the_chosen_tokens():
    t = small_tree()
    logits = torch.full((5, 10), -5.0)
    logits[0, 5] = logits[1, 8] = logits[4, 3] = 5.0  # root→5, a→8, e→3 (bonus)
    greedy = Sampler(SamplingParams(), 0)
    assert verify(t, logits, greedy, 0) == ([0, 3], 3)
    logits[0, 5], logits[0, 9] = -5.0, 5.0
    assert verify(t, logits, greedy, 0) == ([], 9)


def test_exponential_race_sampler_draws_the_processed_distribution():
    """20k draws of one position per seed against the exact probabilities (chi-square), with top-k/top-p."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=5)
    p = probabilities(logits, params)
    assert p[5] == 0  # top-k cut
    assert p[4] == 0 or float(p[:4].sum()) < 0.95  # top-p cut keeps the smallest set reaching 0.95
    draws = [Sampler(params, seed).pick(logits, 0) for seed in range(20_000)]
    counts = np.bincount(draws, minlength=6)
    p = p.double().numpy()
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], 20_000 * p[support] / p[support].sum()).pvalue > 1e-3


def test_top_p_set_is_a_full_sorts_bit_for_bit():
    """The top-p set found among the tokens above its margin (or by sorting all, with top_p within float error of
    1) gives the probabilities a full sort gives, and `kept` lists exactly their nonzero entries."""

    def by_sort(logits, params):
        probs = torch.softmax(logits / params.temperature, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return probs / probs.sum(-1, keepdim=True)

    g = torch.Generator().manual_seed(1)
    for vocab, scale in ((40, 1.0), (49152, 0.3), (49152, 4.0), (151936, 1.0), (151936, 8.0)):
        logits = torch.randn(vocab, generator=g) * scale  # 0.3: a flat distribution, the set spans thousands
        for top_p in (0.5, 0.9, 0.999, 1 - 1e-9):
            params = SamplingParams(temperature=0.7, top_p=top_p)
            want = by_sort(logits, params)
            assert torch.equal(probabilities(logits, params), want), (vocab, scale, top_p)
            ids, p = kept(logits, params)
            assert torch.equal(ids, torch.nonzero(want).flatten()) and torch.equal(p, want[ids])


def test_a_pick_over_the_kept_tokens_is_the_whole_vocabulary_race():
    """With top-p/top-k, a pick draws noise only for the kept tokens: the same token as the race over every id,
    whose noise for any ids is the whole vector's entries."""
    g = torch.Generator().manual_seed(2)
    for seed in range(200):
        logits = torch.randn(5000, generator=g) * 4
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=[0, 50][seed % 2])
        s = Sampler(params, seed)
        whole = s.noise_at(seed, 5000)
        ids = torch.tensor([4999, 3, 0, 1234])
        assert torch.equal(s.noise_of(seed, ids), whole[ids])
        assert s.pick(logits, seed) == argmax(probabilities(logits, params) / whole)


def test_argmax_is_torchs_on_ties_nan_and_infinities():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 151936, generator=g)
    rows[1, [5, 90000, 7]] = rows[1].max() + 1  # ties: the first wins
    rows[2, [70000, 3]] = float("nan")  # NaN counts as largest
    rows[3] = float("-inf")
    rows[4, 100] = float("inf")
    rows[5, :10] = 0.0
    for row in [*rows, rows[5, :10], rows[0].double()]:
        assert argmax(row) == int(row.argmax())


def test_sampler_noise_is_fixed_per_position():
    params = SamplingParams(temperature=1.0)
    a, b = Sampler(params, 3), Sampler(params, 3)
    logits = torch.randn(50)
    b.pick(logits, 2)  # b draws positions 0..2 first
    assert [a.pick(logits, i) for i in range(4)] == [b.pick(logits, i) for i in range(4)]


def test_skipset_vector_roundtrip_and_uniform():
    s = SkipSet(frozenset({1, 4}), frozenset({2}), sparsity=3)
    assert SkipSet.from_vector(s.to_vector(6)) == s
    u = SkipSet.uniform(30, 0.5)
    assert len(u.attn) == 14 and 0 not in u.attn and 29 not in u.attn


def test_draft_cost_counts_skipped_sublayers_and_sparsity():
    cost = DraftCost(0.1, np.full(3, 0.05), np.full(3, 0.2), 0.1, read=(1.0, 0.5))
    assert math.isclose(cost(SkipSet()), 0.1 + 0.15 + 0.7)
    assert math.isclose(cost(SkipSet(frozenset({1}), frozenset({2, 3}))), 0.1 + 0.1 + 0.3)
    assert math.isclose(cost(SkipSet(mlp=frozenset({2, 3}), sparsity=1)), 0.1 + 0.15 + 0.15)


def test_search_moves_to_better_sets_and_stops():
    cost = DraftCost(1 / 17, np.full(8, 1 / 17), np.full(8, 1 / 17), 0.0, read=(1.0, 0.8, 0.6))
    search = LayerSearch(10, cost, SearchConfig(beta=5, patience=15, max_evals=300), SkipSet())
    good = {1, 2, 3}
    alpha_of = lambda c: max(0.95 - 0.1 * len(c.attn ^ good) - 0.1 * len(c.mlp) - 0.1 * (c.sparsity == 2), 0.0)
    for _ in range(300):
        if not search.searching:
            break
        cand = search.propose()
        alpha = alpha_of(cand)
        search.record(cand, alpha, alpha_of(search.best) if search.challenges(cand, alpha) else None)
    assert not search.searching
    assert search.best.attn == good and not search.best.mlp
    assert search.best.sparsity == 1  # cheaper than dense at the same matchness; level 2 costs matchness
    assert expected_speedup(0.9, 0.3, 1.1, 8) > expected_speedup(0.5, 0.3, 1.1, 8) > 0


def test_a_lucky_window_does_not_win_the_search():
    """A candidate scored high on an easy window replaces the best set only if it beats it on that window."""
    cost = DraftCost(0.1, np.full(8, 0.05), np.full(8, 0.05), 0.0)
    incumbent, challenger = SkipSet(frozenset({1})), SkipSet(frozenset({2}))
    search = LayerSearch(10, cost, SearchConfig(), incumbent)
    search.record(incumbent, 0.80)  # its score on an ordinary window
    assert search.challenges(challenger, 0.90)  # an easy window: everything matches more there
    search.record(challenger, 0.90, incumbent=0.95)  # ... the best set too, and more
    assert search.best == incumbent
    assert search.challenges(challenger, 0.99)
    search.record(challenger, 0.99, incumbent=0.95)
    assert search.best == challenger
    restarted = LayerSearch(10, cost, SearchConfig(), incumbent)  # no score yet (a restart): still compared
    restarted.record(challenger, 0.5, incumbent=0.7)
    assert restarted.best == incumbent


@pytest.mark.parametrize("sparsity", [0, 3])
def test_matchness_one_forward_equals_step_by_step_drafting(smollm, smollm_fp32, sparsity):
    """The window forward's per-position draft predictions equal fresh one-token skip-model drafts (dense and
    activation-sparse drafts: a row's sparse product does not depend on the other rows; sparse drafts run on
    float32 weights, the quantized path drafts dense)."""
    model, tok = smollm_fp32 if sparsity else smollm
    gen = Generator(model, tok, method="swift")
    ids = gen.chat_ids([{"role": "user", "content": "List three facts about the Moon."}])
    res = gen.generate(ids, max_new_tokens=12)  # calibrates the sparsity thresholds on this prompt
    ctx = ids + res.token_ids
    uniform = SkipSet.uniform(gen.sm.n_layers, 0.3)
    if sparsity:
        assert fastpath.sparse_capable(model)
        assert all(m.thresholds is not None for m in model.modules() if getattr(m, "role", ""))
    sm, skip, W = gen.sm, SkipSet(uniform.attn, uniform.mlp, sparsity), 8
    cache = SwiftCache(sm.n_layers)
    sm.prefill(ctx[:-1], cache)
    P = cache.length
    matchness(sm, skip, ctx, gen.cfg.window, cache)  # window = 32 > W: covers our positions too
    assert cache.length == P  # rolled back
    hits = []
    for pos in range(P - W, P):
        cache = SwiftCache(sm.n_layers)
        sm.prefill(ctx[:pos], cache)
        h = sm.forward([ctx[pos]], torch.tensor([pos]), torch.ones(1, 1, dtype=torch.bool), cache, skip=skip)
        logits, ids = sm.draft_logits(h)  # over the draft vocabulary: column j is token ids[j]
        best = int(logits[0].argmax())
        hits.append((best if ids is None else int(ids[best])) == ctx[pos + 1])
    cache = SwiftCache(sm.n_layers)
    sm.prefill(ctx[:-1], cache)
    assert math.isclose(matchness(sm, skip, ctx, W, cache), sum(hits) / W)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
        (dict(prompt="hi", temperature=float("nan")), "temperature"),
        (dict(prompt="hi", temperature=-1.0), "temperature"),
        (dict(prompt="hi", temperature=float("inf")), "temperature"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", top_k=-2), "top_k"),
        (dict(prompt="hi " * 9000), "context"),
        (dict(prompt=[10**9]), "token ids"),
    ],
)
def test_bad_input_is_a_user_error(smollm, kwargs, msg):
    gen = Generator(*smollm, method="swift")
    prompt = kwargs.pop("prompt")
    with pytest.raises(UserError, match=msg):
        gen.generate(prompt, **kwargs)
    assert gen.generate("Say hi.", max_new_tokens=4, chat=True).token_ids  # state intact for the next request


def test_stop_string_eos_and_max_tokens(smollm):
    gen = Generator(*smollm, method="swift")
    full = gen.generate("Count from 1 to 20, separated by commas.", max_new_tokens=60, chat=True)
    assert full.finish_reason == ("length" if len(full.token_ids) == 60 else "stop") and len(full.token_ids) <= 60
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = gen.generate("Count from 1 to 20, separated by commas.", max_new_tokens=60, chat=True, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    assert len(gen.generate("Hello", max_new_tokens=5).token_ids) == 5
    streamed = "".join(
        ev.text for ev in gen.stream("Count from 1 to 20, separated by commas.", max_new_tokens=60, chat=True)
    )
    assert streamed == full.text


def test_coupled_sampling_draft_is_always_accepted_when_the_draft_is_the_model(smollm):
    """With no sublayer skipped, no sparsity and the full vocabulary, the draft distribution is the model's, so
    ranking by q/E with the target's per-position noise proposes exactly the token sampling will pick: every
    drafted token is accepted, and the text is plain sampling's."""
    model, tok = smollm
    draft = DraftConfig(max_depth=6, epsilon=0.0, max_nodes=6, topk=((0.0, 1),), sampling_topk=((0.0, 1),))
    cfg = EngineConfig(draft=draft, search=None, init="uniform", init_ratio=0.0, adaptive=False)
    gen = Generator(model, tok, method="uniform", config=cfg)
    assert gen.proposer.drafters["draft"].tuner.skip.size == 0
    prompt = "Write a short poem about the sea."
    res = gen.generate(prompt, max_new_tokens=40, temperature=1.0, seed=11, chat=True)
    plain = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=40, temperature=1.0, seed=11, chat=True)
    assert res.token_ids == plain.token_ids
    assert res.stats.drafted_depth >= 20 and res.stats.acceptance_rate == 1.0


def test_sampling_noise_is_drawn_only_where_sampled():
    """Noise is a pure function of (seed, position): a token at position 4000 draws one vector, not 4001."""
    from swiftdecode.decoding.sampling import Sampler, SamplingParams

    params, logits = SamplingParams(temperature=1.0), torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s = Sampler(params, seed=3)
    token = s.pick(logits, 4000)
    assert list(s.noise) == [4000]
    fresh = Sampler(params, seed=3)
    assert fresh.pick(logits, 4000) == token and torch.equal(fresh.noise_at(4000, 1000), s.noise_at(4000, 1000))
    assert not torch.equal(s.noise_at(4001, 1000), s.noise_at(4000, 1000))
    assert not torch.equal(Sampler(params, seed=4).noise_at(4000, 1000), s.noise_at(4000, 1000))


def test_unseeded_sampling_leaves_torch_rng_alone(smollm):
    model, tok = smollm
    torch.manual_seed(123)
    Generator(model, tok, method="ar").generate("Hi", max_new_tokens=3, temperature=1.0, chat=True)
    assert torch.initial_seed() == 123


def test_first_request_thresholds_come_from_the_prompt(smollm_fp32):
    """The sparsity thresholds after a fresh generator's first prefill are those of the prompt alone (the search's
    cost timing, which runs right after, must not overwrite them)."""
    from swiftdecode.runtime.model import SwiftModel

    model, tok = smollm_fp32
    gen = Generator(model, tok, method="swift")
    ids = gen.chat_ids([{"role": "user", "content": "Name the planets of the solar system."}])
    gen.generate(ids, max_new_tokens=1)
    roles = [m for m in model.modules() if getattr(m, "role", "")]
    after = [m.thresholds.clone() for m in roles]
    sm = SwiftModel(model)
    with sm.calibrating():
        sm.prefill(ids, SwiftCache(sm.n_layers))
    assert all(torch.equal(a, m.thresholds) for a, m in zip(after, roles, strict=True))


STEP_S = 0.004  # the stubbed search step's cost


def test_search_stays_within_its_cap_on_every_request(smollm, monkeypatch):
    """Short answers cannot overspend: each request's search time stays within the cap's share of its decoding
    time (the search step is stubbed to a fixed cost, known as if measured, so this checks the accounting, not
    machine speed or the first step's guessed cost)."""
    import time

    model, tok = smollm
    gen = Generator(model, tok, method="swift")
    steps = []

    def step(ctx, pending, cache):  # 4 ms of work, or more if the CPU is busy (the excess is allowed for below)
        t = time.perf_counter()
        while time.perf_counter() - t < STEP_S:
            pass
        steps.append(time.perf_counter() - t)

    tuner = gen.proposer.drafters["draft"].tuner
    monkeypatch.setattr(tuner, "step", step)
    tuner.step_s = STEP_S  # as measured after a first step (before one, its cost is a guess)
    for prompt in ("Count from one to thirty in words.", "List twenty animals.", "Write a short poem about rain."):
        gen.proposer.schedule.budget.decode_s = (
            100.0  # long earlier traffic: the running budget alone would allow a burst here
        )
        before = len(steps)
        res = gen.generate(prompt, max_new_tokens=128, chat=True)
        split, late = res.stats.time_split, sum(d - STEP_S for d in steps[before:])  # beyond the known cost
        assert split["optimize"] <= 1.05 * tuner.search.cfg.max_overhead * (split["draft"] + split["verify"]) + late
    assert steps  # the search did run


@pytest.mark.parametrize("method", ["swift", "suffix", "ngram", "skip-only", "ar"])
def test_rounds_and_accepted_tokens_are_counted_by_source(smollm, method):
    """Every round is counted under its kind and every accepted draft token under the drafter(s) that proposed it;
    an ablation never runs the drafter it leaves out."""
    gen = Generator(*smollm, method=method)
    prompt = "Repeat this line three times: the quick brown fox jumps over the lazy dog."
    res = gen.generate(prompt, max_new_tokens=64, chat=True)
    s, kinds, acc = res.stats, res.stats.round_kinds, res.stats.accepted_by_source
    copies = kinds["suffix"] + kinds["ngram"]
    assert sum(acc.values()) == s.accepted_draft_tokens and s.tree_rounds == kinds["draft"] + copies
    assert s.round_seconds["plain"] <= s.time_split["verify"] and all(v >= 0 for v in s.round_seconds.values())
    if method == "ar":
        # one token from the prefill, one per round; an EOS ends the last round uncounted
        assert kinds["draft"] == copies == 0 and kinds["plain"] == s.new_tokens - (res.finish_reason != "stop")
    if method in ("suffix", "ngram"):
        other = "ngram" if method == "suffix" else "suffix"
        assert kinds["draft"] == kinds[other] == acc["skip"] == acc[other] == acc["both"] == 0 and kinds[method] > 0
    if method == "skip-only":
        assert copies == acc["suffix"] == acc["ngram"] == acc["both"] == 0 and kinds["draft"] > 0
    if method == "swift":
        assert kinds["ngram"] == acc["ngram"] == 0 and kinds["suffix"] > 0 and acc["suffix"] > 0
        assert kinds["draft"] + kinds["suffix"] + kinds["plain"] == sum(kinds.values())


@pytest.mark.parametrize("model_name", ["smollm", "qwen", "gemma"])  # byte-level BPE twice, SentencePiece
def test_text_so_far_is_the_whole_decode_a_few_tokens_at_a_time(request, model_name):
    """Fed in rounds of 1-5 tokens, the incremental text is always a prefix of decoding all the tokens, and
    catches up with it whenever the characters are whole (accents, CJK, emoji split across tokens)."""
    from swiftdecode.base.text import Prompts, TextSoFar

    _, tok = request.getfixturevalue(model_name)
    prompts = Prompts(tok, len(tok), 1 << 20)
    text = "Café naïve — 東京タワー 🚀🎉 déjà vu.\n  Two  spaces, a tab\tand ∑ x² ≤ ∞! " * 3
    ids = tok(text, add_special_tokens=False)["input_ids"]
    so_far, rng, n, caught_up = TextSoFar(prompts.decode), np.random.default_rng(0), 0, 0
    while n < len(ids):
        n = min(n + int(rng.integers(1, 6)), len(ids))
        whole = prompts.decode(ids[:n])
        got = so_far.update(ids[:n])
        assert whole.startswith(got)
        caught_up += got == whole
    assert so_far.text == prompts.decode(ids) and caught_up > 10
