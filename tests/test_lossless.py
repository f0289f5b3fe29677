"""Accelerated greedy decoding is token-for-token plain greedy decoding (HF `model.generate`) on real models."""

from __future__ import annotations

import pytest
import torch
from conftest import pick_prompts

from swiftdecode import Generator

CATEGORIES = ["writing", "reasoning", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"]


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None)
    new = out[0, len(ids) :].tolist()
    return next((new[:i] for i, t in enumerate(new) if t in eos), new)


def top2_gap(model, ids: list[int]) -> float:
    """Gap between the two largest next-token logits after `ids` (a near-tie flips under float rounding)."""
    with torch.inference_mode():
        top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def encode(gen: Generator, prompt: str) -> list[int]:
    """Chat-templated ids for instruct models, plain ids for base models (Gemma-3-270M has no template)."""
    if gen.tokenizer.chat_template:
        return gen.chat_ids([{"role": "user", "content": prompt}])
    return gen.tokenizer(prompt)["input_ids"]


def compare(model, gen: Generator, prompts: list[str], n: int) -> tuple[list[str], list[str]]:
    """Run both decoders; return (mismatches, near-tie flips), each described in words."""
    mismatches, ties = [], []
    for k, prompt in enumerate(prompts):
        ids = encode(gen, prompt)
        ours = gen.generate(ids, max_new_tokens=n).token_ids
        ref = hf_greedy(model, ids, n, gen.eos)
        if ours == ref:
            continue
        i = next((j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
        gap = top2_gap(model, ids + ref[:i])
        what = f"prompt {k}: token {i}: ours {ours[i : i + 3]}, plain {ref[i : i + 3]}, gap {gap:.1e}"
        (ties if gap < 1e-4 else mismatches).append(what)
    return mismatches, ties


def test_swift_greedy_is_plain_greedy(smollm, spec_bench):
    """20 Spec-Bench prompts over 8 categories × 96 new tokens, on-the-fly search enabled and moving."""
    model, tok = smollm
    gen = Generator(model, tok, method="swift")
    prompts = pick_prompts(spec_bench, 3, CATEGORIES)[:20]
    mismatches, ties = compare(model, gen, prompts, 96)
    for t in ties:
        print("near-tie flip (reported, not a failure):", t)
    assert not mismatches, mismatches
    assert len(ties) <= 1, ties
    assert gen.search is not None and gen.search.evals > 1


@pytest.mark.parametrize("method", ["swift-paper", "uniform"])
def test_other_methods_greedy_is_plain_greedy(smollm, spec_bench, method):
    model, tok = smollm
    gen = Generator(model, tok, method=method)
    mismatches, ties = compare(model, gen, pick_prompts(spec_bench, 1, ["writing", "math_reasoning", "rag"]), 48)
    assert not mismatches, mismatches
    assert len(ties) <= 1, ties


def test_second_architecture_gemma3(spec_bench):
    """Gemma-3 (sliding-window attention, post-norms, 262k vocabulary), incl. a prompt longer than its window."""
    import swiftdecode

    model, tok = swiftdecode.load("gemma3-270m")
    gen = Generator(model, tok, method="swift")
    long_prompt = next(r["turns"][0] for r in spec_bench if r["category"] == "summarization")
    prompts = [long_prompt, *pick_prompts(spec_bench, 1, ["writing", "math_reasoning"])]
    assert len(encode(gen, long_prompt)) > gen.sm.window
    mismatches, ties = compare(model, gen, prompts, 48)
    assert not mismatches, mismatches
    assert len(ties) <= 1, ties


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 40)])
def test_swift_sampling_is_plain_sampling(smollm, spec_bench, temperature, top_p, top_k):
    """Same seed, same tokens: speculative sampling picks each position's token exactly as plain sampling does."""
    model, tok = smollm
    swift, ar = Generator(model, tok, method="swift"), Generator(model, tok, method="ar")
    kw = dict(max_new_tokens=48, temperature=temperature, top_p=top_p, top_k=top_k, chat=True)
    for i, prompt in enumerate(pick_prompts(spec_bench, 1, ["writing", "qa", "summarization"])):
        a = swift.generate(prompt, seed=i, **kw)
        assert a.token_ids == ar.generate(prompt, seed=i, **kw).token_ids
        assert a.token_ids == swift.generate(prompt, seed=i, **kw).token_ids  # reproducible as search moves on
        assert a.token_ids != ar.generate(prompt, seed=i + 100, **kw).token_ids
        assert a.stats.draft_rounds > 0
