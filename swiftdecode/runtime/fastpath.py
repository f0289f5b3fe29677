"""Cheap multi-token forwards on CPU: a batch-invariant skinny-GEMM kernel for every nn.Linear.

Decoding is bound by reading the weights. torch's bundled MKL takes a slow path for products with 2..32 rows
on some CPUs (AMD), so verifying k draft tokens costs 2-3x one token. `accelerate(model)` swaps each fp32
nn.Linear (lm_head included; tied weights are used in place, nothing is copied) to `FastLinear`, whose forward
calls a small C++ AVX-512/AVX2 kernel (kernels/fp32.py) that streams each weight row once for all rows.
The decoder's MLP weights are re-laid out transposed (same values, same memory) so that a draft forward can run
activation-sparse: it reads only the weight rows of inputs above a threshold (`Sparsity`).

The kernel is batch-invariant: y[m, n] is accumulated in the same order whatever M is, so row i of an M-row
product is bit-identical to the 1-row product. Attention (HF implementation "swiftdecode") is made invariant the
same way: a query row's output depends only on the keys it sees, in order, not on other rows or masked keys. So
a forward of k tokens (a chain or a tree under a mask) gives exactly the logits of k one-token forwards, and a
prompt gives the same cache whether it is fed at once or in pieces. It is also faster than torch's MKL path here
at every M measured (1..512), so it is used for all M. Other dtypes, autograd and non-CPU tensors go to torch.

State belongs to the model: `accelerate` leaves the kernel and the sparsity switches in `model.fast_path`, and
each swapped layer holds its own references, so models on different paths share a process. The class swap and
the attention's registration are `patches`' (why they are patches, and how each is undone).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from swiftdecode.base.config import FAST_PATHS as MODES
from swiftdecode.base.config import isa_of
from swiftdecode.base.errors import UserError
from swiftdecode.kernels.build import KernelUnavailable
from swiftdecode.kernels.fp32 import Kernel, load_kernel
from swiftdecode.kernels.modules import QuantLinear
from swiftdecode.runtime.patches import restore_attention, swap_class, use_attention

# Activation-sparse drafting (MLP inputs): level -> (fraction of gate/up inputs, fraction of down inputs) that a
# draft forward treats as zero, the smallest in magnitude. Level 0 is dense.
SPARSITY_LEVELS = ((0.0, 0.0), (0.2, 0.4), (0.3, 0.5), (0.4, 0.6), (0.5, 0.7), (0.6, 0.8))


@dataclass
class Sparsity:
    """One model's activation-sparsity switches, read by its MLP projections: the `level` of the current (draft)
    forward (0: dense) and whether this forward records |x| quantiles as the thresholds (`calibrating`)."""

    level: int = 0
    calibrating: bool = False

    @contextmanager
    def draft(self, level: int):
        """Forwards inside run activation-sparse at `level`."""
        previous, self.level = self.level, level
        try:
            yield
        finally:
            self.level = previous

    @contextmanager
    def calibrate(self):
        """The forward inside sets every MLP projection's thresholds from its inputs."""
        self.calibrating = True
        try:
            yield
        finally:
            self.calibrating = False


@dataclass
class FastPathInfo:
    """Which matmul path a model's linear layers use (`path`) and why (`reason`); on a kernel path, the fp32
    kernel library (norms, rotary, attention and float products) and the model's sparsity switches."""

    path: str
    reason: str
    patched: int = 0
    kernel: Kernel | None = None
    sparsity: Sparsity = field(default_factory=Sparsity)


def info_of(model: nn.Module) -> FastPathInfo:
    """What `accelerate` left on `model` (torch, if it never ran)."""
    return getattr(model, "fast_path", None) or FastPathInfo("torch", "not accelerated")


