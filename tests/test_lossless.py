"""Accelerated decoding is token-for-token our plain decoding (`ar`, same model and forward path) on real models,
with zero tolerance; how far `ar` agrees with transformers' own `generate` is measured too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import pick_prompts
from gguf.quants import IQ4_NL

from swiftdecode import Generator

CATEGORIES = ["writing", "reasoning", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"]


def encode(gen: Generator, prompt: str) -> list[int]:
    """Chat-templated ids for instruct models, plain ids for base models (Gemma-3-270M has no template)."""
    if gen.tokenizer.chat_template:
        return gen.chat_ids([{"role": "user", "content": prompt}])
    return gen.tokenizer(prompt)["input_ids"]


def compare(model, gen: Generator, prompts: list[str], n: int) -> tuple[list[str], int]:
    """Run `gen` and plain decoding (`ar`, same model, same forward path); describe every mismatch in words.
    Returns (mismatches, speculative rounds `gen` ran)."""
    plain = Generator(model, gen.tokenizer, method="ar")
    mismatches, rounds = [], 0
    for k, prompt in enumerate(prompts):
        ids = encode(gen, prompt)
        res = gen.generate(ids, max_new_tokens=n)
        ours, ref = res.token_ids, plain.generate(ids, max_new_tokens=n).token_ids
        rounds += res.stats.tree_rounds
        if ours != ref:
            i = next((j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
            mismatches.append(f"prompt {k}: token {i}: ours {ours[i : i + 3]}, plain {ref[i : i + 3]}")
    return mismatches, rounds


def hf_agreement(model, gen: Generator, prompts: list[str], n: int) -> float:
    """Mean share of `ar`'s tokens that HF `model.generate` (stock modules, same weights) reproduces before the
    first divergence: how far our path's numerics are from transformers'."""
    shares = []
    for prompt in prompts:
        ids = encode(gen, prompt)
        ours = gen.generate(ids, max_new_tokens=n).token_ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None)
        ref = out[0, len(ids) :].tolist()
        i = next((j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), len(ours))
        shares.append(i / max(len(ours), 1))
    return sum(shares) / len(shares)


def test_swift_greedy_is_plain_greedy(smollm, spec_bench, monkeypatch):
    """20 Spec-Bench prompts over 8 categories × 96 new tokens, on-the-fly search enabled and moving: its time
    cap raised (at the default 3% a 96-token answer cannot pay for a search step) and no matchness good enough
    to stop it, so the skip set changes under the drafts whatever the timings."""
    from dataclasses import replace

    from swiftdecode.engine.generator import preset

    model, tok = smollm
    cfg = preset("swift")
    search = replace(cfg.search, max_overhead=0.5, target_matchness=1.01)
    gen = Generator(model, tok, method="swift", config=replace(cfg, search=search))
    tuner = gen.proposer.drafters["draft"].tuner
    steps, step = [], tuner.step
    monkeypatch.setattr(tuner, "step", lambda ctx, pending, cache: steps.append(len(ctx)) or step(ctx, pending, cache))
    prompts = pick_prompts(spec_bench, 3, CATEGORIES)[:20]
    mismatches, rounds = compare(model, gen, prompts, 96)
    assert not mismatches, mismatches
    assert rounds > 0 and len(steps) > 5  # the search scored candidates throughout


@pytest.mark.parametrize("method", ["swift-paper", "uniform", "ngram", "skip-only"])
def test_other_methods_greedy_is_plain_greedy(smollm, spec_bench, method):
    model, tok = smollm
    gen = Generator(model, tok, method=method)
    mismatches, rounds = compare(model, gen, pick_prompts(spec_bench, 1, ["writing", "math_reasoning", "rag"]), 48)
    assert not mismatches and rounds > 0, mismatches


def test_second_architecture_gemma3(gemma, spec_bench):
    """Gemma-3 (sliding-window attention, post-norms, 262k vocabulary), incl. a prompt longer than its window."""
    model, tok = gemma
    gen = Generator(model, tok, method="swift")
    long_prompt = next(r["turns"][0] for r in spec_bench if r["category"] == "summarization")
    prompts = [long_prompt, *pick_prompts(spec_bench, 1, ["writing", "math_reasoning"])]
    assert len(encode(gen, long_prompt)) > gen.sm.window
    mismatches, rounds = compare(model, gen, prompts, 48)
    assert not mismatches and rounds > 0, mismatches


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 40)])
def test_swift_sampling_is_plain_sampling(smollm, spec_bench, temperature, top_p, top_k):
    """Same seed, same tokens: speculative sampling picks each position's token exactly as plain sampling does."""
    model, tok = smollm
    swift, ar = Generator(model, tok, method="swift"), Generator(model, tok, method="ar")
    kw = dict(max_new_tokens=48, temperature=temperature, top_p=top_p, top_k=top_k, chat=True)
    tree_rounds = 0
    for i, prompt in enumerate(pick_prompts(spec_bench, 1, ["writing", "qa", "summarization"])):
        a = swift.generate(prompt, seed=i, **kw)
        assert a.token_ids == ar.generate(prompt, seed=i, **kw).token_ids
        assert a.token_ids == swift.generate(prompt, seed=i, **kw).token_ids  # reproducible as search moves on
        assert a.token_ids != ar.generate(prompt, seed=i + 100, **kw).token_ids
        tree_rounds += a.stats.tree_rounds
    assert tree_rounds > 0  # speculative rounds ran (which requests get them depends on measured speeds)


