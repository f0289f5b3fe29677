"""ctypes binding of csrc/qgemm.cpp: products with block-quantized weights, and their rows as floats (the same
library holds csrc/decoder.cpp's layer loop, bound in kernels/decoder.py, and csrc/roofline.cpp's peak rate of
the product's multiply-accumulate instruction).

One library per ISA, chosen by CPU features at run time: `avx512` (AVX-512 BW + VNNI), `avxvnni` (AVX-VNNI:
vpdpbusd on ymm, Intel client CPUs without AVX-512) or `avx2` (AVX2 + FMA + F16C), and per activation
quantization (int8 scales per 32 or per 256 values). The ISA builds return bit-identical results (integer dot
products, one fixed float sequence per output; see the source), so a model's numerics do not depend on the
machine's SIMD width. `amx` is the AVX-512 build whose products take their dot products on AMX-INT8 tiles
(csrc/qgemm_tiles.h), the same bits again; it runs only where asked for (`--fast-path skinny-amx`) until its
speed is measured on an AMX CPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from swiftdecode.base.config import ACT_DEFAULT, check_act_block
from swiftdecode.kernels.amx import AMX_FLAGS, amx_status
from swiftdecode.kernels.build import KernelUnavailable, build, pick_isa
from swiftdecode.kernels.qweight import QuantWeight

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("qgemm.cpp", "decoder.cpp", "roofline.cpp")]
_AVX512 = ["-DSD_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "avx512": _AVX512,
    "amx": ["-DSD_AMX", *_AVX512, "-mamx-tile", "-mamx-int8"],
    "avxvnni": ["-DSD_AVXVNNI", "-mavxvnni", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
# The AMX build emulated in scalar C (csrc/tiles.h), for testing its tile pass on CPUs without AMX.
AMX_EMULATED_FLAGS = ["-DSD_AMX", "-DSD_AMX_EMULATE", *_AVX512]
ISA_CPU_FLAGS = {  # widest first: the first this CPU runs is the default (never amx: every AMX CPU has avx512)
    "avx512": {"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"},
    "amx": {"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c", *AMX_FLAGS},
    "avxvnni": {"avx_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
MAX_WEIGHTS = 8  # csrc MAX_WEIGHTS: weights one linear_many call takes
PEAK_REPS = 1 << 21  # rounds of 12 instructions per thread: ~10-20 ms a timing at 1-2 a cycle, past clock ramp-up
LOOP_REPS = 1 << 14  # rounds of the inner step over 32 blocks x 8 rows: ~10-25 ms a timing
_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Desc(ctypes.Structure):
    """csrc QWDesc: a weight's format, shape and plane pointers."""

    _fields_ = [("fmt", _I), ("n", _I), ("k", _I), *((p, _P) for p in ("lo", "hi", "d", "d2", "sc", "mn"))]


def desc_address(w: QuantWeight) -> int:
    """Address of the weight's descriptor (valid while the weight lives)."""
    return ctypes.addressof(_desc(w))


def _desc(w: QuantWeight) -> _Desc:
    """The weight's descriptor, built once and kept on the (frozen) weight object."""
    desc = w.__dict__.get("_desc")
    if desc is None:
        desc = _Desc(w.fmt, w.n, w.k, *(None if p is None else p.data_ptr() for p in w.planes()))
        object.__setattr__(w, "_desc", desc)
    return desc


class Plan:
    """The ctypes arguments of one `linear_many` call over fixed weights and biases, built once; it keeps them
    alive, so the pointers it holds stay valid."""

    def __init__(self, ws: list[QuantWeight], biases: list[torch.Tensor | None]):
        if not 1 <= len(ws) <= MAX_WEIGHTS or len({w.k for w in ws}) != 1 or len(biases) != len(ws):
            raise ValueError(f"1..{MAX_WEIGHTS} weights of one input size expected, with one bias entry each")
        self.ws, self.bias_tensors = list(ws), list(biases)
        self.k, self.ns = ws[0].k, [w.n for w in ws]
        n = len(ws)
        self.descs = (ctypes.c_void_p * n)(*(desc_address(w) for w in ws))
        self.biases = (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for b in biases))
        self.outs = (ctypes.c_void_p * n)()  # filled per call


