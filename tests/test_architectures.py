"""Each architecture on the native path, on tiny random-weight GGUF files the tests write (hub/synth.py) with the
architecture's real tensor names, metadata and Q4_K_M block formats: our forward against transformers' float32
forward of the same blocks, the native loop against the Python loop bit for bit, k rows against k one-row
forwards bit for bit, and every method token-identical to `ar`."""

from __future__ import annotations

import pytest
import torch

from swiftdecode import Generator
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.model import SwiftModel

NATIVE = ("tiny-qwen3", "tiny-llama3", "tiny-qwen2", "tiny-phi3")  # the shapes whose architectures run natively
# Our forward quantizes each row's activations to int8 per 32 values (as llama.cpp does); transformers dequantizes
# the same blocks to float32 and multiplies in float32. On these files (logits' standard deviation ~0.32) the mean
# difference measured 0.7-1.4% of that spread and the largest 5-14%: the bounds leave room for the seeds' spread.
MEAN_TOLERANCE, MAX_TOLERANCE = 0.03, 0.25  # |ours - HF|, mean and max, over the logits' standard deviation
CLEAR_MARGIN = 0.1  # positions whose HF top token leads the next by this (x std) must pick it here too


@pytest.fixture(scope="module", params=NATIVE)
def tiny(request, tmp_path_factory):
    """(shape name, model folder, GGUF file, (model, tokenizer) on our path) of a tiny random-weight model."""
    import swiftdecode
    from swiftdecode.hub import locate_gguf
    from swiftdecode.hub.synth import write

    folder = tmp_path_factory.mktemp(request.param)
    path = write(request.param, folder / "model.gguf", tokenizer_from=locate_gguf("smollm2-135m", progress=False)[0])
    loaded = swiftdecode.load(str(path), cache_dir=str(folder / "cache"), progress=False)
    entry = locate_gguf(str(path), cache_dir=str(folder / "cache"), progress=False)[1]
    return request.param, entry, path, loaded


def hf_logits(entry, path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 forward of the GGUF's blocks, with our cache entry's config (which adds what its GGUF
    reader leaves out: Phi-3's partial rotary) and Llama 3's rotary factors (`rope_freqs`) applied as llama.cpp
    applies them."""
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(entry)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    factors = [t.data for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    if factors:
        rope = ref.model.rotary_emb
        rope.inv_freq = rope.inv_freq / torch.from_numpy(factors[0].copy()).float()
    with torch.inference_mode():
        return ref.eval()(torch.tensor([ids])).logits[0]


def test_the_architecture_runs_natively_and_close_to_transformers(tiny):
    name, folder, path, (model, _) = tiny
    sm, ids = SwiftModel(model), list(range(300, 340))
    assert sm.layer_loop() == "native", name
    with torch.inference_mode():
        ours = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers)))
    ref = hf_logits(folder, path, ids)
    assert ours.shape == ref.shape and torch.isfinite(ours).all()
    diff, std = (ours - ref).abs(), ref.std()
    assert diff.mean() < MEAN_TOLERANCE * std and diff.max() < MAX_TOLERANCE * std, (name, diff.mean(), diff.max())
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN * std
    assert clear.sum() >= len(ids) // 4 and (ours.argmax(-1) == ref.argmax(-1))[clear].all(), name


def test_native_loop_is_the_python_loops_bits_and_rows_are_batch_invariant(tiny):
    from test_decoder import _forwards

    name, _, _, (model, _) = tiny
    sm = SwiftModel(model)
    (got, got_caches), (want, want_caches) = _forwards(sm, True), _forwards(sm, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
    for a, b in zip(got_caches, want_caches, strict=True):
        assert all(
            torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
            for x, y in zip(a.layers, b.layers, strict=True)
        )
    ids, cache = list(range(1000, 1038)), SwiftCache(sm.n_layers)
    with torch.inference_mode():
        sm.prefill(ids[:30], cache)
        chain = sm.logits(sm.forward(ids[30:], torch.arange(30, 38), torch.ones(8, 8, dtype=torch.bool).tril(), cache))
        cache.truncate(30)
        for i in range(8):
            one = sm.logits(
                sm.forward([ids[30 + i]], torch.tensor([30 + i]), torch.ones(1, 1, dtype=torch.bool), cache)
            )
            assert torch.equal(chain[i], one[0]), (name, i)


def test_every_method_is_token_identical_to_ar(tiny):
    name, _, _, (model, tok) = tiny
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one two"]
    for prompt in prompts:
        want = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=32).token_ids
        for method in ("swift", "suffix", "skip-only"):
            got = Generator(model, tok, method=method).generate(prompt, max_new_tokens=32).token_ids
            assert got == want, (name, method, prompt)


def test_llama3_rotary_frequencies_are_divided_by_the_files_factors(tiny):
    """A Llama 3 GGUF keeps its rotary scaling as `rope_freqs` (llama.cpp's per-frequency divisors); the loaded
    model's rotary uses them (transformers' GGUF reader alone would not; the parity test above reads too few
    positions to tell: the factors change only the slowest frequencies)."""
    from gguf import GGUFReader

    name, entry, path, (model, _) = tiny
    factors = [t.data for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    if not factors:
        pytest.skip(f"{name} has no rope_freqs")
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(entry)).model.rotary_emb.inv_freq
    want = plain / torch.from_numpy(factors[0].copy()).float()
    assert torch.equal(model.model.rotary_emb.inv_freq, want) and (factors[0] > 1).any()