def test_qwen_quantized_lossless_and_close_to_hf(qwen, spec_bench):
    """Qwen2.5-Coder-0.5B on its own Q4_K_M/Q5_0/Q8_0/Q6_K blocks: `swift` is `ar` token for token over every
    Spec-Bench category, and HF `generate` on the same weights mostly agrees with `ar`."""
    model, tok = qwen
    gen = Generator(model, tok, method="swift")
    prompts = pick_prompts(spec_bench, 1, CATEGORIES)
    mismatches, rounds = compare(model, gen, prompts, 48)
    assert not mismatches and rounds > 0, mismatches
    agreement = hf_agreement(model, gen, prompts[:3], 24)
    print(f"HF generate agrees with ar on {agreement:.0%} of tokens before the first divergence")
    assert agreement > 0.3  # a broken forward agrees on next to nothing


def test_torch_fallback_flips_are_counted(smollm_fp32, spec_bench):
    """Where the kernel cannot run, verification uses torch's matmuls and attention, which are not batch-invariant:
    outputs that differ from `ar` there are counted and reported (the count may be non-zero), not hidden."""
    from swiftdecode.runtime.fastpath import accelerate

    model, tok = smollm_fp32
    accelerate(model, "torch")
    try:
        gen = Generator(model, tok, method="swift")
        prompts = pick_prompts(spec_bench, 1, ["writing", "qa", "math_reasoning"])
        mismatches, rounds = compare(model, gen, prompts, 48)
        print(f"torch fallback: {len(mismatches)} of {len(prompts)} outputs differ from ar {mismatches}")
        assert rounds > 0  # speculation ran on this path too
    finally:
        accelerate(model, "auto")


def test_fp32_kernel_path_lossless(smollm_fp32, spec_bench):
    """`--weights fp32` on the kernel path (lean layers, activation-sparse drafts): `swift` is `ar` token for
    token."""
    model, tok = smollm_fp32
    gen = Generator(model, tok, method="swift")
    mismatches, rounds = compare(model, gen, pick_prompts(spec_bench, 1, ["writing", "summarization", "qa"]), 48)
    assert not mismatches and rounds > 0, mismatches


def test_two_models_in_one_process_keep_their_own_paths(smollm, spec_bench):
    """A float model on torch loaded beside a quantized one on the kernel path (and used between its requests):
    each keeps its own path and state. The kernel model stays lossless and sparse-drafts nothing it should not;
    the torch model's outputs do not depend on the other model (its flips against `ar` are counted)."""
    import swiftdecode
    from swiftdecode.runtime.fastpath import FastLinear, info_of

    quant, tok = smollm
    floats, _ = swiftdecode.load("smollm2-135m", weights="fp32", fast_path="torch", progress=False)
    assert info_of(floats).kernel is None and info_of(quant).kernel is not None
    assert not any(isinstance(m, FastLinear) for m in floats.modules())
    assert floats.config._attn_implementation == "sdpa"
    prompts = pick_prompts(spec_bench, 1, ["writing", "math_reasoning"])
    on_torch = Generator(floats, tok, method="swift")
    before = [on_torch.generate(encode(on_torch, p), max_new_tokens=32).token_ids for p in prompts]
    mismatches, rounds = compare(quant, Generator(quant, tok, method="swift"), prompts, 48)
    assert not mismatches and rounds > 0, mismatches
    after = [
        Generator(floats, tok, method="swift").generate(encode(on_torch, p), max_new_tokens=32).token_ids
        for p in prompts
    ]
    assert after == before
    flips, _ = compare(floats, Generator(floats, tok, method="swift"), prompts, 32)
    print(f"torch model beside a kernel model: {len(flips)} of {len(prompts)} outputs differ from its ar")


