"""Cheap multi-token forwards on CPU: a batch-invariant skinny-GEMM kernel for every nn.Linear.

Decoding is bound by reading the weights. torch's bundled MKL takes a slow path for products with 2..32 rows
on some CPUs (AMD), so verifying k draft tokens costs 2-3x one token. `accelerate(model)` swaps each fp32
nn.Linear (lm_head included; tied weights are used in place, nothing is copied) to `FastLinear`, whose forward
calls a small C++ AVX-512/AVX2 kernel (csrc/skinny_gemm.cpp) that streams each weight row once for all rows.
The decoder's MLP weights are re-laid out transposed (same values, same memory) so that a draft forward can run
activation-sparse: it reads only the weight rows of inputs above a threshold (`sparse_draft`, `calibrate`).

The kernel is batch-invariant: y[m, n] is accumulated in the same order whatever M is, so row i of an M-row
product is bit-identical to the 1-row product. Attention (HF implementation "swiftdecode") is made invariant the
same way: a query row's output depends only on the keys it sees, in order, not on other rows or masked keys. So
a forward of k tokens (a chain or a tree under a mask) gives exactly the logits of k one-token forwards, and a
prompt gives the same cache whether it is fed at once or in pieces. It is also faster than torch's MKL path here
at every M measured (1..512), so it is used for all M. The library is built with g++ on first use (~1 s) and
cached under <cache>/kernels. Other dtypes, autograd and non-CPU tensors go to torch.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from swiftdecode.errors import UserError
from swiftdecode.kernels.build import KernelUnavailable, build, pick_isa
from swiftdecode.kernels.modules import QuantLinear

SOURCE = Path(__file__).parent / "csrc" / "skinny_gemm.cpp"
ISA_FLAGS = {"avx512": ["-DSD_AVX512", "-mavx512f", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma"]}
ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx2", "fma"}, "avx2": {"avx2", "fma"}}
ATTN_HEADS = 4  # HB in csrc: query heads per attention work item; scratch is (HB + 1) * T floats per thread
MODES = ("auto", "torch", "skinny", "skinny-avx512", "skinny-avx2")


@dataclass
class FastPathInfo:
    """Which matmul path a model's linear layers use (`path`) and why (`reason`)."""

    path: str
    reason: str
    patched: int = 0


def build_kernel(isa: str, out_dir: Path | None = None) -> Path:
    """Compile csrc/skinny_gemm.cpp for `isa` into a cached shared library (keyed by source, flags, compiler)."""
    return build(SOURCE, f"skinny_gemm_{isa}", ISA_FLAGS[isa], out_dir)


class Kernel:
    """ctypes binding of sd_linear_<isa>(x, w, b, y, M, N, K, nthreads) for contiguous fp32 tensors."""

    def __init__(self, isa: str, lib: Path):
        self.isa = isa
        self.max_head_dim = 4096  # attention keeps per-key scores in scratch, not the head dim in registers
        self._lib = ctypes.CDLL(str(lib))  # torch is imported first, so OpenMP resolves to torch's libgomp
        self._fn = getattr(self._lib, f"sd_linear_{isa}")
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        self._fn.restype = None
        self._fn_t = getattr(self._lib, f"sd_linear_t_{isa}")
        self._fn_t.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 2
        self._fn_t.argtypes += [ctypes.c_int]
        self._fn_t.restype = None
        self._attn = getattr(self._lib, f"sd_attention_{isa}")
        self._attn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 3 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5,
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
        ]  # fmt: skip
        self._attn.restype = None
        self._attn_many = getattr(self._lib, f"sd_attention_many_{isa}")
        self._attn_many.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p]
        self._attn_many.argtypes += [ctypes.c_int64, ctypes.c_int]
        self._attn_many.restype = None
        self._norm = getattr(self._lib, f"sd_rmsnorm_{isa}")
        self._norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
        self._norm.restype = None
        self._rope = getattr(self._lib, f"sd_rope_{isa}")
        self._rope.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        self._rope.restype = None

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [q, heads, D] (contiguous, in place) by cos/sin [q, D] as HF's rotate_half does; returns x."""
        q, heads, d = x.shape
        self._rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), q, heads, d)
        return x

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., H] fp32 contiguous, w [H] -> w * x / sqrt(mean(x^2) + eps), row-local in a fixed order."""
        y = torch.empty_like(x)
        h = x.shape[-1]
        self._norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // h, h, eps, torch.get_num_threads())
        return y

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [H, M, D], k/v [Hkv, T, D] (last dim contiguous), mask [M, T] additive or None (causal, keys
        aligned at the end) -> [M, H, D]. Every sum runs over the visible keys in key order (see csrc)."""
        (h, m, d), (hkv, t, _) = q.shape, k.shape
        out = torch.empty((m, h, d), dtype=torch.float32)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * (ATTN_HEADS + 1) * t, dtype=torch.float32)
        mask_args = (mask.data_ptr(), mask.stride(0)) if mask is not None else (None, 0)
        self._attn(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), *mask_args, out.data_ptr(),
            h, hkv, m, t, d, scale, scratch.data_ptr(), threads,
        )  # fmt: skip
        return out

    def attention_many(
        self, q: torch.Tensor, ks: list, vs: list, masks: list, sizes: list[int], scale: float
    ) -> torch.Tensor:
        """Attention of several sequences in one call: q [R, H, D] contiguous, sequence j owning the next
        sizes[j] rows, over its own keys/values ks[j]/vs[j] [Hkv, T_j, D] (key stride D, equal head strides)
        under masks[j] [sizes[j], ≥ T_j] additive -> [R, H, D], each sequence's rows exactly as `attention`."""
        (_, h, d), hkv, n = q.shape, ks[0].shape[0], len(ks)
        dims, row = [], 0
        for k, v, mask, m in zip(ks, vs, masks, sizes, strict=True):
            if k.stride(1) != d or v.stride(1) != d or v.stride(0) != k.stride(0):
                raise ValueError("keys and values need key stride D and equal head strides")
            dims += [m, k.shape[1], k.stride(0), mask.stride(0), row]
            row += m
        out = torch.empty_like(q)
        threads, max_t = torch.get_num_threads(), max(k.shape[1] for k in ks)
        scratch = torch.empty(threads * (ATTN_HEADS + 1) * max_t, dtype=torch.float32)
        ptrs = lambda ts: (ctypes.c_void_p * n)(*(t.data_ptr() for t in ts))
        self._attn_many(
            q.data_ptr(), ptrs(ks), ptrs(vs), ptrs(masks), (ctypes.c_int64 * len(dims))(*dims), out.data_ptr(),
            n, h, hkv, d, scale, scratch.data_ptr(), max_t, threads,
        )  # fmt: skip
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
    isa = pick_isa(ISA_CPU_FLAGS, isa)
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


