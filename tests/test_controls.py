"""min_p and logit_bias: applied by the sampler at every position, so speculative methods and batches stay
token- and seed-identical to plain decoding, and each means what its definition says."""

from __future__ import annotations

import pytest
import torch
from conftest import batched_and_solo

from swiftdecode import Generator, UserError
from swiftdecode.base.params import SamplingParams
from swiftdecode.decoding.sampling import Sampler, kept, probabilities

PROMPT = "Write a short story about a robot who learns to paint."


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest():
    logits = torch.randn(5000) * 3
    for top_p in (1.0, 0.9):
        params = SamplingParams(temperature=0.8, top_p=top_p, min_p=0.05)
        probs, plain = probabilities(logits, params), probabilities(logits, SamplingParams(0.8, top_p))
        raw = torch.softmax(logits / 0.8, -1)
        want = (plain > 0) & (raw >= 0.05 * raw.max())  # min_p after top-p: the two sets' intersection
        assert torch.equal(probs > 0, want) and 1 < int(want.sum()) < int((plain > 0).sum())
        assert torch.allclose(probs.sum(), torch.tensor(1.0))
        ids, p = kept(logits, params)
        assert torch.equal(ids, torch.nonzero(probs).flatten()) and torch.equal(p, probs[ids])  # the same bits
        picks = {Sampler(params, seed).pick(logits, 7) for seed in range(200)}
        assert picks <= set(ids.tolist()) and len(picks) > 1


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_min_p_methods_equal_plain_decoding(smollm, top_p):
    kw = dict(chat=True, max_new_tokens=48, temperature=1.0, top_p=top_p, seed=11, min_p=0.1)
    ar = Generator(*smollm, method="ar").generate(PROMPT, **kw)
    assert ar.token_ids != Generator(*smollm, method="ar").generate(PROMPT, **{**kw, "min_p": 0.0}).token_ids
    for method in ("swift", "ngram"):
        assert Generator(*smollm, method=method).generate(PROMPT, **kw).token_ids == ar.token_ids, method


def test_logit_bias_bans_and_forces_tokens(smollm):
    gen = Generator(*smollm, method="swift")
    plain = gen.generate(PROMPT, chat=True, max_new_tokens=24)
    banned = gen.generate(PROMPT, chat=True, max_new_tokens=24, logit_bias={t: -100 for t in plain.token_ids[:3]})
    assert not set(plain.token_ids[:3]) & set(banned.token_ids)
    comma = gen.tokenizer.encode(",", add_special_tokens=False)[0]
    forced = gen.generate(PROMPT, chat=True, max_new_tokens=8, logit_bias={comma: 100})
    assert forced.token_ids == [comma] * 8
    for method in ("ar", "ngram"):
        res = Generator(*smollm, method=method).generate(
            PROMPT, chat=True, max_new_tokens=24, logit_bias={t: -100 for t in plain.token_ids[:3]}
        )
        assert res.token_ids == banned.token_ids, method


def test_controls_batch_equals_solo(smollm):
    gen = Generator(*smollm, method="swift")
    mix = [
        (PROMPT, dict(temperature=0.9, seed=4, min_p=0.1, repetition_penalty=1.1)),
        ("List ten fruits.", dict(logit_bias={11: 5.0, 28: -100}, frequency_penalty=0.5)),
        ("Count from one to ten.", dict(repetition_penalty=1.05)),
    ]
    reqs, solo = batched_and_solo(gen, mix, 32)
    assert sum(r.stats.batched_rounds for r in reqs) > 0 and [r.new for r in reqs] == solo


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"5": 1}), "logit_bias"),
        (dict(logit_bias={10**9: 1}), "logit_bias"),
        (dict(logit_bias=[(5, 1)]), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=500), "min_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_controls_are_user_errors(smollm, kw, field):
    with pytest.raises(UserError, match=field):
        Generator(*smollm, method="ar").request("hi", **kw)


def test_min_tokens_and_ignore_eos(smollm):
    """min_tokens holds end-of-sequence back, ignore_eos generates past it; both as plain decoding does them, with
    every method; a grammar that allows nothing but the end still ends the answer."""
    kw = dict(chat=True, max_new_tokens=48)
    short = Generator(*smollm, method="ar").generate("Say hi.", **kw)
    assert short.finish_reason == "stop" and len(short.token_ids) < 30
    for extra in (dict(min_tokens=len(short.token_ids) + 10), dict(ignore_eos=True)):
        ar = Generator(*smollm, method="ar").generate("Say hi.", **kw, **extra)
        assert (
            len(ar.token_ids) >= len(short.token_ids) + 10 and ar.token_ids[: len(short.token_ids)] == short.token_ids
        )
        for method in ("swift", "ngram"):
            assert Generator(*smollm, method=method).generate("Say hi.", **kw, **extra).token_ids == ar.token_ids
    assert len(ar.token_ids) == 48 and ar.finish_reason == "length"  # ignore_eos: the budget ends it
    yes = Generator(*smollm, method="swift").generate("Say yes.", **kw, min_tokens=5, grammar={"regex": "yes"})
    assert yes.text == "yes" and yes.finish_reason == "stop"
