"""OpenAI's presence and frequency penalties: applied at every position to the tokens generated before it, the
verified path's included, so speculative methods and batches stay token- and seed-identical to plain decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import batched_and_solo, teacher_forced_rows

from swiftdecode import Generator, UserError
from swiftdecode.decoding.sampling import Sampler, argmax

PROMPT = "Write the numbers from one to twenty, separated by commas."
PENALTIES = dict(frequency_penalty=1.0, presence_penalty=0.5)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.95, seed=5)], ids=["greedy", "sampled"])
def test_penalized_methods_equal_plain_decoding(smollm, sampling):
    kw = dict(chat=True, max_new_tokens=48, **PENALTIES, **sampling)
    ar = Generator(*smollm, method="ar").generate(PROMPT, **kw)
    plain = Generator(*smollm, method="ar").generate(PROMPT, **{**kw, **dict.fromkeys(PENALTIES, 0.0)})
    assert ar.token_ids != plain.token_ids  # the penalties change the answer
    for method in ("swift", "ngram"):
        res = Generator(*smollm, method=method).generate(PROMPT, **kw)
        assert res.token_ids == ar.token_ids, method
        assert res.stats.tree_rounds > 0, method  # verified trees, penalized along their paths


def test_greedy_penalized_tokens_are_the_definition(smollm):
    """Teacher-forced: token i is the argmax of logits_i − (1.0·count + 0.5) over the tokens before it."""
    gen = Generator(*smollm, method="swift")
    res = gen.generate(PROMPT, chat=True, max_new_tokens=40, **PENALTIES)
    rows, _ = teacher_forced_rows(gen, PROMPT, res.token_ids)
    for i, token in enumerate(res.token_ids):
        row = rows[i].clone()
        for t in set(res.token_ids[:i]):
            row[t] -= torch.tensor(res.token_ids[:i].count(t), dtype=torch.float32) * 1.0 + 0.5
        assert argmax(row) == token, i


def test_penalized_batch_equals_solo(smollm):
    gen = Generator(*smollm, method="swift")
    mix = [
        (PROMPT, PENALTIES),
        ("Name three planets.", dict(temperature=0.7, seed=2, presence_penalty=1.0)),
        ("List ten fruits.", {}),
    ]
    reqs, solo = batched_and_solo(gen, mix, 32)
    assert sum(r.stats.batched_rounds for r in reqs) > 0 and [r.new for r in reqs] == solo


def test_no_penalty_leaves_the_logits_alone():
    from swiftdecode.base.params import SamplingParams

    sampler = Sampler(SamplingParams(), seed=0)
    sampler.count([1, 2, 2])
    logits = torch.randn(10)
    assert sampler.counts == {} and sampler.pick(logits, 5, [3]) == argmax(logits)


@pytest.mark.parametrize("bad", [2.5, -3, float("nan"), "1", True])
def test_bad_penalty_is_a_user_error(smollm, bad):
    with pytest.raises(UserError, match="frequency_penalty"):
        Generator(*smollm, method="ar").request("hi", frequency_penalty=bad)


# ---------------------------------------------------------------- repetition penalty (transformers', vLLM's)
REPEAT = dict(repetition_penalty=1.1)  # stronger ones leave SmolLM2 no repeats for the n-gram branch to copy
CODE = "Write a Python function that adds two numbers, then three tests for it."


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.95, seed=5)], ids=["greedy", "sampled"])
def test_repetition_penalty_methods_equal_plain_decoding(smollm, sampling):
    kw = dict(chat=True, max_new_tokens=48, **REPEAT, **sampling)
    ar = Generator(*smollm, method="ar").generate(CODE, **kw)
    assert ar.token_ids != Generator(*smollm, method="ar").generate(CODE, **{**kw, "repetition_penalty": 1.0}).token_ids
    for method in ("swift", "ngram"):
        res = Generator(*smollm, method=method).generate(CODE, **kw)
        assert res.token_ids == ar.token_ids, method
        assert res.stats.tree_rounds > 0, method


def test_greedy_repetition_penalty_is_the_definition(smollm):
    """Teacher-forced: token i is the argmax of the logits with those of the prompt's and earlier answer tokens
    divided by 1.1 where positive, multiplied where not."""
    gen = Generator(*smollm, method="swift")
    res = gen.generate(CODE, chat=True, max_new_tokens=40, **REPEAT)
    rows, ids = teacher_forced_rows(gen, CODE, res.token_ids)
    for i, token in enumerate(res.token_ids):
        row = rows[i].clone()
        for t in set(ids + res.token_ids[:i]):
            row[t] = row[t] / 1.1 if row[t] > 0 else row[t] * 1.1
        assert argmax(row) == token, i


def test_repetition_penalty_does_not_depend_on_earlier_requests(smollm):
    """The same request answered by a generator that served other prompts first (prefix cache on, search state
    moved on) as by a fresh one: the prompt's tokens count whether or not their cache entries were copied."""
    kw = dict(chat=True, max_new_tokens=32, **REPEAT)
    fresh = Generator(*smollm, method="swift").generate(CODE, **kw).token_ids
    gen = Generator(*smollm, method="swift", prefix_cache_gb=0.1)
    gen.generate(CODE + " Then explain it.", **kw)
    gen.generate(CODE, chat=True, max_new_tokens=16)
    res = gen.generate(CODE, **kw)
    assert res.stats.cached_prompt_tokens > 0 and res.token_ids == fresh


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "2"])
def test_bad_repetition_penalty_is_a_user_error(smollm, bad):
    with pytest.raises(UserError, match="repetition_penalty"):
        Generator(*smollm, method="ar").request("hi", repetition_penalty=bad)
