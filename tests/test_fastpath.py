"""Fast path: the skinny-GEMM kernel against torch, its batch invariance, patching and fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swiftdecode.base.errors import UserError
from swiftdecode.kernels import fp32
from swiftdecode.kernels.fp32 import KernelUnavailable, load_kernel
from swiftdecode.runtime.fastpath import FastLinear, accelerate


@pytest.fixture(scope="module")
def kernel():
    try:
        return load_kernel()
    except KernelUnavailable as e:
        pytest.skip(f"kernel unavailable here: {e}")


@pytest.fixture(scope="module", params=sorted(fp32.ISA_FLAGS))
def any_kernel(request):
    """Every kernel variant this CPU can run (AVX-512 and AVX2 on this machine)."""
    try:
        return load_kernel(request.param)
    except KernelUnavailable as e:
        pytest.skip(f"{request.param} kernel unavailable here: {e}")


SHAPES = [(64, 96), (100, 77), (513, 576), (37, 1536)]  # (N, K): aligned, ragged tails, odd N


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch(any_kernel, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for m in list(range(1, 33)) + [64, 70, 130]:  # 70, 130: several 64-row passes
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(any_kernel.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_kernel_is_batch_invariant(any_kernel):
    """Row i of an M-row product is bit-identical to the 1-row product, for every M and every i."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(301, 583, generator=g), torch.randn(301, generator=g)
    x = torch.randn(70, 583, generator=g)
    alone = torch.cat([any_kernel.linear(x[i : i + 1], w, b) for i in range(len(x))])
    for m in [2, 3, 4, 5, 6, 7, 8, 12, 16, 31, 32, 64, 70]:
        for start in (0, len(x) - m):
            got = any_kernel.linear(x[start : start + m], w, b)
            assert torch.equal(got, alone[start : start + m]), f"M={m} start={start}"


