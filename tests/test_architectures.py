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

# Our forward quantizes each row's activations to int8 per 32 values (as llama.cpp does); transformers dequantizes
# the same blocks to float32 and multiplies in float32. On these files (logits' standard deviation ~0.32) the mean
# difference measured 0.7-1.4% of that spread and the largest 5-14%: the bounds leave room for the seeds' spread.
MEAN_TOLERANCE, MAX_TOLERANCE = 0.03, 0.25  # |ours - HF|, mean and max, over the logits' standard deviation
CLEAR_MARGIN = 0.1  # positions whose HF top token leads the next by this (x std) must pick it here too
# On the same float32 weights only the order of float operations differs: measured max 4e-6 to 7e-6 of the spread.
FLOAT_TOLERANCE = 1e-4  # |ours - HF| max over the logits' standard deviation, lean loop on float32 weights
# F16/BF16 files on the native loop: float inputs too, but keys and values cached in fp16 (measured max: 1.3e-3, 1.5e-3)
HALF_KV_TOLERANCE = 5e-3
F32 = torch.float32


def reference_model(path, config) -> torch.nn.Module:
    """transformers' float32 model of the GGUF's blocks under `config`: read by transformers' GGUF reader, or, for
    an architecture it lacks (SmolLM3, stored as llama's), built from the config and given gguf's dequantized
    blocks under gguf's tensor names, the q/k rows un-permuted by transformers' llama processor."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from swiftdecode.hub.convert import LLAMA_LIKE

    if config.model_type not in LLAMA_LIKE:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=F32)
    model = AutoModelForCausalLM.from_config(config, dtype=F32)
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == config.model_type)
    names, processor = get_tensor_name_map(arch, config.num_hidden_layers), TENSOR_PROCESSORS["llama"](config.to_dict())
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    state = {}
    for hf in model.state_dict():
        base, _, suffix = hf.rpartition(".")
        if (t := tensors.get(f"{names.get_name(base)}.{suffix}")) is not None:
            values = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            values = processor.process(weights=values, name=t.name, tensor_key_mapping={}, parsed_parameters={}).weights
            state[hf] = torch.from_numpy(values.astype("float32"))
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else []), missing
    return model


def hf_logits(entry, path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 forward of the GGUF's blocks, with our cache entry's config (which adds what its GGUF
    reader leaves out: Phi-3's partial rotary) and Llama 3's rotary factors (`rope_freqs`) applied as llama.cpp
    applies them."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    ref = reference_model(path, AutoConfig.from_pretrained(entry))
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


def test_the_lean_loop_on_float_weights_is_transformers_forward(tiny):
    """The lean loop (Python, on the fast path's float32 kernels) over the same float32 weights as transformers'
    model gives its logits to float rounding: the architecture's anatomy (norms, rotary tables, NoPE and
    sliding-window layers, activation) is transformers', which the int8 rows' noise on the quantized path would
    hide (a NoPE layer given rotary moved the quantized parity 0.3% of the spread, here 1000x the bound)."""
    from transformers import AutoConfig

    from swiftdecode.runtime import fastpath

    name, entry, path, _ = tiny
    config, ids = AutoConfig.from_pretrained(entry), list(range(300, 340))
    ref, ours = (reference_model(path, config).eval() for _ in range(2))
    fastpath.accelerate(ours)
    sm = SwiftModel(ours)
    if sm.layer_loop() != "python":
        pytest.skip(f"{name}: no fast path here")
    with torch.inference_mode():
        got, want = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers))), ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max() < FLOAT_TOLERANCE * want.std(), (name, (got - want).abs().max() / want.std())


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
    _assert_chain_is_one_row_forwards(sm, name)


def _assert_chain_is_one_row_forwards(sm: SwiftModel, name: str) -> None:
    """An 8-token chain's logits are the bits of 8 one-token forwards on the same 30-token cache."""
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
    _assert_methods_match_ar(model, tok, name)


def _assert_methods_match_ar(model, tok, name: str) -> None:
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one two"]
    for prompt in prompts:
        want = Generator(model, tok, method="ar").generate(prompt, max_new_tokens=32).token_ids
        for method in ("swift", "suffix", "skip-only"):
            got = Generator(model, tok, method=method).generate(prompt, max_new_tokens=32).token_ids
            assert got == want, (name, method, prompt)