class QKernel:
    """The qgemm library of one ISA and activation quantization (`act` values per int8 scale)."""

    def __init__(self, isa: str, lib: Path, act: int):
        self.isa, self.act = isa, act
        self.lib = ctypes.CDLL(str(lib))  # torch is imported first, so OpenMP resolves to torch's libgomp
        self._linear = getattr(self.lib, f"sd_qlinear_{isa}")
        self._linear.argtypes = [_P, _P, _P, ctypes.c_int, _P, _I, ctypes.c_int]
        self._deq = getattr(self.lib, f"sd_dequant_rows_{isa}")
        self._deq.argtypes = [ctypes.POINTER(_Desc), _P, _I, _P]
        for f in (self._linear, self._deq):
            f.restype = None
        self._peak = getattr(self.lib, f"sd_peak_macs_{isa}")
        self._peak.argtypes, self._peak.restype = [_I, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_I)], ctypes.c_double
        self._loop = getattr(self.lib, f"sd_loop_macs_{isa}")
        self._loop.argtypes = [ctypes.c_int, _I, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
        self._loop.restype = ctypes.c_double

    def linear(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] fp32 -> [..., N] fp32 (+ bias [N] fp32): row i depends on x's row i only, bit for bit."""
        return self.linear_many(x, [w], [bias])[0]

    def linear_many(
        self, x: torch.Tensor, ws: list[QuantWeight], biases: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """[x W_i^T + b_i] for weights of the same K in one call (x quantized once, one parallel pass): each
        output is bit-for-bit what `linear` returns for that weight alone."""
        return self.run(Plan(ws, biases), x)

    def run(self, plan: Plan, x: torch.Tensor) -> list[torch.Tensor]:
        """`linear_many` of a prepared plan (what a layer calls every step: no per-call argument marshalling)."""
        x2 = x.reshape(-1, plan.k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        ys = [torch.empty((*x.shape[:-1], n), dtype=torch.float32) for n in plan.ns]
        for i, y in enumerate(ys):
            plan.outs[i] = y.data_ptr()
        self._linear(plan.descs, plan.biases, plan.outs, len(ys), x2.data_ptr(), x2.shape[0], torch.get_num_threads())
        return ys

    def peak_macs(self, threads: int, reps: int = PEAK_REPS, tries: int = 5) -> float:
        """Multiply-accumulates per second that `threads` threads reach with the product's integer dot-product
        instruction alone (vpdpbusd zmm on avx512, vpdpbusd ymm on avxvnni, vpmaddubsw ymm on avx2, tdpbsud on amx),
        best of `tries`; 0 where a thread's tiles could not be configured."""
        sink = _I(0)
        return self._peak(reps, threads, tries, ctypes.byref(sink))

    def loop_macs(self, fmt: int, threads: int, reps: int = LOOP_REPS, tries: int = 5) -> float:
        """Multiply-accumulates per second of the products' inner step alone for weight format `fmt`: 8 rows'
        integer dot products and float scaling of a 32-block, codes already unpacked, inputs in L1 (csrc
        sd_loop_macs), best of `tries`: what many-row products could reach if unpacking and streaming were free
        (0 for F16/BF16, which have no integer step)."""
        sink = ctypes.c_float(0.0)
        return self._loop(fmt, reps, threads, tries, ctypes.byref(sink))

    def rows(self, w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [...] as fp32 [..., K], exactly as GGUF's reference dequantization gives them."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= w.n):
            raise IndexError(f"row index out of range for a weight with {w.n} rows")
        out = torch.empty((len(flat), w.k), dtype=torch.float32)
        self._deq(_desc(w), flat.data_ptr(), len(flat), out.data_ptr())
        return out.reshape(*ids.shape, w.k)


_KERNELS: dict[tuple[str, int], QKernel] = {}


def load_qkernel(isa: str | None = None, act: int = ACT_DEFAULT) -> QKernel:
    """Build (once, cached on disk) and load the qgemm library for `isa` (default: the best this CPU runs) whose
    input rows are quantized per `act` values (base.config.ACT_BLOCKS; one library per choice)."""
    isa = pick_isa(ISA_CPU_FLAGS, isa)
    check_act_block(act)
    if isa == "amx" and not (usable := amx_status())[0]:
        raise KernelUnavailable(f"no AMX tiles: {usable[1]}")
    if (isa, act) not in _KERNELS:
        flags = [*ISA_FLAGS[isa], f"-DSD_ACT_BLOCKS={act // 32}"]
        try:
            _KERNELS[isa, act] = QKernel(isa, build(SOURCES, f"qgemm_{isa}_a{act}", flags), act)
        except OSError as e:
            raise KernelUnavailable(f"qgemm load failed: {e}") from e
    return _KERNELS[isa, act]