@pytest.mark.parametrize("n,k", [(64, 96), (512, 77), (48, 1536)])
def test_transposed_kernel_matches_torch_and_is_batch_invariant(any_kernel, n, k):
    """The MLP layout (weight stored [K, N]): equal to torch to rounding, each row bit-identical to the 1-row
    product, with every path (one row, L1 accumulators, register tiles) and with a bias."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    wt = w.t().contiguous()
    x = torch.randn(130, k, generator=g)
    alone = torch.cat([any_kernel.linear_t(x[i : i + 1], wt, b) for i in range(len(x))])
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)
    for m in [2, 3, 5, 8, 16, 17, 23, 24, 25, 32, 64, 130]:
        for start in (0, len(x) - m):
            assert torch.equal(any_kernel.linear_t(x[start : start + m], wt, b), alone[start : start + m]), m


def test_sparse_kernel_treats_small_inputs_as_zero(any_kernel):
    """With a threshold, inputs with |x| <= thr count as zero: bit-identical to the dense product of the masked
    input, row by row whatever the other rows select (what makes one-forward matchness exact)."""
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(96, 300, generator=g), torch.randn(96, generator=g)
    wt = w.t().contiguous()
    x = torch.randn(9, 300, generator=g)
    for thr in (0.3, 1.0, 2.5):
        masked = torch.where(x.abs() > thr, x, 0.0)
        got = any_kernel.linear_t(x, wt, b, thr)
        assert torch.equal(got, any_kernel.linear_t(masked, wt, b))
        assert all(torch.equal(any_kernel.linear_t(x[i : i + 1], wt, b, thr), got[i : i + 1]) for i in range(9))
        torch.testing.assert_close(got, F.linear(masked, w, b), rtol=1e-5, atol=1e-4)
    assert not torch.equal(any_kernel.linear_t(x, wt, b, 1.0), any_kernel.linear_t(x, wt, b))


def test_kernel_shapes_and_threads(kernel):
    w = torch.randn(40, 33)
    x = torch.randn(2, 3, 33)
    y = kernel.linear(x, w, None)
    assert y.shape == (2, 3, 40)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.linear(x, w, None), y)  # the thread split does not change results
    finally:
        torch.set_num_threads(threads)


def reference_attention(q, k, v, mask, scale):
    """q [H, M, D], k/v [Hkv, T, D], additive mask [M, T] -> [M, H, D] in float64."""
    g = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    p = torch.softmax(q.double() @ k.transpose(1, 2) * scale + mask.double(), -1)
    return (p @ v).transpose(0, 1)


@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (12, 2, 128), (4, 4, 40), (2, 1, 256)])  # D = 4 or 8 vectors: unrolled
def test_attention_matches_reference(any_kernel, h, hkv, d):
    kernel = any_kernel
    g = torch.Generator().manual_seed(d)
    t, m = 90, 7
    q = torch.randn(m, h, d, generator=g).transpose(0, 1)  # strided like HF's [H, M, D] view
    k, v = torch.randn(hkv, t, d, generator=g), torch.randn(hkv, t, d, generator=g)
    causal = torch.ones(m, t, dtype=torch.bool).tril(t - m)
    tree = causal & (torch.rand(m, t, generator=g) > 0.3)
    tree[:, 0] = True
    for visible in (causal, tree):
        mask = torch.zeros(m, t).masked_fill_(~visible, torch.finfo(torch.float32).min)
        want = reference_attention(q, k, v, mask, d**-0.5)
        got = kernel.attention(q, k, v, mask, d**-0.5)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    none = kernel.attention(q, k, v, None, d**-0.5)  # no mask: causal with keys aligned at the end
    assert torch.equal(none, kernel.attention(q, k, v, torch.where(causal, 0.0, float("-inf")), d**-0.5))


@pytest.mark.parametrize("d", [64, 128, 40])  # unrolled (4 or 8 AVX-512 vectors) and the generic loop
def test_fp16_keys_and_values_are_widened_exactly(any_kernel, d):
    """attention_many over fp16 keys/values returns the bits it returns over their fp32 values, for two
    sequences of different lengths batched together; any ISA build."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(5, 6, d, generator=g)  # sequence 0: 3 rows, sequence 1: 2 rows
    ks = [torch.randn(2, t, d, generator=g).half() for t in (37, 70)]
    vs = [torch.randn(2, t, d, generator=g).half() for t in (37, 70)]
    masks = [
        torch.zeros(m, t).masked_fill_(torch.rand(m, t, generator=g) > 0.8, float("-inf"))
        for m, t in ((3, 37), (2, 70))
    ]
    half = any_kernel.attention_many(q, ks, vs, masks, [3, 2], d**-0.5)
    full = any_kernel.attention_many(q, [k.float() for k in ks], [v.float() for v in vs], masks, [3, 2], d**-0.5)
    assert torch.equal(half, full)
    with pytest.raises(ValueError, match="all be fp32 or all fp16"):
        any_kernel.attention_many(q, [ks[0], ks[1].float()], vs, masks, [3, 2], d**-0.5)