@pytest.mark.parametrize("tiny", ["tiny-qwen3"], indirect=True)
def test_activations_per_256_values_keep_every_invariant(tiny):
    """`act_block=256` (int8 activation scales per 256 values, llama.cpp's Q8_K) takes effect in every product,
    stays near transformers' float32 forward, and keeps what the default keeps: k rows are k one-row forwards bit
    for bit, and every method is token-identical to `ar`."""
    import swiftdecode
    from swiftdecode.kernels.modules import QuantLinear

    name, entry, path, (model32, _) = tiny
    model, tok = swiftdecode.load(str(path), cache_dir=str(path.parent / "cache"), act_block=256, progress=False)
    assert {m.kernel.act for m in model.modules() if isinstance(m, QuantLinear)} == {256}
    assert "int8 activations per 256" in model.fast_path.reason
    sm, ids = SwiftModel(model), list(range(300, 340))
    with torch.inference_mode():
        ours = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers)))
        default = SwiftModel(model32).logits(SwiftModel(model32).prefill(ids, SwiftCache(sm.n_layers)))
    ref = hf_logits(entry, path, ids)
    assert not torch.equal(ours, default)
    assert (ours - ref).abs().mean() < MEAN_TOLERANCE * ref.std()
    _assert_chain_is_one_row_forwards(sm, name)
    _assert_methods_match_ar(model, tok, name)


@pytest.mark.parametrize("tiny", ["tiny-gemma2"], indirect=True)
def test_gemma2_soft_caps_are_transformers(tiny):
    """Gemma 2's caps of the attention scores and the final logits are read from the file (llama.cpp's keys) and,
    set small enough to bend this file's scores (~0.1) and logits (up to ~1.2), applied as transformers' eager
    forward applies them: the native loop stays within the parity bounds of transformers under the same caps, its
    logits within the final cap, and well outside the bounds of transformers capping the logits alone (the file's
    own caps, 50 and 30, barely touch random weights); k rows stay k one-row forwards bit for bit."""
    from transformers import AutoConfig

    name, entry, path, (model, _) = tiny
    config, ids = AutoConfig.from_pretrained(entry), list(range(300, 340))
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.query_pre_attn_scalar == config.head_dim == 64  # llama.cpp's query scale below 27B
    caps = {"attn_logit_softcapping": 0.02, "final_logit_softcapping": 0.5}
    published = {k: getattr(model.config, k) for k in caps}
    refs = []
    try:
        for key, cap in caps.items():
            setattr(model.config, key, cap)
        sm = SwiftModel(model)  # reads the caps
        with torch.inference_mode():
            ours = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers)))
            config.final_logit_softcapping = caps["final_logit_softcapping"]
            for attn_cap in (caps["attn_logit_softcapping"], published["attn_logit_softcapping"]):
                config.attn_logit_softcapping = attn_cap
                refs.append(reference_model(path, config).eval()(torch.tensor([ids])).logits[0])
        _assert_chain_is_one_row_forwards(sm, name)
    finally:
        for key, cap in published.items():
            setattr(model.config, key, cap)
    (ref, logits_capped_only), std = refs, refs[0].std()
    assert sm.layer_loop() == "native" and ours.abs().max() <= 0.5
    assert (ours - ref).abs().mean() < MEAN_TOLERANCE * std and (ours - ref).abs().max() < MAX_TOLERANCE * std
    assert (ours - logits_capped_only).abs().mean() > 3 * MEAN_TOLERANCE * std  # measured 0.017 against 0.11


@pytest.mark.parametrize("tiny", ["tiny-llama3"], indirect=True)
def test_llama3_rotary_frequencies_are_divided_by_the_files_factors(tiny):
    """A Llama 3 GGUF keeps its rotary scaling as `rope_freqs` (llama.cpp's per-frequency divisors); the loaded
    model's rotary uses them (transformers' GGUF reader alone would not; the parity test above reads too few
    positions to tell: the factors change only the slowest frequencies)."""
    from gguf import GGUFReader

    _, entry, path, (model, _) = tiny
    factors = [t.data for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(entry)).model.rotary_emb.inv_freq
    want = plain / torch.from_numpy(factors[0].copy()).float()
    assert torch.equal(model.model.rotary_emb.inv_freq, want) and (factors[0] > 1).any()