def _assert_methods_match_ar(model, tok) -> None:
    """`swift`, `suffix` and `skip-only` token-identical to `ar` on a prompt that copies and one that does not."""
    prompts = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef fib(n):", "The capital of"]
    for prompt in prompts:
        want = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=48).token_ids
        for method in ("swift", "suffix", "skip-only"):
            got = Generator(model, tok, method=method).generate(prompt, max_new_tokens=48).token_ids
            assert got == want, (method, prompt)


def test_activations_per_256_are_lossless_on_a_real_model():
    """`act_block=256` on SmolLM2-135M's own GGUF blocks: every method token-identical to `ar`, zero tolerance."""
    import swiftdecode

    model, tok = swiftdecode.load("smollm2-135m", act_block=256, progress=False)
    _assert_methods_match_ar(model, tok)


def test_the_amx_build_is_lossless_on_a_real_model(smollm):
    """The AMX build (tiles where the CPU has them, emulated elsewhere) on SmolLM2-135M's own GGUF blocks: every
    method token-identical to `ar`, and `ar` to the default build's `ar`, zero tolerance."""
    from test_qgemm import amx_smollm

    (default, tok), model = smollm, amx_smollm()
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\ndef fib(n):"
    want = Generator(default, tok, method="ar").generate(prompt, max_new_tokens=24).token_ids
    for method in ("ar", "swift", "suffix", "skip-only"):
        assert Generator(model, tok, method=method).generate(prompt, max_new_tokens=24).token_ids == want, method


IQ4_VALUES = IQ4_NL.kvalues  # ggml's kvalues_iq4nl, as gguf's reference dequantization holds them


def iq4_nl_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> IQ4_NL blocks [n, row bytes]: per 32 values d = (the largest magnitude) / -127, each value
    the nearest of d x the codebook (llama.cpp's first guess, without its search)."""
    x = w.reshape(-1, 32)
    d = (x[np.arange(len(x)), np.abs(x).argmax(1)] / -127).astype(np.float16)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1).astype(np.float32), 0)[:, None, None]
    q = np.abs(x[:, :, None] * inv - np.array(IQ4_VALUES, np.float32)).argmin(-1).astype(np.uint8)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], 1).reshape(len(w), -1)


def _two_bit(u: np.ndarray) -> np.ndarray:
    """2-bit codes [blocks, 2, 4, 32] (value 128h + 32j + l) -> [blocks, 64] bytes, at bits 2j of byte 32h + l."""
    return sum(u[:, :, j] << (2 * j) for j in range(4)).reshape(-1, 64).astype(np.uint8)


