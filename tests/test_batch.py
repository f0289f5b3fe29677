"""Continuous batching: requests decoding together, joining and leaving between rounds, each answer token for token
(greedy) and seed for seed (sampling) what the request gives alone."""

from __future__ import annotations

import pytest

from swiftdecode import Generator
from swiftdecode.engine.batch import PREFILL_CHUNK, Batch

MIX = [  # (prompt, parameters): greedy, sampling, top-p/top-k, a stop string, different lengths
    ("Write a short story about a lighthouse keeper.", dict(max_new_tokens=48)),
    ("Explain how a hash map works.", dict(max_new_tokens=40, temperature=0.8, seed=3)),
    ("List ten fruits, one per line.", dict(max_new_tokens=32)),
    ("Translate into French: good morning, my friend.", dict(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7)),
    ("Count from 1 to 30, separated by commas.", dict(max_new_tokens=64, stop=["17"])),
    ("Name three planets.", dict(max_new_tokens=20, temperature=0.7, top_k=40, seed=11)),
    (
        "Summarize in one line: " + "The river rose after days of rain, and the village moved its boats uphill. " * 30,
        dict(max_new_tokens=24),
    ),  # a prompt of several prefill chunks
]


def run_batched(gen: Generator, joins: list[int], leave: int | None = None) -> list:
    """Start MIX[k] after joins[k] rounds of the batch so far; request `leave` is dropped after 3 rounds."""
    assert len(gen.request(MIX[-1][0], chat=True).ids) > 2 * PREFILL_CHUNK
    batch, reqs = Batch(gen), []
    rounds = 0

    def step() -> None:
        nonlocal rounds
        assert len(batch) <= len(MIX)
        batch.step()
        rounds += 1
        if leave is not None and rounds == 3:
            batch.remove(reqs[leave])

    for k, (prompt, kw) in enumerate(MIX):
        while rounds < joins[k] and len(batch):
            step()
        reqs.append(gen.request(prompt, chat=True, **kw))
        batch.add(reqs[-1])
    while len(batch):
        step()
    return reqs


def _why(gen: Generator, k: int, ref) -> str:
    """What a mismatch report needs to tell a batching fault from a solo run that changed: the paths the model
    runs on, the solo run's rounds, and whether running MIX[k] alone again gives the same tokens."""
    from swiftdecode.runtime.fastpath import info_of

    again = gen.generate(MIX[k][0], chat=True, **MIX[k][1]).token_ids
    return (
        f"fast path {info_of(gen.sm.model).reason!r}, layer loop {gen.sm.layer_loop()}, solo rounds "
        f"{ref.stats.round_kinds}; MIX[{k}] alone again {'equals' if again == ref.token_ids else 'differs from'} "
        f"the first solo run: {again[:8]}"
    )


@pytest.mark.parametrize("model_name", ["smollm", "qwen"])
def test_batched_requests_are_their_solo_runs(request, model_name):
    model, tok = request.getfixturevalue(model_name)
    gen = Generator(model, tok, method="swift")
    solo = [gen.generate(p, chat=True, cache_salt="solo", **kw) for p, kw in MIX]  # the batch cannot copy them
    for joins in ([0] * len(MIX), [0, 1, 2, 5, 9, 14, 15]):
        reqs = run_batched(gen, joins)
        for k, (req, ref) in enumerate(zip(reqs, solo, strict=True)):
            assert req.new == ref.token_ids, f"request {k} (joins {joins}) differs from solo: {_why(gen, k, ref)}"
            assert req.finish == ref.finish_reason
        assert sum(r.stats.batched_rounds for r in reqs) > 0  # they did decode together
    leaver = run_batched(gen, [0, 0, 0, 1, 1, 2, 2], leave=1)
    assert leaver[1].finish is None and len(leaver[1].new) < len(solo[1].token_ids)  # it left early
    assert all(r.new == s.token_ids for k, (r, s) in enumerate(zip(leaver, solo, strict=True)) if k != 1)


def test_batching_off_the_lean_path_runs_parts_in_turn(smollm_torch):
    """Off the lean path (torch's: transformers' modules) batched rounds run each request's forward in turn (same
    result)."""
    gen = Generator(*smollm_torch, method="ar")
    mix = [("The capital of France is", 12), ("def fibonacci(n):", 16), ("Once upon a time", 10)]
    solo = [gen.generate(p, max_new_tokens=n, cache_salt="solo").token_ids for p, n in mix]
    batch = Batch(gen)
    reqs = [gen.request(p, max_new_tokens=n) for p, n in mix]
    for r in reqs:
        batch.add(r)
    while len(batch):
        batch.step()
    assert [r.new for r in reqs] == solo