@pytest.mark.parametrize("tiny", ["tiny-llama3", "tiny-phi3", "tiny-gemma2"], indirect=True)
def test_float32_weights_keep_what_the_gguf_reader_drops(tiny):
    """`--weights fp32` builds its model under the config our reading completes (Phi-3's partial rotary and
    LongRoPE factors, Gemma 2's caps and query scale; eager attention, which Gemma 2 needs) and applies Llama 3's
    rotary factors, as the quantized path does: the same frequencies and fields."""
    import swiftdecode

    name, _, path, (model, _) = tiny
    f32, _ = swiftdecode.load(str(path), cache_dir=str(path.parent / "cache"), weights="fp32", progress=False)
    assert torch.equal(f32.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq), name
    fields = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window")
    assert all(getattr(f32.config, f, None) == getattr(model.config, f, None) for f in fields), name


@pytest.mark.parametrize("tiny", ["tiny-gemma3"], indirect=True)
def test_gemma3_global_layers_scale_their_rotary_by_the_files_factor(tiny):
    """Gemma 3 4B and up: the file's linear factor (which transformers' GGUF reader drops) divides the global
    layers' frequencies, as llama.cpp's frequency scale does; the sliding layers' keep their own base."""
    _, _, _, (model, _) = tiny
    rope, dim = model.model.rotary_emb, model.config.head_dim
    base = lambda theta: 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    torch.testing.assert_close(rope.full_attention_inv_freq, base(1e6) / 8)
    torch.testing.assert_close(rope.sliding_attention_inv_freq, base(1e4))


@pytest.mark.parametrize("tiny", ["tiny-smollm3"], indirect=True)
def test_smollm3_layers_without_rotary_are_llama_cpps(tiny):
    """SmolLM3's every 4th layer has no rotary (llama.cpp fixes it: (il + 1) % 4 == 0, no GGUF key), and its q/k
    rows are stored permuted as llama's. A token alone in its cache attends to itself only, so each layer's input
    is the same at any position: a layer without rotary caches the same key bits at positions 0 and 7, the others
    do not. (The parity test cannot tell: on random weights rotary moves the logits less than int8 rows do.)"""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from swiftdecode.runtime.quantized import _processor

    model = tiny[3][0]
    sm, one = SwiftModel(model), torch.ones(1, 1, dtype=torch.bool)
    keys = []
    for position in (0, 7):
        cache = SwiftCache(sm.n_layers)
        sm.forward([1234], torch.tensor([position]), one, cache)
        keys.append([layer.keys.clone() for layer in cache.layers])
    rotated = [int(not torch.equal(a, b)) for a, b in zip(*keys, strict=True)]
    assert rotated == model.config.no_rope_layers == [int((i + 1) % 4 != 0) for i in range(sm.n_layers)]
    assert type(_processor("smollm3", model.config)) is TENSOR_PROCESSORS["llama"]


def test_windowed_masks_are_the_transformers_paths():
    """lean.windowed (the sliding layers' masks, from a forward's masks) hides what attention_mask(window=...)
    hides on the transformers path: a tree's rows at depth positions over a cache, some entries not visible."""
    from swiftdecode.runtime.lean import windowed
    from swiftdecode.runtime.tree import Tree, attention_mask

    tree = Tree(root=5)
    for token, parent in ((1, -1), (2, -1), (3, 0), (4, 2), (6, 3)):
        tree.add(token, parent, "test")
    prefix, positions, allowed = 40, tree.positions(40), tree.ancestry()
    for visible in (prefix, torch.tensor([40, 38, 40, 30, 40, 40])):
        full = attention_mask(positions, prefix, visible, allowed, F32)[0, 0]
        for window in (1, 3, 16, 64):
            want = attention_mask(positions, prefix, visible, allowed, F32, window)[0, 0]
            assert torch.equal(windowed(full, positions, window), want), (visible, window)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k_m", "iq4_xs"])
