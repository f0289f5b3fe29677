"""The native layer loop (csrc/decoder.cpp): the same bits as the Python loop it replaces, and its SiLU kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.lean import rotary
from swiftdecode.runtime.model import SwiftModel
from swiftdecode.runtime.skip import SkipSet
from swiftdecode.runtime.tree import attention_mask


def test_silu_mul_matches_torch_and_every_isa_build_agrees(fp32_builds):
    kernels = fp32_builds
    if not kernels:
        pytest.skip("no fp32 kernel here")
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 15, 16, 17, 1536, 70001):  # ragged tails, one vector, the parallel size
        gate, up = torch.randn(n, generator=g) * 6, torch.randn(n, generator=g)
        gate[:3] = torch.tensor([-100.0, 100.0, 0.0])[: min(n, 3)]  # exp's clamp, saturation, zero
        want = F.silu(gate) * up
        outs = [k.silu_mul(gate.clone(), up) for k in kernels]
        torch.testing.assert_close(outs[0], want, rtol=2e-6, atol=1e-7)
        assert all(torch.equal(o, outs[0]) for o in outs), f"ISA builds differ at n={n}"


@torch.inference_mode()
def _forwards(sm: SwiftModel, native: bool) -> tuple[list[torch.Tensor], list[SwiftCache]]:
    """Prefill, a layer-skipped draft chain, a full step, and two sequences batched in one pass."""
    observe = None if native else (lambda i, before, after: None)  # an observer keeps the Python loop
    first, other = SwiftCache(sm.n_layers), SwiftCache(sm.n_layers)
    outs = [sm.prefill(list(range(200, 260)), first, observe)]
    n, chain = first.length, torch.ones(3, 3, dtype=torch.bool).tril_()
    skip = SkipSet(attn=frozenset({2, 5}), mlp=frozenset({3, 5}))
    outs.append(sm.forward([7, 8, 9], torch.arange(n, n + 3), chain, first, skip=skip, observe=observe))
    one = torch.ones(1, 1, dtype=torch.bool)
    outs.append(sm.forward([10], torch.arange(n + 3, n + 4), one, first, observe=observe))
    sm.prefill(list(range(500, 530)), other, observe)
    parts = [(c, [11, 12], torch.ones(2, 2, dtype=torch.bool).tril_()) for c in (first, other)]
    masks = [
        attention_mask(torch.arange(c.length, c.length + 2), c.length, c.length, a, sm.dtype)[0, 0] for c, _, a in parts
    ]
    positions = torch.cat([torch.arange(c.length, c.length + 2) for c, _, _ in parts])
    ids = torch.tensor([t for _, ids, _ in parts for t in ids])
    outs.append(sm.lean.forward(ids, positions, masks, [first, other], SkipSet(), sm._lean_kernel(), observe))
    return outs, [first, other]


@pytest.mark.parametrize("name", ["smollm", "qwen"])
def test_native_layers_return_the_python_loops_bits(request, name):
    """Hidden states, cache lengths and cache contents of the native loop equal the Python loop's bit for bit
    (prefill, a skip draft that leaves some layers short, a full step, a two-sequence batch)."""
    model, _ = request.getfixturevalue(name)
    sm = SwiftModel(model)
    kernel = sm._lean_kernel()
    if kernel is None or sm.lean._native(kernel) is None:
        pytest.skip("no native layer loop on this path")
    (got, got_caches), (want, want_caches) = _forwards(sm, True), _forwards(sm, False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"forward {i}: max diff {(a - b).abs().max()}"
    for a, b in zip(got_caches, want_caches, strict=True):
        assert [layer.length for layer in a.layers] == [layer.length for layer in b.layers]
        assert all(
            torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
            for x, y in zip(a.layers, b.layers, strict=True)
        )
    assert len({layer.length for layer in got_caches[0].layers}) == 2  # the draft's skipped layers stayed short
    assert got_caches[0].layers[0].keys.dtype == torch.float16  # quantized weights: fp16 keys and values


def test_float_projections_keep_the_python_loop(smollm_fp32):
    sm = SwiftModel(smollm_fp32[0])
    kernel = sm._lean_kernel()
    if kernel is None:
        pytest.skip("fast path unavailable here")
    assert sm.lean._native(kernel) is None


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "amx"])
def test_a_named_isa_runs_every_kernel_of_that_build_with_the_same_bits(smollm, isa):
    """fast_path "skinny-avx2" (what an AVX2-only CPU runs) picks the quantized kernel's AVX2 build,
    "skinny-avxvnni" its AVX-VNNI build (float kernels: AVX2) and "skinny-amx" its AMX build (tiles;
    float kernels: AVX-512); a whole quantized model's logits are the same bits as on the default path: outputs do
    not depend on the CPU."""
    import swiftdecode
    from swiftdecode.kernels.build import KernelUnavailable
    from swiftdecode.kernels.fp32 import FLOAT_BUILD_OF
    from swiftdecode.kernels.modules import QuantLinear
    from swiftdecode.kernels.qgemm import load_qkernel

    try:
        load_qkernel(isa)
    except KernelUnavailable as e:
        pytest.skip(f"no {isa} build runs here: {e}")
    model, _ = swiftdecode.load("smollm2-135m", fast_path=f"skinny-{isa}", progress=False)
    assert {m.kernel.isa for m in model.modules() if isinstance(m, QuantLinear)} == {isa}
    assert model.fast_path.kernel.isa == FLOAT_BUILD_OF.get(isa, isa) and model.fast_path.path == f"skinny-{isa}"
    outs = []
    for m in (smollm[0], model):
        sm = SwiftModel(m)
        outs.append(sm.logits(sm.prefill(list(range(300, 340)), SwiftCache(sm.n_layers))))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["smollm", "qwen"])
def test_rotary_tables_are_hfs_formula_rounded_from_float64(request, name):
    """The lean forward's cos/sin tables: HF's rotary formula (within float32 rounding of HF's own tables), each
    value the float64 evaluation rounded to float32, and the same bits on every call (torch's float32 cos once
    returned a table 1.5e-4 off in a process's first forward)."""
    model, _ = request.getfixturevalue(name)
    rope = model.get_decoder().rotary_emb
    positions = torch.cat([torch.arange(0, 70), torch.tensor([511, 4095, 4096, 30000])])
    x = torch.zeros(len(positions), 8)
    cos, sin = rotary(rope, x, positions)
    hf_cos, hf_sin = (t[0].float() for t in rope(x[None], positions[None]))
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=2e-7)
    angles = (positions.float()[:, None] * rope.inv_freq.float()[None, :]).double()
    angles = torch.cat((angles, angles), -1)
    assert torch.equal(cos, angles.cos().float() * rope.attention_scaling)
    assert torch.equal(sin, angles.sin().float() * rope.attention_scaling)
    again = rotary(rope, x, positions)
    assert torch.equal(again[0], cos) and torch.equal(again[1], sin)
