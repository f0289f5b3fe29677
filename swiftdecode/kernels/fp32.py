"""ctypes binding of csrc/skinny_gemm.cpp: the batch-invariant fp32 kernels (skinny GEMM, attention, RMSNorm,
rotary, SiLU, GeLU) for AVX-512 or AVX2, chosen by CPU features at run time.

Why hand-written: torch's bundled MKL takes a slow path for products with 2..32 rows on some CPUs (AMD), so
verifying k draft tokens cost 2-3x one token; and no library promises that row i of an M-row product is
bit-identical to the 1-row product, which is what keeps verification lossless. Every kernel here accumulates
in an order that depends only on the row's own inputs (see the source). The library is built with g++ on first
use (~1 s) and cached under <cache>/kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from swiftdecode.kernels.build import KernelUnavailable, build, pick_isa

SOURCE = Path(__file__).parent / "csrc" / "skinny_gemm.cpp"
ISA_FLAGS = {"avx512": ["-DSD_AVX512", "-mavx512f", "-mavx2", "-mfma", "-mf16c"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx2", "fma", "f16c"}, "avx2": {"avx2", "fma", "f16c"}}
# The float kernels have no integer dot products: a fast path naming the quantized kernel's AVX-VNNI build runs
# their AVX2 build, one naming its AMX build their AVX-512 build.
FLOAT_BUILD_OF = {"avxvnni": "avx2", "amx": "avx512"}
ATTN_HEADS = 4  # HB in csrc: query heads per attention work item; scratch is (HB + 1) * T floats per thread


def build_kernel(isa: str, out_dir: Path | None = None) -> Path:
    """Compile csrc/skinny_gemm.cpp for `isa` into a cached shared library (keyed by source, flags, compiler)."""
    return build(SOURCE, f"skinny_gemm_{isa}", ISA_FLAGS[isa], out_dir)


P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# argument types of each entry point sd_<name>_<isa> (csrc/skinny_gemm.cpp; all return void)
SIGNATURES = {
    "linear": [P] * 4 + [I64] * 3 + [I32],
    "linear_t": [P] * 4 + [I64] * 3 + [F32] + [P] * 2 + [I32],
    "attention": [P, I64, I64] * 3 + [P, I64, P, *[I64] * 5, F32, P, I32, F32],
    "attention_many": [P] * 6 + [I64] * 4 + [F32, P, I64, I32, I32, F32],
    "rmsnorm": [P] * 3 + [I64] * 2 + [F32, I32],
    "rope": [P] * 3 + [I64] * 3,
    "silu_mul": [P] * 2 + [I64, I32],
    "gelu_mul": [P] * 2 + [I64, I32],
}


def _bind(lib: ctypes.CDLL, name: str, isa: str):
    """The library's entry point sd_<name>_<isa>, typed by SIGNATURES."""
    fn = getattr(lib, f"sd_{name}_{isa}")
    fn.argtypes, fn.restype = SIGNATURES[name], None
    return fn


