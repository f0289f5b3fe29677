"""Structured output: answers follow a JSON schema, regex or Lark grammar, and constrained speculative methods and
batches stay token- and seed-identical to constrained plain decoding."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import batched_and_solo

from swiftdecode import Generator, UserError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PERSON = "Describe a fictional person as JSON with name, age and hobbies."


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.95, seed=3)], ids=["greedy", "sampled"])
def test_json_schema_answers_are_valid_and_methods_agree(smollm, sampling):
    kw = dict(chat=True, max_new_tokens=128, grammar={"json_schema": SCHEMA}, **sampling)
    ar = Generator(*smollm, method="ar").generate(PERSON, **kw)
    assert ar.finish_reason == "stop", ar.text
    person = json.loads(ar.text)
    assert set(person) == {"name", "age", "hobbies"} and isinstance(person["age"], int)
    assert isinstance(person["name"], str) and len(person["hobbies"]) <= 3
    for method in ("swift", "ngram"):
        res = Generator(*smollm, method=method).generate(PERSON, **kw)
        assert res.token_ids == ar.token_ids, method
        assert res.stats.tree_rounds > 0, method  # masks along verified paths, not only plain steps


def test_regex_and_lark(smollm):
    gen = Generator(*smollm, method="swift")
    year = gen.generate("The Eiffel tower was finished in", max_new_tokens=12, grammar={"regex": r" [0-9]{4}\."})
    assert re.fullmatch(r" [0-9]{4}\.", year.text) and year.finish_reason == "stop"
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ]{1,40}/ "."'
    for seed in range(3):
        res = gen.generate(
            "Is the sky blue?", chat=True, max_new_tokens=40, temperature=0.9, seed=seed, grammar={"lark": lark}
        )
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}\.", res.text), res.text


def test_constraint_follows_paths_and_commits(smollm):
    """Masks asked along one path, then another, then after a commit, equal a fresh matcher's for the same tokens."""
    gen = Generator(*smollm, method="ar")
    a = gen.grammars.constraint({"json_schema": SCHEMA})
    toks = gen.tokenizer.encode('{"name": "Al", "age": 7', add_special_tokens=False)

    def fresh(tokens):
        c = gen.grammars.constraint({"json_schema": SCHEMA})
        c.commit(tokens)
        return c.allowed(())

    assert torch.equal(a.allowed(toks[:3]), fresh(toks[:3]))
    assert torch.equal(a.allowed(toks[:5]), fresh(toks[:5]))  # the path grew
    assert torch.equal(a.allowed(toks[:2]), fresh(toks[:2]))  # another path: back to the committed state
    a.commit(toks[:4])
    assert torch.equal(a.allowed(toks[4:6]), fresh(toks[:6])) and not torch.equal(fresh(toks[:6]), fresh(toks[:2]))


def test_grammar_batch_equals_solo(smollm):
    gen = Generator(*smollm, method="swift")
    mix = [
        (PERSON, dict(grammar={"json_schema": SCHEMA})),
        ("List three fruits.", {}),
        ("Pick a number.", dict(grammar={"regex": r"[1-9][0-9]?"}, temperature=0.9, seed=8)),
    ]
    reqs, solo = batched_and_solo(gen, mix, 48)
    assert sum(r.stats.batched_rounds for r in reqs) > 0 and [r.new for r in reqs] == solo


@pytest.mark.parametrize(
    ("grammar", "msg"),
    [
        ("json", "grammar must be one of"),
        ({"json_schema": {}, "regex": "a"}, "grammar must be one of"),
        ({"xml": "a"}, "grammar must be one of"),
        ({"regex": "[a-"}, "does not compile"),
        ({"regex": 5}, "regex must be a string"),
        ({"lark": "start: undefined_rule"}, "does not compile"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": [1]}, "must be a JSON object"),
    ],
)
def test_bad_grammar_is_a_user_error(smollm, grammar, msg):
    with pytest.raises(UserError, match=msg):
        Generator(*smollm, method="ar").request("hi", grammar=grammar)