class FastLinear(nn.Linear):
    """nn.Linear whose fp32 CPU forward runs the skinny kernel (unless autograd needs a graph).

    MLP projections are stored transposed (`weight` is a [N, K] view of a contiguous [K, N] tensor, same values)
    so that a draft forward can read only the weight rows of its largest inputs: while `sparsity.level` > 0,
    inputs with |x| at or below this layer's threshold for that level count as zero. Thresholds are the
    quantiles of |x| seen in the last calibrating forward (the prompt's prefill). `kernel` and `sparsity` are
    set on each layer by `accelerate` (the model's own).
    """

    kernel: Kernel
    sparsity: Sparsity
    role: str = ""  # "in" (gate/up: input is the hidden state) or "down" (input is the MLP activation)
    thresholds: torch.Tensor | None = None  # [len(SPARSITY_LEVELS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        thr = self._threshold(x)
        if (
            x.dtype != torch.float32
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
        if self.sparsity.calibrating:
            sample = x.detach().reshape(-1)[:: max(1, x.numel() // 2048)].abs().float().sort().values
            self.thresholds = sample[[int(f[self.role == "down"] * (len(sample) - 1)) for f in SPARSITY_LEVELS]]
            self.thresholds[0] = 0.0
        if self.sparsity.level == 0 or self.thresholds is None:
            return 0.0
        return float(self.thresholds[self.sparsity.level])


def sparse_capable(model: nn.Module) -> bool:
    """Whether the model's MLP projections run on the transposed kernel (so sparse drafts read less)."""
    return any(isinstance(m, FastLinear) and m.role and m.weight.t().is_contiguous() for m in model.modules())


def invariant_attention(kernel: Kernel, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function ("swiftdecode-<isa>", `kernel` bound): the kernel's order-invariant attention for
    fp32 queries of one sequence (query [1, H, M, D], key/value [1, Hkv, T, D]); `_elsewhere` for the rest."""
    b, _, m, d = query.shape
    mask = attention_mask
    if (
        b != 1
        or d > kernel.max_head_dim
        or query.dtype != torch.float32
        or query.device.type != "cpu"
        or (dropout and module.training)
        or kwargs.get("s_aux") is not None
        or (mask is None and not (kwargs.get("is_causal") or getattr(module, "is_causal", True)))
        or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1))
        or any(t.stride(-1) != 1 for t in (query, key, value))
    ):
        return _elsewhere(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if mask is not None:
        mask = mask[0, 0, :, : key.shape[2]]
        mask = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.float().contiguous()
    scale = scaling if scaling is not None else d**-0.5
    return kernel.attention(query[0], key[0], value[0], mask, scale, kwargs.get("softcap"))[None], None


def _elsewhere(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """HF attention for what the kernel does not run: the model's own eager attention where torch's SDPA cannot
    run it either (attention sinks, or soft-capped scores in batches), else SDPA. The masks are made for SDPA: boolean,
    or None for a causal one (rows at the end of the keys); eager attention adds its mask, so it gets them so."""
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None or (kwargs.get("softcap") is None and kwargs.get("s_aux") is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is None:
        m, t = query.shape[-2], key.shape[-2]
        attention_mask = torch.ones(m, t, dtype=torch.bool).tril_(t - m)[None, None]
    if attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _mlp_linears(model: nn.Module) -> list[tuple[nn.Linear, str]]:
    """(linear, role) for the MLP projections of each decoder layer: "down" writes the hidden size, "in" reads it."""
    from swiftdecode.runtime.skip import decoder_layers

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
            swap_class(m, nn.Linear)
            if not m.weight.is_contiguous():
                m.weight.data = m.weight.data.contiguous()
            for attr in ("role", "thresholds", "kernel", "sparsity"):
                m.__dict__.pop(attr, None)
    restore_attention(model)
    model.fast_path = FastPathInfo("torch", "restored")


def accelerate(model: nn.Module, mode: str = "auto") -> FastPathInfo:
    """Patch `model`'s nn.Linear layers in place for cheap multi-token CPU forwards.

    mode: "auto" (kernel if this CPU/compiler supports it, else torch, with the reason), "torch" (undo/no
    change), "skinny" (kernel, best ISA; UserError if unavailable), "skinny-avx512" / "skinny-avx2".
    Exact to float rounding vs torch; batch-invariant (see the module docstring).
    """
    if mode not in MODES:
        raise UserError(f"unknown fast path {mode!r}; choose from {', '.join(MODES)}")
    restore(model)
    model.fast_path = info = _patch(model, mode)
    return info


def _patch(model: nn.Module, mode: str) -> FastPathInfo:
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
        kernel = load_kernel(isa_of(mode))
    except KernelUnavailable as e:
        return _unavailable(mode, str(e))
    sparsity = Sparsity()
    for m in linears:
        if m.weight.dtype == torch.float32:
            swap_class(m, FastLinear)
            m.kernel, m.sparsity = kernel, sparsity
    for m, role in _mlp_linears(model):  # transposed storage: sparse drafts read only the rows they need
        if isinstance(m, FastLinear) and m.out_features % 16 == 0:
            m.weight.data = m.weight.data.t().contiguous().t()
            m.role = role
    n = sum(isinstance(m, FastLinear) for m in linears)
    isa, reason = kernel.isa, f"{kernel.isa} batch-invariant skinny GEMM ({n} linear layers)"
    if quant:  # the path is named for the quantized kernel's build (its fp32 kernels may be another's)
        qk = next(m.kernel for m in model.modules() if isinstance(m, QuantLinear))
        isa = qk.isa
        floats = sum(isinstance(m, QuantLinear) and m.qweight.floats for m in model.modules())
        acts = "fp32 inputs" if floats == quant else f"int8 activations per {qk.act}"
        acts += f"; {floats} of them 16-bit floats on fp32 inputs" if 0 < floats < quant else ""
        reason = f"{isa} batch-invariant quantized GEMM ({quant} layers, {acts})" + (
            f" + fp32 skinny GEMM ({n} layers)" if n else ""
        )
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and hasattr(model, "set_attn_implementation"):
        from transformers.masking_utils import sdpa_mask

        use_attention(model, f"swiftdecode-{kernel.isa}", partial(invariant_attention, kernel), sdpa_mask)
        reason += " + order-invariant attention"
    return FastPathInfo(f"skinny-{isa}", reason, n + quant, kernel, sparsity)


def _unavailable(mode: str, reason: str) -> FastPathInfo:
    if mode != "auto":
        raise UserError(f"fast path {mode!r} unavailable: {reason}")
    return FastPathInfo("torch", f"fallback: {reason}")