def test_attention_many_is_each_sequence_alone_at_any_thread_count(kernel):
    """Sequences of unequal lengths and rows batched together (the threads split them by cost): each one's rows
    are the bits `attention` returns for that sequence alone, with 1, 2 or 3 threads."""
    g = torch.Generator().manual_seed(5)
    lens, rows = (9, 300, 41, 700, 130), (1, 3, 2, 1, 4)
    ks = [torch.randn(3, t, 64, generator=g).half() for t in lens]
    vs = [torch.randn(3, t, 64, generator=g).half() for t in lens]
    masks = [torch.zeros(m, t) for m, t in zip(rows, lens, strict=True)]
    for mask in masks:
        mask.masked_fill_(torch.rand(mask.shape, generator=g) > 0.6, float("-inf"))
    for mask in masks:
        mask[:, 0] = 0.0
    q = torch.randn(sum(rows), 9, 64, generator=g)
    alone = [
        kernel.attention(part.transpose(0, 1), k.float(), v.float(), mask, 0.125)
        for part, k, v, mask in zip(q.split(rows), ks, vs, masks, strict=True)
    ]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(kernel.attention_many(q, ks, vs, masks, list(rows), 0.125), torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("d", [24, 40, 64, 72, 128])  # whole 16-lane chunks, and 8-wide halves past them
def test_attention_is_the_same_bits_on_every_isa_build(fp32_builds, d):
    """Scores are summed in 16 lanes on every build, so AVX2 and AVX-512 machines compute the same attention."""
    builds = fp32_builds
    if len(builds) < 2:
        pytest.skip("this CPU runs one ISA build only")
    g = torch.Generator().manual_seed(d)
    q = torch.randn(4, 6, d, generator=g)
    for dtype in (torch.float32, torch.float16):
        k, v = (torch.randn(2, 53, d, generator=g).to(dtype) for _ in range(2))  # 53 keys: 16-key blocks and a tail
        mask = torch.zeros(4, 53).masked_fill_(torch.rand(4, 53, generator=g) > 0.7, float("-inf"))
        outs = [b.attention_many(q, [k], [v], [mask], [4], d**-0.5) for b in builds]
        assert all(torch.equal(o, outs[0]) for o in outs), f"ISA builds differ at d={d}, {dtype}"


def test_attention_is_invariant_to_rows_and_masked_keys(kernel):
    """A row's output depends only on its visible keys in order: not on other rows or masked keys between."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(6, 5, 64, generator=g),
        torch.randn(2, 50, 64, generator=g),
        torch.randn(2, 50, 64, generator=g),
    )
    visible = torch.rand(5, 50, generator=g) > 0.4
    mask = torch.zeros(5, 50).masked_fill_(~visible, float("-inf"))
    together = kernel.attention(q, k, v, mask, 0.125)
    for i in range(5):
        keep = visible[i].nonzero().flatten()
        alone = kernel.attention(q[:, i : i + 1], k[:, keep], v[:, keep], torch.zeros(1, len(keep)), 0.125)
        assert torch.equal(alone[0], together[i])


def tiny_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False), nn.Linear(40, 48))
    return model.to(dtype)


def test_torch_mode_leaves_modules_unpatched():
    model = tiny_model()
    info = accelerate(model, "torch")
    assert info.path == "torch" and "requested" in info.reason
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_accelerate_patches_in_place_and_restores(kernel):
    model = tiny_model()
    x = torch.randn(3, 5, 48)
    with torch.inference_mode():
        want = model(x)
        info = accelerate(model, "auto")
        assert info.path == f"skinny-{kernel.isa}" and info.patched == 3
        assert all(type(m) is FastLinear for m in model.modules() if isinstance(m, nn.Linear))
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
        ptrs = [m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)]
        accelerate(model, "torch")
    assert ptrs == [m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)]  # no copies
    assert not any(isinstance(m, FastLinear) for m in model.modules())


def test_grad_and_other_dtypes_use_torch(kernel):
    model = tiny_model()
    accelerate(model, "auto")
    y = model(torch.randn(2, 48))  # grad enabled, weights require grad: torch's autograd path
    assert y.grad_fn is not None
    y.sum().backward()
    assert model[0].weight.grad is not None
    model.double()  # still FastLinear, now float64: torch's path
    with torch.no_grad():
        x = torch.randn(2, 48, dtype=torch.float64)
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_fallbacks_and_errors(monkeypatch):
    bf16 = tiny_model(torch.bfloat16)
    info = accelerate(bf16, "auto")
    assert info.path == "torch" and "float32" in info.reason
    with pytest.raises(UserError):
        accelerate(bf16, "skinny")
    with pytest.raises(UserError, match="unknown fast path"):
        accelerate(tiny_model(), "nope")

    def no_compiler(isa, out_dir=None):
        raise KernelUnavailable("no C++ compiler (g++) on PATH")

    monkeypatch.setattr(fp32, "_KERNELS", {})
    monkeypatch.setattr(fp32, "build_kernel", no_compiler)
    model = tiny_model()
    info = accelerate(model, "auto")
    assert info.path == "torch" and "compiler" in info.reason
    assert not any(isinstance(m, FastLinear) for m in model.modules())


def test_builds_in_a_clean_directory(kernel, tmp_path):
    lib = fp32.build_kernel(kernel.isa, tmp_path)
    assert lib.parent == tmp_path and lib.exists()
    assert fp32.build_kernel(kernel.isa, tmp_path) == lib  # cached: same key, no rebuild
    fresh = fp32.Kernel(kernel.isa, lib)
    x, w = torch.randn(3, 50), torch.randn(7, 50)
    assert torch.equal(fresh.linear(x, w, None), kernel.linear(x, w, None))


def test_soft_capped_attention_matches_reference_on_every_build(fp32_builds):
    """Soft-capped scores (Gemma 2: softcap * tanh(score / softcap) before the softmax) against torch's formula,
    and the same bits on every ISA build."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 64, generator=g) * 4 for n in (5, 37, 37))
    mask = torch.zeros(5, 37).masked_fill_(torch.rand(5, 37, generator=g) < 0.3, float("-inf"))
    scores = torch.einsum("hmd,htd->hmt", q, k) * 0.125
    want = torch.einsum("hmt,htd->mhd", (torch.tanh(scores / 5.0) * 5.0 + mask).softmax(-1), v)
    outs = [kern.attention(q, k, v, mask, 0.125, softcap=5.0) for kern in fp32_builds]
    torch.testing.assert_close(outs[0], want, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert not torch.allclose(fp32_builds[0].attention(q, k, v, mask, 0.125), want, atol=1e-3)  # the cap bites


def test_gemma2_runs_order_invariant_on_the_fast_path(kernel):
    """Gemma 2 (soft-capped scores, sliding-window layers) on the fast path: transformers' logits, and a chain of 8
    tokens gives the bits of 8 one-token forwards (its attention is the kernel's, soft-capped; a batch runs the
    model's own eager attention)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.model import SwiftModel

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.sliding_window = 2, 1, 32, 8
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 256, (2, 20))  # past the window; a batch of two runs the model's eager attention
    with torch.inference_mode():
        want = model(ids).logits
        accelerate(model)
        got, got_one = model(ids).logits, model(ids[:1]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_one, want[:1], rtol=1e-4, atol=1e-4)
    sm = SwiftModel(model)
    with torch.inference_mode():
        cache = SwiftCache(sm.n_layers)
        sm.prefill(ids[0, :12].tolist(), cache)
        chain = sm.logits(sm.forward(ids[0, 12:].tolist(), torch.arange(12, 20), torch.ones(8, 8).tril().bool(), cache))
        cache.truncate(12)
        for i in range(8):
            one = sm.logits(sm.forward([int(ids[0, 12 + i])], torch.tensor([12 + i]), torch.ones(1, 1).bool(), cache))
            assert torch.equal(chain[i], one[0]), i


def test_smollm2_verify_is_bit_identical_to_decoding(kernel, smollm):
    """With the fast path, a 6-token tree forward (two branches) gives exactly the logits of decoding each
    branch one token at a time: what makes speculative verification reproduce plain greedy decoding."""
    from transformers import DynamicCache

    model, _ = smollm
    accelerate(model, "auto")
    ids = torch.randint(0, model.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(1))
    prefix, new = ids[:, :20], ids[:, 20:]
    parent = [-1, 0, 1, 0, 3, 4]  # branches 0-1-2 and 0-3-4-5
    depth = [0, 1, 2, 1, 2, 3]
    allowed = torch.eye(6, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            allowed[i, p], p = True, parent[p]
    mask = torch.zeros(1, 1, 6, 26).masked_fill_(~torch.cat([torch.ones(6, 20, dtype=torch.bool), allowed], 1), -1e38)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(prefix, cache=cache)
        pos = torch.tensor([[20 + d for d in depth]])
        tree = model(new, cache=cache, attention_mask=mask, position_ids=pos).logits[0]
        for branch in ([0, 1, 2], [0, 3, 4, 5]):
            cache.crop(-(cache.get_seq_length() - 20))
            steps = [model(new[:, i : i + 1], cache=cache).logits[0, 0] for i in branch]
            for i, logits in zip(branch, steps, strict=True):
                assert torch.equal(tree[i], logits), f"node {i}: max diff {(tree[i] - logits).abs().max():.2e}"
        at_once = model(ids).logits[0, -1]  # a prompt fed at once == fed in pieces
        cache = DynamicCache(config=model.config)
        model(ids[:, :11], cache=cache)
        pieces = model(ids[:, 11:], cache=cache).logits[0, -1]
        assert torch.equal(at_once, pieces)


def test_smollm2_forward_matches_torch(kernel, smollm_fp32):
    """Full SmolLM2 forward (tied lm_head included): fast path vs torch, 12 new tokens on a 20-token cache."""
    from transformers import DynamicCache

    model, _ = smollm_fp32
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    try:
        for mode in ("torch", "auto"):
            accelerate(model, mode)
            with torch.inference_mode():
                cache = DynamicCache(config=model.config)
                model(ids[:, :20], cache=cache)
                out[mode] = model(ids[:, 20:], cache=cache).logits[0]
    finally:
        accelerate(model, "auto")
    torch.testing.assert_close(out["auto"], out["torch"], rtol=1e-4, atol=1e-3)
    top2 = out["torch"].topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # a near-tie may flip; none expected, reported if it does
    assert clear.all(), f"near-tied positions: {(~clear).nonzero().flatten().tolist()}"
    assert torch.equal(out["auto"].argmax(-1), out["torch"].argmax(-1))


def test_doctor_reports_both_paths(kernel, smollm):
    from swiftdecode.apps.doctor import KS, diagnose, format_report

    model, _ = smollm
    d = diagnose(model, "auto", context=8, repeats=1)
    assert d["path"] == f"skinny-{kernel.isa}" and set(d["paths"]) == {"torch", d["path"]}
    assert set(d["forward_ms"]) == set(KS) and d["weight_format"].startswith("quantized Q")
    assert d["bandwidth_gbs"] > 0 and d["effective_gbs"] > 0
    assert all(type(m) is FastLinear for m in model.modules() if isinstance(m, nn.Linear))  # left accelerated
    assert d["layers"] == "native" and "native loop" in format_report(d)  # every projection of SmolLM2 is quantized
    assert "AMX tiles:" in format_report(d)
    assert "lossless:" not in format_report(d)  # k rows are k one-row forwards
    assert "speedup" in format_report(d)
    assert d["paths"][d["path"]]["draft_ms"] > 0 and "draft step" in format_report(d)  # half the sublayers skipped
    assert d["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # SmolLM2: 30 layers, keys + values, 3 heads of 64, fp16
    assert d["kv_at_context"] == (8192, 8192 * d["kv_bytes_per_token"])  # its 8,192-token context, no sliding layers
    assert "one sequence at the model's 8,192-token context holds 0.19 GB" in format_report(d)
    r = d["roofline"]  # SmolLM2's weight products: 30 layers x (q, k, v, o, gate, up, down) + the tied head
    assert r["macs_per_row"] == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576
    assert r["peak_gmacs"] > 0 and r["memory_ms"] == pytest.approx(d["weight_mb"] / d["bandwidth_gbs"])
    assert all(r["compute_ms"][k] == pytest.approx(k * r["compute_ms"][1]) for k in KS)
    assert all(r["over_bound"][k] == pytest.approx(d["forward_ms"][k] / r["bound_ms"][k]) for k in KS)
    assert "roofline:" in format_report(d) and kernel.isa in r["instruction"]
    assert 0 < r["step_gmacs"] and all(r["step_ms"][k] == pytest.approx(k * r["step_ms"][1]) for k in KS)
    assert r["step_ms"][1] == pytest.approx(
        r["macs_per_row"] / r["step_gmacs"] / 1e6
    ) and "inner step" in format_report(d)


def test_amx_detection_follows_the_cpu_flags():
    """AMX tiles count as usable exactly where the CPU reports AMX-INT8 (and Linux then grants this process tile
    data, as it does on the Xeons we meet); elsewhere the reason names what is missing."""
    from swiftdecode.kernels.amx import AMX_FLAGS, amx_status
    from swiftdecode.kernels.build import cpu_flags

    usable, why = amx_status()
    if AMX_FLAGS <= cpu_flags():
        assert usable, why
    else:
        assert not usable and why.startswith("CPU lacks amx")
    assert amx_status() == (usable, why)  # asked once per process


def test_doctor_times_every_build_of_the_quantized_kernel(smollm):
    """`doctor --builds`: k-row forwards to k = 32 on each build this CPU runs (avx2 at least, beside the loaded
    one), and each other build named with why it does not run."""
    import argparse

    from swiftdecode.apps.doctor import BUILD_KS, builds, diagnose, format_report
    from swiftdecode.kernels.build import KernelUnavailable
    from swiftdecode.kernels.qgemm import ISA_CPU_FLAGS, load_qkernel

    model, _ = smollm
    args = argparse.Namespace(model="smollm2-135m", cache_dir=None, weights="gguf", fast_path="auto", act_block=32)
    args.context, args.repeats = 8, 1
    b = builds(args, model)
    runs = set()
    for isa in ISA_CPU_FLAGS:
        try:
            load_qkernel(isa)
            runs.add(f"skinny-{isa}")
        except KernelUnavailable as e:
            assert b["unavailable"][isa] == str(e)
    assert set(b["forward_ms"]) == runs and "skinny-avx2" in runs
    assert all(set(f) == set(BUILD_KS) and min(f.values()) > 0 for f in b["forward_ms"].values())
    report = format_report(diagnose(model, "auto", context=8, repeats=1) | {"builds": b})
    assert all(name in report for name in runs) and "k=32" in report
    assert ("amx / avx512" in report) == ({"skinny-amx", "skinny-avx512"} <= runs)


def test_builds_table_sets_the_tile_build_beside_the_vector_build():
    """Where both ran, `--builds` prints the AMX build's forwards over the AVX-512 build's, k by k."""
    from swiftdecode.apps.doctor import BUILD_KS, builds_lines

    ms = {"skinny-avx512": {k: 10.0 * k for k in BUILD_KS}, "skinny-amx": {k: 12.0 + 5.0 * k for k in BUILD_KS}}
    row = next(line for line in builds_lines({"forward_ms": ms, "unavailable": {}}) if line.startswith("amx /"))
    want = [f"{(12.0 + 5.0 * k) / (10.0 * k):.2f}x" for k in BUILD_KS]
    assert row.split()[3:] == want
    del ms["skinny-amx"]
    assert not any(line.startswith("amx /") for line in builds_lines({"forward_ms": ms, "unavailable": {}}))


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "avx512", "amx"])
def test_peak_rate_scales_with_the_rounds(isa):
    """The instruction's measured peak is a rate: twice the rounds take about twice the time (a loop the compiler
    had folded away would not), so the rate holds."""
    from swiftdecode.kernels.qgemm import load_qkernel

    try:
        q = load_qkernel(isa)
    except KernelUnavailable as e:
        pytest.skip(f"no {isa} build here: {e}")
    a, b = q.peak_macs(1, reps=1 << 18), q.peak_macs(1, reps=1 << 19)
    assert 1e9 < a and 0.5 < a / b < 2.0


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "avx512", "amx"])
def test_inner_step_rate_is_a_rate_below_the_peak(isa):
    """The products' inner step (dot products and float scaling, codes unpacked) runs at a rate: twice the rounds
    take about twice the time, for every format, and it never beats the bare instruction it is built on."""
    from swiftdecode.kernels.qgemm import load_qkernel
    from swiftdecode.kernels.qweight import FLOAT_KINDS, FORMATS

    try:
        q = load_qkernel(isa)
    except KernelUnavailable as e:
        pytest.skip(f"no {isa} build here: {e}")
    peak = q.peak_macs(1)
    for kind, (fmt, *_) in FORMATS.items():
        a, b = q.loop_macs(fmt, 1, reps=1 << 11), q.loop_macs(fmt, 1, reps=1 << 12)
        if kind in FLOAT_KINDS:  # float weights have no integer inner step: no rate
            assert a == b == 0.0, kind
            continue
        assert 1e9 < a < 1.1 * peak and 0.5 < a / b < 2.0, fmt


@pytest.mark.parametrize("name", ["smollm", "qwen", "gemma"])
def test_k_rows_equal_one_row_at_any_thread_count(request, name):
    """On the engine's forward (quantized kernel, native layer loop; Gemma's sliding-window layers too), an 8-token
    chain returns bit-for-bit the logits of 8 one-token forwards, at 1, 2, 3 and 4 threads (norms, rotary and
    activations included)."""
    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.model import SwiftModel

    model, _ = request.getfixturevalue(name)
    sm, ids, threads = SwiftModel(model), list(range(1000, 1038)), torch.get_num_threads()
    try:
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            cache = SwiftCache(sm.n_layers)
            sm.prefill(ids[:30], cache)
            causal = torch.ones(8, 8, dtype=torch.bool).tril()
            chain = sm.logits(sm.forward(ids[30:], torch.arange(30, 38), causal, cache))
            cache.truncate(30)
            for i in range(8):
                single = torch.ones(1, 1, dtype=torch.bool)
                one = sm.logits(sm.forward([ids[30 + i]], torch.tensor([30 + i]), single, cache))
                assert torch.equal(chain[i], one[0]), f"{t} threads, row {i}: {(chain[i] - one[0]).abs().max()}"
    finally:
        torch.set_num_threads(threads)
