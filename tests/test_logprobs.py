"""Token log-probabilities: the model's own distribution at each position, from the row that chose the token, so
every method and any batch report the numbers plain decoding would (bit for bit on the batch-invariant kernels)."""

from __future__ import annotations

import pytest
import torch

from swiftdecode import Generator, UserError
from swiftdecode.decoding.logprobs import token_logprobs
from swiftdecode.engine.batch import Batch
from swiftdecode.runtime.cache import SwiftCache

PROMPT = "Write the numbers from one to twenty, separated by commas."
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=3)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_every_method_reports_plain_decodings_logprobs(smollm, sampling):
    results = {
        m: Generator(*smollm, method=m).generate(PROMPT, chat=True, max_new_tokens=48, logprobs=3, **sampling)
        for m in ("ar", "swift", "ngram")
    }
    ar = results["ar"]
    assert [e.token for e in ar.logprobs] == ar.token_ids
    for e in ar.logprobs:
        assert len(e.top) == 3 and e.top[0][1] >= e.top[1][1] >= e.top[2][1] and e.logprob <= e.top[0][1]
        assert not sampling or e.logprob <= 0
        if not sampling:  # greedy takes the likeliest token
            assert e.top[0] == (e.token, e.logprob)
    assert results["swift"].stats.tree_rounds > 0  # speculation ran, and its verification rows gave the numbers
    for m in ("swift", "ngram"):
        assert results[m].token_ids == ar.token_ids and results[m].logprobs == ar.logprobs, m


def test_logprobs_are_the_log_softmax_of_a_teacher_forced_forward(smollm):
    gen = Generator(*smollm, method="swift")
    res = gen.generate(PROMPT, chat=True, max_new_tokens=32, logprobs=0)
    ids = gen.chat_ids([{"role": "user", "content": PROMPT}])
    hidden = gen.sm.prefill(ids + res.token_ids, SwiftCache(gen.sm.n_layers))
    rows = gen.sm.logits(hidden[len(ids) - 1 : len(ids) - 1 + len(res.token_ids)])
    assert res.logprobs == token_logprobs(rows, res.token_ids, 0)  # the same rows, to the last bit
    exact = torch.log_softmax(rows.double(), dim=-1)[torch.arange(len(res.token_ids)), res.token_ids]
    assert torch.allclose(torch.tensor([e.logprob for e in res.logprobs], dtype=torch.float64), exact, atol=1e-5)
    assert all(e.top == () for e in res.logprobs)


def test_streamed_entries_add_up_to_the_result_and_follow_a_stop_cut(smollm):
    gen = Generator(*smollm, method="swift")
    events = list(
        gen.stream("Count from 1 to 30, separated by commas.", chat=True, max_new_tokens=64, stop=["6. 6"], logprobs=1)
    )  # a stop string of several tokens
    res = events[-1].result
    assert res.finish_reason == "stop" and res.text.endswith("5. 5\n") and "6" not in res.text
    assert [e for ev in events for e in ev.logprobs] == res.logprobs
    assert [e.token for e in res.logprobs] == res.token_ids
    assert gen.generate("Hello", max_new_tokens=4).logprobs is None  # off unless asked for


def test_batched_requests_report_their_solo_logprobs(smollm):
    gen = Generator(*smollm, method="swift")
    mix = [("List ten fruits.", {}), ("Name three planets.", SAMPLED), ("Count from 1 to 30.", dict(stop=["6. 6"]))]
    solo = [gen.generate(p, chat=True, max_new_tokens=32, logprobs=2, cache_salt="solo", **kw) for p, kw in mix]
    batch, reqs = Batch(gen), []
    for p, kw in mix:
        reqs.append(gen.request(p, chat=True, max_new_tokens=32, logprobs=2, **kw))
        batch.add(reqs[-1])
        batch.step()  # the next one joins a batch already decoding
    while len(batch):
        batch.step()
    assert sum(r.stats.batched_rounds for r in reqs) > 0
    for req, ref in zip(reqs, solo, strict=True):
        assert req.new == ref.token_ids and req.logprobs == ref.logprobs


@pytest.mark.parametrize("bad", [-1, 21, 2.5, "3", True])
def test_bad_logprobs_is_a_user_error(smollm, bad):
    with pytest.raises(UserError, match="logprobs"):
        Generator(*smollm, method="ar").request("hi", logprobs=bad)


def test_prompt_logprobs_are_what_generating_those_tokens_reports(smollm):
    """Scoring a text (the server's echo) gives each token the entry the engine reports when it generates it:
    a prompt row depends only on the tokens before it, chunked or not."""
    from swiftdecode.decoding.logprobs import prompt_logprobs

    gen = Generator(*smollm, method="swift")
    ids = gen.encode("The capital of France is")
    res = gen.generate(ids, max_new_tokens=12, logprobs=2)
    entries, cache = prompt_logprobs(gen.sm, ids + res.token_ids, 2)
    assert cache.length == len(ids) + len(res.token_ids) and len(entries) == cache.length - 1
    assert entries[len(ids) - 1 :] == res.logprobs