def test_low_bit_formats_run_natively_close_to_transformers(fmt, tmp_path):
    """Q2_K, Q3_K_M and IQ4_XS files (llama.cpp's mixes: Q2_K with Q3_K, Q3_K with Q4_K/Q5_K, IQ4_XS with Q5_K;
    Q6_K heads) keep every projection in its own blocks on the native loop, stay within the parity bounds of
    transformers' float32 forward of the same blocks, and keep the invariants: k rows are k one-row forwards bit
    for bit, and every method is token-identical to `ar`."""
    import swiftdecode
    from swiftdecode.hub import locate_gguf
    from swiftdecode.hub.synth import write
    from swiftdecode.kernels.modules import QuantLinear

    tokenizer = locate_gguf("smollm2-135m", progress=False)[0]
    path = write("tiny-llama3", tmp_path / f"{fmt}.gguf", fmt, tokenizer_from=tokenizer)
    model, tok = swiftdecode.load(str(path), cache_dir=str(tmp_path / "cache"), progress=False)
    kinds = {m.qweight.kind for m in model.modules() if isinstance(m, QuantLinear)}
    assert kinds >= {"q2_k": {"Q2_K", "Q3_K"}, "q3_k_m": {"Q3_K", "Q4_K", "Q5_K"}, "iq4_xs": {"IQ4_XS"}}[fmt], kinds
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())  # nothing dequantized
    sm, ids = SwiftModel(model), list(range(300, 340))
    assert sm.layer_loop() == "native"
    with torch.inference_mode():
        ours = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers)))
    ref = hf_logits(locate_gguf(str(path), cache_dir=str(tmp_path / "cache"), progress=False)[1], path, ids)
    diff, std = (ours - ref).abs(), ref.std()
    assert diff.mean() < MEAN_TOLERANCE * std and diff.max() < MAX_TOLERANCE * std, (fmt, diff.mean(), diff.max())
    _assert_chain_is_one_row_forwards(sm, fmt)
    _assert_methods_match_ar(model, tok, fmt)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_float_files_run_natively_at_float_precision(fmt, tmp_path):
    """F16 and BF16 files (every matrix 16-bit, as convert_hf_to_gguf.py writes them) keep their values at 2 bytes
    on the native loop; with float32 inputs (no int8 activations) the forward is far closer to transformers'
    float32 one than on block formats (the fp16 KV cache is the difference), and the invariants hold as there."""
    import swiftdecode
    from swiftdecode.hub import locate_gguf
    from swiftdecode.hub.synth import write
    from swiftdecode.kernels.modules import QuantEmbedding, QuantLinear

    tokenizer = locate_gguf("smollm2-135m", progress=False)[0]
    path = write("tiny-llama3", tmp_path / f"{fmt}.gguf", fmt, tokenizer_from=tokenizer)
    model, tok = swiftdecode.load(str(path), cache_dir=str(tmp_path / "cache"), progress=False)
    kinds = {m.qweight.kind for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)}
    assert kinds == {fmt.upper()}, kinds
    sm, ids = SwiftModel(model), list(range(300, 340))
    assert sm.layer_loop() == "native"
    with torch.inference_mode():
        ours = sm.logits(sm.prefill(ids, SwiftCache(sm.n_layers)))
    ref = hf_logits(locate_gguf(str(path), cache_dir=str(tmp_path / "cache"), progress=False)[1], path, ids)
    assert (ours - ref).abs().max() < HALF_KV_TOLERANCE * ref.std(), (fmt, (ours - ref).abs().max() / ref.std())
    _assert_chain_is_one_row_forwards(sm, fmt)
    _assert_methods_match_ar(model, tok, fmt)


def test_tensors_without_a_kernel_are_named_at_load(tmp_path, monkeypatch, capsys):
    """A file's matrices of a type the kernel lacks are dequantized to float32, and the load says which and what
    that costs (here Q6_K taken out of the kernel's formats: a tiny Q4_K_M file's embedding and its Q6_K layers)."""
    import swiftdecode
    from swiftdecode.apps.doctor import weight_format
    from swiftdecode.hub import locate_gguf
    from swiftdecode.hub.synth import write
    from swiftdecode.kernels import qweight
    from swiftdecode.kernels.gguf_index import read_index
    from swiftdecode.runtime import quantized

    path = write("tiny-llama3", tmp_path / "m.gguf", tokenizer_from=locate_gguf("smollm2-135m", progress=False)[0])
    without = {k: v for k, v in quantized.FORMATS.items() if k != "Q6_K"}
    monkeypatch.setattr(quantized, "FORMATS", without)  # the load's message
    monkeypatch.setattr(qweight, "FORMATS", without)  # what the kernel takes
    model, tok = swiftdecode.load(str(path), cache_dir=str(tmp_path / "cache"), progress=False)
    err = capsys.readouterr().err
    six = [t for t in read_index(path)[1] if t.tensor_type.name == "Q6_K"]  # embedding, some attn_v and ffn_down
    gb = sum(4 * t.n_rows * int(t.shape[0]) for t in six) / 1e9
    assert f"m.gguf: no quantized kernel for Q6_K x{len(six)} " in err and f"float32 ({gb:.1f} GB)" in err, err
    assert Generator(model, tok, method="ar").generate("one two", max_new_tokens=4).token_ids
    layers = [t for t in six if t.name.startswith("blk.")]  # the embedding is a lookup, not a product
    assert f", float32 x{len(layers) + 1} (GGUF types without a kernel" in weight_format(model)  # + the tied head