def q2_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q2_K blocks [n, row bytes]: per 16 values a scale and a min (4-bit against the block's d
    and dmin) spanning their range in 4 steps (llama.cpp's layout, without its search)."""
    x = w.reshape(-1, 16, 16)
    low = np.minimum(x.min(2), 0)
    step = (x.max(2) - low) / 3
    d, dmin = (step.max(1) / 15).astype(np.float16), (-low.min(1) / 15).astype(np.float16)
    sc = np.clip(np.rint(step / np.where(d != 0, d, 1).astype(np.float32)[:, None]), 0, 15)
    mn = np.clip(np.rint(-low / np.where(dmin != 0, dmin, 1).astype(np.float32)[:, None]), 0, 15)
    dl, ml = (d.astype(np.float32)[:, None] * sc)[..., None], (dmin.astype(np.float32)[:, None] * mn)[..., None]
    u = np.clip(np.rint((x + ml) / np.where(dl != 0, dl, 1)), 0, 3).astype(np.uint8).reshape(-1, 2, 4, 32)
    scales = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)).reshape(-1, 16)
    blocks = [scales, _two_bit(u), d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(blocks, 1).reshape(len(w), -1)


def q3_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> Q3_K blocks [n, row bytes]: per 16 values a scale mapping the largest magnitude to -4,
    those 6-bit against the block's d, values rounded to -4..3 (llama.cpp's layout, without its search)."""
    x = w.reshape(-1, 16, 16)
    s = np.take_along_axis(x, np.abs(x).argmax(2)[..., None], 2)[..., 0] / -4  # [blocks, 16] sub-block scales
    d = (np.abs(s).max(1) / 32).astype(np.float16)
    sc = np.clip(np.rint(s / np.where(d != 0, d, 1).astype(np.float32)[:, None]), -32, 31)
    dl = (d.astype(np.float32)[:, None] * sc)[:, :, None]
    u = (np.clip(np.rint(x / np.where(dl != 0, dl, 1)), -4, 3) + 4).astype(np.uint8).reshape(-1, 2, 4, 32)
    qs = _two_bit(u & 3)
    hm = sum((u[:, h, j] >> 2) << (4 * h + j) for h in range(2) for j in range(4))  # bit 2 of value 128h + 32j + l
    s6 = (sc + 32).astype(np.uint8)
    lo = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    hi = sum((s6[:, 4 * g : 4 * g + 4] >> 4) << (2 * g) for g in range(4))
    blocks = [hm.astype(np.uint8), qs, lo, hi.astype(np.uint8), d.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(blocks, 1).reshape(len(w), -1)


def _projections(model):
    """(layer index, projection name, parent module, its QuantLinear, its weight as float32 [n, k]) for each of
    every layer's seven projections."""
    for i, layer in enumerate(model.model.layers):
        attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
        for parent, name in [(layer.self_attn, n) for n in attn] + [(layer.mlp, n) for n in mlp]:
            old = getattr(parent, name)
            yield i, name, parent, old, old.kernel.rows(old.qweight, torch.arange(old.qweight.n)).numpy()


def test_real_weights_in_iq4_nl_q3_k_and_q2_k_are_lossless():
    """SmolLM2-135M's real weights requantized: every layer's projections to IQ4_NL, the down projections (the
    only ones 256-value blocks divide) to Q3_K in even layers and Q2_K in odd ones; the blocks decode (gguf's
    reference) near the weights, and every method is token-identical to `ar` on them, zero tolerance."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    import swiftdecode
    from swiftdecode.kernels.modules import QuantLinear
    from swiftdecode.kernels.qweight import QuantWeight

    model, tok = swiftdecode.load("smollm2-135m", progress=False)
    quantizers = {"IQ4_NL": (iq4_nl_blocks, 0.12), "Q3_K": (q3_k_blocks, 0.25), "Q2_K": (q2_k_blocks, 0.5)}
    for i, name, parent, old, w in _projections(model):
        kind = ("Q2_K" if i % 2 else "Q3_K") if name == "down_proj" else "IQ4_NL"
        quantize, error = quantizers[kind]
        blocks = quantize(w)
        back = dequantize(blocks, GGMLQuantizationType[kind]).reshape(w.shape)
        assert np.linalg.norm(back - w) < error * np.linalg.norm(w), (name, kind)
        new = QuantWeight.from_gguf(kind, blocks, *w.shape)
        setattr(parent, name, QuantLinear(new, old.bias, old.kernel))
    _assert_methods_match_ar(model, tok)


def test_real_weights_in_f16_and_bf16_are_lossless():
    """SmolLM2-135M's real weights as an unquantized file holds them: every projection as F16 values in even
    layers and BF16 in odd ones (the float32 inputs are not quantized on these); every method is token-identical
    to `ar` on them, zero tolerance."""
    from gguf import GGMLQuantizationType

    import swiftdecode
    from swiftdecode.hub.synth import float_bits
    from swiftdecode.kernels.modules import QuantLinear
    from swiftdecode.kernels.qweight import QuantWeight

    model, tok = swiftdecode.load("smollm2-135m", progress=False)
    for i, name, parent, old, w in _projections(model):
        kind = "BF16" if i % 2 else "F16"
        bits = float_bits(w, GGMLQuantizationType[kind])
        new = QuantWeight.from_gguf(kind, bits.view(np.uint8), *w.shape)
        back = old.kernel.rows(new, torch.arange(new.n)).numpy()
        assert np.linalg.norm(back - w) < (1e-2 if i % 2 else 1e-3) * np.linalg.norm(w), (name, kind)
        setattr(parent, name, QuantLinear(new, old.bias, old.kernel))
    _assert_methods_match_ar(model, tok)
