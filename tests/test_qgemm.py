"""The quantized kernel (csrc/qgemm.cpp) on every GGUF block format it reads: exact dequantization, one set of
numerics on every ISA, batch invariance, agreement with the float product; and the quantized model path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from swiftdecode.base.config import ACT_BLOCKS, ACT_DEFAULT
from swiftdecode.hub.synth import float_bits
from swiftdecode.kernels.build import KernelUnavailable, build, cpu_flags
from swiftdecode.kernels.qgemm import AMX_EMULATED_FLAGS, ISA_CPU_FLAGS, SOURCES, QKernel, load_qkernel
from swiftdecode.kernels.qweight import FORMATS, QuantWeight

FP16_SCALES = {  # byte offsets of each format's fp16 scale fields within a block
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "Q2_K": (80, 82),
}
FLOATS = ("F16", "BF16")  # 16-bit float values, no blocks


# The AVX-VNNI build's source compiled for AVX-512 VL + VNNI instead (vpdpbusd ymm in its EVEX encoding): the
# same code path, so a CPU with AVX-512 but no AVX-VNNI (AMD Zen 4) tests that build's bits too.
AVXVNNI_AS_EVEX = ["-DSD_AVXVNNI", "-mavx512f", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
AVXVNNI_AS_EVEX_CPU = {"avx512f", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}


def kernels(act: int = ACT_DEFAULT):
    """The qgemm builds this CPU runs, activations quantized per `act` values (the AVX-VNNI build as EVEX code
    where the CPU lacks AVX-VNNI but has AVX-512 VL + VNNI; the AMX build with emulated tiles where the CPU
    lacks AMX but runs the AVX-512 build)."""
    out = []
    for isa in ISA_CPU_FLAGS:
        try:
            out.append(load_qkernel(isa, act))
        except KernelUnavailable:
            if isa == "avxvnni" and AVXVNNI_AS_EVEX_CPU <= cpu_flags():
                flags = [*AVXVNNI_AS_EVEX, f"-DSD_ACT_BLOCKS={act // 32}"]
                out.append(QKernel("avxvnni", build(SOURCES, f"qgemm_avxvnni_evex_a{act}", flags), act))
            if isa == "amx" and ISA_CPU_FLAGS["avx512"] <= cpu_flags():
                flags = [*AMX_EMULATED_FLAGS, f"-DSD_ACT_BLOCKS={act // 32}"]
                out.append(QKernel("amx", build(SOURCES, f"qgemm_amx_emulated_a{act}", flags), act))
    if not out:
        pytest.skip("no qgemm build runs on this CPU")
    return out


def amx_kernel(act: int = ACT_DEFAULT) -> QKernel:
    """The AMX build (real tiles, else emulated), or a skip where neither runs."""
    amx = next((k for k in kernels(act) if k.isa == "amx"), None)
    if amx is None:
        pytest.skip("no AMX build, real or emulated, runs on this CPU")
    return amx


def amx_smollm():
    """SmolLM2-135M on its own GGUF blocks with the AMX build (`amx_kernel`) on the fast path."""
    from swiftdecode.hub.load import locate_gguf
    from swiftdecode.runtime.fastpath import accelerate
    from swiftdecode.runtime.quantized import build as build_model

    model = build_model(*locate_gguf("smollm2-135m", progress=False), amx_kernel(), False)
    assert accelerate(model, "skinny-avx512").path == "skinny-amx"
    return model


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks [n, row bytes] with random codes and sane fp16 scales (F16/BF16: normal values)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    if kind in FLOATS:
        values = rng.normal(0, 0.05, (n, k)).astype(np.float32)
        return float_bits(values, GGMLQuantizationType[kind]).view(np.uint8).reshape(n, -1)
    data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in FP16_SCALES[kind]:
        scales = rng.uniform(1e-3, 1e-2, (n, k // block)).astype(np.float16)
        data[..., off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return data.reshape(n, -1)


@pytest.mark.parametrize("act", ACT_BLOCKS)
@pytest.mark.parametrize("kind", list(FORMATS))
def test_formats(kind, act):
    n, k = 40, 512 if FORMATS[kind][3] == 256 else 608  # n not a multiple of the 16-row tile; K a partial 256-group
    data = random_blocks(kind, n, k)
    w = QuantWeight.from_gguf(kind, data, n, k)
    ref = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))  # past the 32-row pass: 32 + 32 + 6
    bias = torch.randn(n)
    results = []
    for kern in kernels(act):
        assert torch.equal(kern.rows(w, torch.arange(n)), ref), f"{kern.isa}: dequantized rows differ from GGUF's"
        one = torch.cat([kern.linear(x[i : i + 1], w, bias) for i in range(len(x))])
        for rows in (3, 6, 8, 11, 16, 17, 33, 70):  # unrolled (<= 4 AVX-512, <= 8 AVX2), rolled passes; tiles
            # in chunks of <= 16 rows (17: two of 9, the last padded; 33: three of 11; 70: five of 14)
            y = kern.linear(x[:rows], w, bias)
            assert torch.equal(y, one[:rows]), f"{kern.isa}: a {rows}-row product differs from one-row products"
        want = x @ ref.T + bias
        # int8 activations: ~0.5-1% relative error; float weights take the input as it is (float rounding only)
        assert ((y - want).norm() / want.norm()) < (1e-5 if kind in FLOATS else 0.02)
        results.append(y)
    assert all(torch.equal(r, results[0]) for r in results), "the ISA builds disagree"


@pytest.mark.parametrize("act", ACT_BLOCKS)
def test_activation_codes_follow_their_definition(act):
    """Each input row is quantized per `act` values as documented (d = amax / 127, q = nearbyint(x / d), ties to
    even, NaN skipped in amax; the last group may be shorter): a Q8_0 weight whose row j selects input j with
    weight 1 returns d * q exactly."""
    k = 320
    data = np.zeros((k, k // 32, 34), dtype=np.uint8)
    data[..., 0:2] = np.array([1.0] * (k * k // 32), dtype=np.float16).view(np.uint8).reshape(k, k // 32, 2)
    for j in range(k):
        data[j, j // 32, 2 + j % 32] = 1
    w = QuantWeight.from_gguf("Q8_0", data.reshape(k, -1), k, k)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (5, k)).astype(np.float32)
    x[1, :32] = np.r_[127, np.arange(31) - 15.5]  # d = 1 and half-integer x / d: ties go to even codes
    x[2, 3] = np.nan
    x[3, 32:] = 0.0
    want = np.concatenate([_dequantized_codes(x[:, g : g + act]) for g in range(0, k, act)], axis=1)
    want = torch.from_numpy(want)
    for kern in kernels(act):
        got = kern.linear(torch.from_numpy(x), w)
        assert torch.equal(got, want), f"{kern.isa}: activation codes differ from their definition"


def _dequantized_codes(group: np.ndarray) -> np.ndarray:
    """d * q of rows [M, n] quantized with one int8 scale per row, as documented."""
    amax = np.max(np.where(np.isnan(group), 0, np.abs(group)), axis=1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        q = np.rint(group * inv)
    q = np.where(np.isnan(q), 0, q)  # NaN codes: the int32 conversion's INT_MIN, whose low byte is 0
    return (d * q.astype(np.float32)).astype(np.float32)


def test_select_rows_matches_full_product():
    n, k = 100, 256
    w = QuantWeight.from_gguf("Q4_K", random_blocks("Q4_K", n, k), n, k)
    ids = torch.tensor([97, 3, 50, 16, 17, 0])
    x = torch.randn(3, k)
    kern = kernels()[0]
    assert torch.equal(kern.linear(x, w.select_rows(ids)), kern.linear(x, w)[:, ids])


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])  # a 2-bit and a 4-bit high plane, per-block scales
def test_put_rows_replaces_rows_in_place(kind):
    n, k = 100, 256
    w = QuantWeight.from_gguf(kind, random_blocks(kind, n, k), n, k)
    ids = torch.tensor([97, 3, 50, 16, 17, 0])
    sub = w.select_rows(ids)
    address = sub.lo.data_ptr()
    slots, new = torch.tensor([1, 4]), torch.tensor([64, 31])
    sub.put_rows(slots, w, new)
    ids[slots] = new
    x = torch.randn(3, k)
    kern = kernels()[0]
    assert sub.lo.data_ptr() == address
    assert torch.equal(kern.linear(x, sub), kern.linear(x, w)[:, ids])


def test_row_permutation_is_applied():
    n, k = 32, 64
    data = random_blocks("Q8_0", n, k)
    order = np.random.default_rng(0).permutation(n)
    w = QuantWeight.from_gguf("Q8_0", data, n, k, order)
    ref = dequantize(data, GGMLQuantizationType.Q8_0).reshape(n, k)[order]
    assert torch.equal(kernels()[0].rows(w, torch.arange(n)), torch.from_numpy(ref.astype(np.float32)))


def test_unsupported_format_is_a_clear_error():
    with pytest.raises(ValueError, match="no quantized kernel"):
        QuantWeight.from_gguf("IQ2_XS", np.zeros((16, 74), np.uint8), 16, 256)


def test_quantized_model_keeps_weights_quantized(smollm):
    """The default load computes from the GGUF blocks: no float copy of a quantized weight, embedding rows equal
    GGUF's dequantization, and the model's bytes are about the file's."""
    from swiftdecode.hub.load import locate_gguf
    from swiftdecode.kernels.gguf_index import read_index
    from swiftdecode.kernels.modules import QuantEmbedding, QuantLinear

    model, _ = smollm
    gguf, _ = locate_gguf("smollm2-135m", progress=False)
    quant = {id(m.qweight): m.qweight for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    float_bytes = sum(p.nbytes for p in model.parameters())
    quant_bytes = sum(q.nbytes for q in quant.values())
    assert float_bytes < 0.01 * quant_bytes  # norms only
    assert quant_bytes <= 1.05 * gguf.stat().st_size
    _, tensors = read_index(gguf)
    emb = next(t for t in tensors if t.name == "token_embd.weight")
    ref = dequantize(np.asarray(emb.data), emb.tensor_type).reshape(-1, int(emb.shape[0]))
    ids = torch.tensor([[0, 17, 4000, 49151]])
    got = model.get_input_embeddings()(ids)[0]
    assert torch.equal(got, torch.from_numpy(ref[ids[0].numpy()].astype(np.float32)))


def test_one_call_for_several_weights_equals_separate_calls():
    """q/k/v (or gate/up) in one call: x quantized once, tiles of all weights in one pass, same bits (a float
    weight among them reads x as it is; a call of float weights alone quantizes nothing)."""
    k = 256
    ws = [
        QuantWeight.from_gguf(kind, random_blocks(kind, n, k, seed), n, k)
        for seed, (kind, n) in enumerate([("Q5_0", 48), ("Q8_0", 16), ("Q4_K", 40), ("BF16", 24), ("F16", 8)])
    ]
    biases = [torch.randn(48), None, torch.randn(40), torch.randn(24), None]
    x = torch.randn(5, k)
    for kern in kernels():
        for group in (slice(0, 5), slice(3, 5)):
            many = kern.linear_many(x, ws[group], biases[group])
            singles = [kern.linear(x, w, b) for w, b in zip(ws[group], biases[group], strict=True)]
            assert all(torch.equal(y, one) for y, one in zip(many, singles, strict=True)), (kern.isa, group)


def test_quant_linear_uses_a_bias_set_after_construction():
    """Loading sets biases after building the layers: the layer's prepared kernel call must follow."""
    from torch import nn

    from swiftdecode.kernels.modules import QuantLinear

    k, n = 256, 32
    w = QuantWeight.from_gguf("Q4_K", random_blocks("Q4_K", n, k), n, k)
    kern = kernels()[0]
    layer, x = QuantLinear(w, None, kern), torch.randn(3, k)
    assert torch.equal(layer(x), kern.linear(x, w))
    layer.bias = nn.Parameter(torch.randn(n), requires_grad=False)
    assert torch.equal(layer(x), kern.linear(x, w, layer.bias))


def test_an_unknown_activation_block_is_a_clear_error():
    import swiftdecode
    from swiftdecode.base.errors import UserError

    with pytest.raises(UserError, match="per 32 or 256 values, not 64"):
        swiftdecode.load("smollm2-135m", act_block=64, progress=False)
    with pytest.raises(UserError, match="not 64"):
        load_qkernel(None, 64)


def test_the_amx_build_gives_a_whole_model_the_same_bits(smollm):
    """The AMX build (tiles where the CPU has them, emulated elsewhere) runs a whole quantized model through the
    native layer loop to the default build's logits, bit for bit: a 40-token prompt (three tile chunks of 14 rows,
    the last padded), then an 8-token chain and a one-token step on its cache."""
    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.model import SwiftModel

    model, outs = amx_smollm(), []
    for m in (smollm[0], model):
        sm = SwiftModel(m)
        cache = SwiftCache(sm.n_layers)
        outs.append([sm.logits(sm.prefill(ids, cache)) for ids in (list(range(300, 340)), list(range(8)), [9])])
    assert sm.layer_loop() == "native"
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_the_amx_builds_timing_loops_run_on_tiles():
    """`doctor`'s loops on the AMX build (tdpbsud on full tiles; the tile pass's inner step for every format) load
    valid tile configurations in their threads and return rates (emulated tiles where the CPU lacks AMX: the
    emulator's rates, which say nothing of the hardware's)."""
    from swiftdecode.kernels.qweight import FLOAT_KINDS, FORMATS

    amx = amx_kernel()
    assert amx.peak_macs(2, reps=16, tries=1) > 0
    integer = [fmt for kind, (fmt, *_) in FORMATS.items() if kind not in FLOAT_KINDS]  # F16/BF16: no integer step
    assert all(amx.loop_macs(fmt, 2, reps=4, tries=1) > 0 for fmt in integer)