# Activation-sparse drafting (MLP inputs): level -> (fraction of gate/up inputs, fraction of down inputs) that a
# draft forward treats as zero, the smallest in magnitude. Level 0 is dense.
SPARSITY_LEVELS = ((0.0, 0.0), (0.2, 0.4), (0.3, 0.5), (0.4, 0.6), (0.5, 0.7), (0.6, 0.8))


class FastLinear(nn.Linear):
    """nn.Linear whose fp32 CPU forward runs the skinny kernel (unless autograd needs a graph).

    MLP projections are stored transposed (`weight` is a [N, K] view of a contiguous [K, N] tensor, same values)
    so that a draft forward can read only the weight rows of its largest inputs: while `FastLinear.level` > 0,
    inputs with |x| at or below this layer's threshold for that level count as zero. Thresholds are the
    quantiles of |x| seen in the last `calibrating` forward (the prompt's prefill).
    """

    kernel: Kernel | None = None
    level: int = 0  # class-wide: activation-sparsity level of the current (draft) forward
    calibrating: bool = False  # class-wide: record this forward's |x| quantiles as the thresholds
    role: str = ""  # "in" (gate/up: input is the hidden state) or "down" (input is the MLP activation)
    thresholds: torch.Tensor | None = None  # [len(SPARSITY_LEVELS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        thr = self._threshold(x)
        if (
            self.kernel is None
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() == 0
            or not (w.is_contiguous() or w.t().is_contiguous())
            or (b is not None and (b.dtype != torch.float32 or not b.is_contiguous()))
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        ):
            return F.linear(x if thr <= 0 else torch.where(x.abs() > thr, x, 0.0), w, b)
        if w.is_contiguous():
            return self.kernel.linear(x, w, b)
        return self.kernel.linear_t(x, w.t(), b, thr)

    def _threshold(self, x: torch.Tensor) -> float:
        if not self.role:
            return 0.0
        if FastLinear.calibrating:
            sample = x.detach().reshape(-1)[:: max(1, x.numel() // 2048)].abs().float().sort().values
            self.thresholds = sample[[int(f[self.role == "down"] * (len(sample) - 1)) for f in SPARSITY_LEVELS]]
            self.thresholds[0] = 0.0
        if FastLinear.level == 0 or self.thresholds is None:
            return 0.0
        return float(self.thresholds[FastLinear.level])


@contextmanager
def sparse_draft(level: int):
    """Forwards inside run activation-sparse at `level` (0: dense)."""
    previous, FastLinear.level = FastLinear.level, level
    try:
        yield
    finally:
        FastLinear.level = previous


@contextmanager
def calibrate():
    """The forward inside sets every MLP projection's sparsity thresholds from its inputs."""
    FastLinear.calibrating = True
    try:
        yield
    finally:
        FastLinear.calibrating = False


def sparse_capable(model: nn.Module) -> bool:
    """Whether the model's MLP projections run on the transposed kernel (so sparse drafts read less)."""
    return any(isinstance(m, FastLinear) and m.role and m.weight.t().is_contiguous() for m in model.modules())


def invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function ("swiftdecode"): the kernel's order-invariant attention for fp32 queries of one
    sequence (query [1, H, M, D], key/value [1, Hkv, T, D]); torch's SDPA for everything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, _, m, d = query.shape
    mask = attention_mask
    if (
        FastLinear.kernel is None
        or b != 1
        or d > FastLinear.kernel.max_head_dim
        or query.dtype != torch.float32
        or query.device.type != "cpu"
        or (dropout and module.training)
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
        or (mask is None and not (kwargs.get("is_causal") or getattr(module, "is_causal", True)))
        or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1))
        or any(t.stride(-1) != 1 for t in (query, key, value))
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if mask is not None:
        mask = mask[0, 0, :, : key.shape[2]]
        mask = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.float().contiguous()
    scale = scaling if scaling is not None else d**-0.5
    return FastLinear.kernel.attention(query[0], key[0], value[0], mask, scale)[None], None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("swiftdecode", invariant_attention)
    AttentionMaskInterface.register("swiftdecode", sdpa_mask)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _mlp_linears(model: nn.Module) -> list[tuple[nn.Linear, str]]:
    """(linear, role) for the MLP projections of each decoder layer: "down" writes the hidden size, "in" reads it."""
    from swiftdecode.skip import decoder_layers

    try:
        layers = decoder_layers(model)
    except UserError:
        return []
    return [
        (m, "down" if m.out_features < m.in_features else "in")
        for layer in layers
        for m in layer.mlp.modules()
        if isinstance(m, nn.Linear)
    ]


def restore(model: nn.Module) -> None:
    """Undo `accelerate`: every FastLinear becomes a plain nn.Linear again, with a contiguous weight."""
    for m in _linears(model):
        if isinstance(m, FastLinear):
            m.__class__ = nn.Linear
            if not m.weight.is_contiguous():
                m.weight.data = m.weight.data.contiguous()
            for attr in ("role", "thresholds"):
                m.__dict__.pop(attr, None)
    previous = getattr(model, "_swiftdecode_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model._swiftdecode_attn


def accelerate(model: nn.Module, mode: str = "auto") -> FastPathInfo:
    """Patch `model`'s nn.Linear layers in place for cheap multi-token CPU forwards.

    mode: "auto" (kernel if this CPU/compiler supports it, else torch, with the reason), "torch" (undo/no
    change), "skinny" (kernel, best ISA; UserError if unavailable), "skinny-avx512" / "skinny-avx2".
    Exact to float rounding vs torch; batch-invariant (see the module docstring).
    """
    if mode not in MODES:
        raise UserError(f"unknown fast path {mode!r}; choose from {', '.join(MODES)}")
    restore(model)
    quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    if mode == "torch":
        reason = "requested (mode='torch')"
        return FastPathInfo("torch", reason + (f"; {quant} quantized layers run qgemm" if quant else ""))
    linears = _linears(model)
    weights = [m.weight for m in linears]
    if (not weights and not quant) or any(w.device.type != "cpu" for w in weights):
        reason = "model has no linear layers" if not weights else "model is not on the CPU"
        return _unavailable(mode, reason)
    if not quant and not any(w.dtype == torch.float32 for w in weights):
        return _unavailable(mode, f"weights are {weights[0].dtype}; the kernel is float32 only")
    try:
        kernel = load_kernel(mode.removeprefix("skinny-") if mode.startswith("skinny-") else None)
    except KernelUnavailable as e:
        return _unavailable(mode, str(e))
    FastLinear.kernel = kernel
    for m in linears:
        if m.weight.dtype == torch.float32:
            m.__class__ = FastLinear
    for m, role in _mlp_linears(model):  # transposed storage: sparse drafts read only the rows they need
        if isinstance(m, FastLinear) and m.out_features % 16 == 0:
            m.weight.data = m.weight.data.t().contiguous().t()
            m.role = role
    n = sum(isinstance(m, FastLinear) for m in linears)
    reason = f"{kernel.isa} batch-invariant skinny GEMM ({n} linear layers)"
    if quant:
        isa = next(m.kernel.isa for m in model.modules() if isinstance(m, QuantLinear))
        reason = f"{isa} batch-invariant quantized GEMM ({quant} layers, int8 activations)" + (
            f" + fp32 skinny GEMM ({n} layers)" if n else ""
        )
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and hasattr(model, "set_attn_implementation"):
        _register_attention()
        model._swiftdecode_attn = config._attn_implementation
        model.set_attn_implementation("swiftdecode")
        reason += " + order-invariant attention"
    return FastPathInfo(f"skinny-{kernel.isa}", reason, n + quant)


def _unavailable(mode: str, reason: str) -> FastPathInfo:
    if mode != "auto":
        raise UserError(f"fast path {mode!r} unavailable: {reason}")
    return FastPathInfo("torch", f"fallback: {reason}")
