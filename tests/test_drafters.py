"""The drafter interface: a new drafter is one class and one registry line. A small copying drafter defined here
drafts through the engine's one round, alone and batched, and the output stays exactly plain decoding's."""

from __future__ import annotations

from dataclasses import replace

from swiftdecode import Generator
from swiftdecode.base.config import SWIFT_DRAFT, EngineConfig
from swiftdecode.drafters import registry
from swiftdecode.drafters.base import Branch, Copy, Drafter
from swiftdecode.engine.batch import Batch

PROMPT = "Repeat this line twice, word for word: the quick brown fox jumps over the lazy dog near the river bank."


class PromptEcho(Drafter):
    """Copies what followed the last token's latest occurrence in the prompt, and counts what it was told."""

    kind = source = "echo"
    copies = True

    def __init__(self, sm, cfg):
        super().__init__(sm, cfg)
        self.seen = {"begin": 0, "observe": 0, "end": 0}

    def begin(self, req) -> None:
        self.seen["begin"] += 1

    def copy(self, req, length: int) -> Copy | None:
        ids, last = req.ids, req.ctx[-1]
        at = max((i for i, t in enumerate(ids[:-1]) if t == last), default=None)
        if at is None or length <= 0:
            return None
        return Copy([Branch(ids[at + 1 : at + 1 + length], lambda depth: 0.9**depth)])

    def observe(self, req, tokens, kind, budget) -> None:
        self.seen["observe"] += 1

    def end(self, req) -> None:
        self.seen["end"] += 1


def echo_engine(smollm, monkeypatch) -> Generator:
    monkeypatch.setitem(registry.DRAFTERS, PromptEcho.kind, PromptEcho)  # the one registry line
    config = EngineConfig(draft=replace(SWIFT_DRAFT, copy=8), search=None, modes=("echo", "plain"))
    return Generator(*smollm, method="swift", config=config)


def test_a_new_drafter_drafts_losslessly_through_the_round(smollm, monkeypatch):
    gen, ar = echo_engine(smollm, monkeypatch), Generator(*smollm, method="ar")
    want = ar.generate(PROMPT, chat=True, max_new_tokens=48)
    got = gen.generate(PROMPT, chat=True, max_new_tokens=48)
    assert got.token_ids == want.token_ids
    kinds, sources, echo = got.stats.round_kinds, got.stats.accepted_by_source, gen.proposer.drafters["echo"]
    assert kinds["echo"] > 0 and sources["echo"] > 0 and kinds["draft"] == 0 and sources["skip"] == 0
    assert got.stats.tree_rounds == kinds["echo"] + kinds["ngram"]
    assert echo.seen["begin"] == echo.seen["end"] == 1 and echo.seen["observe"] == sum(kinds.values())
    sampled = dict(max_new_tokens=32, seed=5, temperature=0.8)
    assert gen.generate(PROMPT, chat=True, **sampled).token_ids == ar.generate(PROMPT, chat=True, **sampled).token_ids


def test_a_new_drafter_drafts_in_a_batch(smollm, monkeypatch):
    gen, ar = echo_engine(smollm, monkeypatch), Generator(*smollm, method="ar")
    prompts = [PROMPT, "Say the alphabet: a b c d e f g h i j k l m n o p q r s t u v w x y z, then say it again."]
    batch, budgets = Batch(gen), [120, 40]  # the first decodes on while the second's prompt joins, paced
    kw = {"chat": True, "ignore_eos": True}
    reqs = [gen.request(p, max_new_tokens=n, **kw) for p, n in zip(prompts, budgets, strict=True)]
    for req in reqs:
        batch.add(req)
    while len(batch):
        batch.step()
    for req, prompt, n in zip(reqs, prompts, budgets, strict=True):
        assert req.new == ar.generate(prompt, max_new_tokens=n, **kw).token_ids
    assert sum(req.stats.accepted_by_source.get("echo", 0) for req in reqs) > 0
    assert all(req.stats.batched_rounds > 0 for req in reqs)