class Kernel:
    """ctypes binding of sd_linear_<isa>(x, w, b, y, M, N, K, nthreads) for contiguous fp32 tensors."""

    def __init__(self, isa: str, lib: Path):
        self.isa = isa
        self.max_head_dim = 4096  # attention keeps per-key scores in scratch, not the head dim in registers
        self._lib = ctypes.CDLL(str(lib))  # torch is imported first, so OpenMP resolves to torch's libgomp
        fns = {name: _bind(self._lib, name, isa) for name in SIGNATURES}
        self._fn, self._fn_t, self._attn, self._attn_many = (
            fns[n] for n in ("linear", "linear_t", "attention", "attention_many")
        )
        self._norm, self._rope, self._silu_mul = fns["rmsnorm"], fns["rope"], fns["silu_mul"]
        self._gelu_mul = fns["gelu_mul"]
        # entry points for native callers (kernels/decoder.py), so the process runs one fp32 implementation
        self.addresses = {
            name: ctypes.cast(fn, ctypes.c_void_p).value
            for name, fn in (
                ("rmsnorm", self._norm),
                ("rope", self._rope),
                ("attention_many", self._attn_many),
                ("silu_mul", self._silu_mul),
                ("gelu_mul", self._gelu_mul),
            )
        }

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [q, heads, D] (contiguous, in place) by cos/sin [q, D] as HF's rotate_half does; returns x."""
        q, heads, d = x.shape
        self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), q, heads, d)
        return x

    def attention_scratch(self, max_keys: int) -> torch.Tensor:
        """Scratch for attention over at most `max_keys` keys at the current thread count."""
        return torch.empty(torch.get_num_threads() * (ATTN_HEADS + 1) * max_keys, dtype=torch.float32)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- silu(gate) * up, in place (both fp32 contiguous, same shape); each value from its own inputs."""
        self._silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads())
        return gate

    def gelu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <- gelu(gate) * up (GeLU's tanh approximation: Gemma's), in place, as silu_mul."""
        self._gelu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), torch.get_num_threads())
        return gate

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., H] fp32 contiguous, w [H] -> w * x / sqrt(mean(x^2) + eps), row-local in a fixed order."""
        y = torch.empty_like(x)
        h = x.shape[-1]
        self._norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // h, h, eps, torch.get_num_threads())
        return y

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [H, M, D], k/v [Hkv, T, D] (last dim contiguous), mask [M, T] additive (0 where visible) or None
        (causal, keys aligned at the end) -> [M, H, D]; softcap: scores become softcap * tanh(score / softcap)
        (Gemma 2). Every sum runs over the visible keys in key order (see csrc)."""
        (h, m, d), (hkv, t, _) = q.shape, k.shape
        out = torch.empty((m, h, d), dtype=torch.float32)
        threads = torch.get_num_threads()
        scratch = self.attention_scratch(t)
        mask_args = (mask.data_ptr(), mask.stride(0)) if mask is not None else (None, 0)
        args = (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1))
        args += (v.data_ptr(), v.stride(0), v.stride(1), *mask_args, out.data_ptr(), h, hkv, m, t, d, scale)
        self._attn(*args, scratch.data_ptr(), threads, softcap or 0.0)
        return out

    def attention_many(
        self,
        q: torch.Tensor,
        ks: list,
        vs: list,
        masks: list,
        sizes: list[int],
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of several sequences in one call: q [R, H, D] contiguous, sequence j owning the next
        sizes[j] rows, over its own keys/values ks[j]/vs[j] [Hkv, T_j, D] (key stride D, equal head strides;
        all fp32, or all fp16: widened exactly) under masks[j] [sizes[j], ≥ T_j] additive -> [R, H, D], each
        sequence's rows exactly as `attention` computes them (softcap too) on fp32 keys/values of the same
        values."""
        (_, h, d), hkv, n = q.shape, ks[0].shape[0], len(ks)
        dims, row = [], 0
        for k, v, mask, m in zip(ks, vs, masks, sizes, strict=True):
            if k.stride(1) != d or v.stride(1) != d or v.stride(0) != k.stride(0):
                raise ValueError("keys and values need key stride D and equal head strides")
            if k.dtype != ks[0].dtype or v.dtype != k.dtype or k.dtype not in (torch.float32, torch.float16):
                raise ValueError("keys and values must all be fp32 or all fp16")
            dims += [m, k.shape[1], k.stride(0), mask.stride(0), row]
            row += m
        out = torch.empty_like(q)
        threads, max_t = torch.get_num_threads(), max(k.shape[1] for k in ks)
        scratch = self.attention_scratch(max_t)
        ptrs = lambda ts: (ctypes.c_void_p * n)(*(t.data_ptr() for t in ts))
        self._attn_many(
            q.data_ptr(),
            ptrs(ks),
            ptrs(vs),
            ptrs(masks),
            (ctypes.c_int64 * len(dims))(*dims),
            out.data_ptr(),
            n,
            h,
            hkv,
            d,
            scale,
            scratch.data_ptr(),
            max_t,
            threads,
            int(ks[0].dtype == torch.float16),
            softcap or 0.0,
        )
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32, w [N, K] contiguous fp32, b [N] or None -> [..., N]; M = x.numel() // K rows."""
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        bias = b.data_ptr() if b is not None else None
        self._fn(x2.data_ptr(), w.data_ptr(), bias, y.data_ptr(), x2.shape[0], n, k, torch.get_num_threads())
        return y

    def linear_t(self, x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None, thr: float = 0.0) -> torch.Tensor:
        """x [..., K] fp32, wt [K, N] contiguous fp32 (the weight transposed), b [N] or None -> [..., N].

        thr > 0: inputs with |x| <= thr count as zero and their weight rows are not read (sparse draft)."""
        k, n = wt.shape
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        xs = torch.empty((m, k) if thr > 0 else (0,), dtype=torch.float32)
        idx = torch.empty(k, dtype=torch.int32)
        bias = b.data_ptr() if b is not None else None
        args = (x2.data_ptr(), wt.data_ptr(), bias, y.data_ptr(), m, n, k, thr, xs.data_ptr(), idx.data_ptr())
        self._fn_t(*args, torch.get_num_threads())
        return y


_KERNELS: dict[str, Kernel] = {}


def load_kernel(isa: str | None = None) -> Kernel:
    """Build (once, cached on disk) and load the kernel, then check it against torch; KernelUnavailable if not."""
    isa = pick_isa(ISA_CPU_FLAGS, FLOAT_BUILD_OF.get(isa, isa))
    if isa not in _KERNELS:
        try:
            kernel = Kernel(isa, build_kernel(isa))
        except OSError as e:  # dlopen failure
            raise KernelUnavailable(f"kernel load failed: {e}") from e
        _self_test(kernel)
        _KERNELS[isa] = kernel
    return _KERNELS[isa]


def _self_test(kernel: Kernel) -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((5, 77), (13, 77), (13,)))
    with torch.no_grad():
        got, want = kernel.linear(x, w, b), F.linear(x, w, b)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise KernelUnavailable(f"kernel self-test failed (max error {(got - want).abs().max():.2e})")
