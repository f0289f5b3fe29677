"""ctypes binding of csrc/decoder.cpp: a Llama-family decoder's layers (Qwen3's query/key norms, Phi-3's fused
projections, SmolLM3's layers without rotary, Gemma 3's GeLU, output norms and sliding-window layers included) in
one native call over quantized weights.

The layer table (weight descriptors, biases, norm weights) is bound once; a call passes the rows, the rotary
tables, each sequence's mask and each (sequence, layer) cache buffer. The loop runs the same kernels in the same
order as the Python forward (swiftdecode/runtime/lean.py), so the two return the same bits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from swiftdecode.kernels.qgemm import QKernel, desc_address
from swiftdecode.kernels.qweight import QuantWeight

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
N_WEIGHTS = 7  # q, k, v, o, gate, up, down (csrc: W_Q .. W_DOWN)
SKIP_ATTN, SKIP_MLP = 1, 2  # csrc per-layer skip flags
NO_ROTARY = -1  # csrc LayerWeights.rotary of a layer without rotary (SmolLM3's NoPE layers)


class _Config(ctypes.Structure):
    _fields_ = [*((n, _I) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter")), ("eps", _F), ("scale", _F)]
    _fields_ += [("kv_half", _I), ("rot_dim", _I), ("gelu", _I), ("softcap", _F)]


class _Layer(ctypes.Structure):
    _fields_ = [("w", _P * N_WEIGHTS), ("b", _P * N_WEIGHTS), ("norm_attn", _P), ("norm_mlp", _P)]
    _fields_ += [("norm_q", _P), ("norm_k", _P), ("rotary", _I), ("norm_attn_out", _P), ("norm_mlp_out", _P)]
    _fields_ += [("sliding", _I)]


class _Ops(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("rmsnorm", "rope", "attention_many", "silu_mul", "gelu_mul")]


class _Seq(ctypes.Structure):
    _fields_ = [("rows", _I), ("row0", _I), ("mask", _P), ("mask_stride", _I), ("mask_local", _P)]


class KVEntry(ctypes.Structure):
    """csrc DecKV: one (sequence, layer) cache buffer's keys/values addresses, head stride, filled length and its
    first entry held (entry t at slot t − first)."""

    _fields_ = [("k", _P), ("v", _P), ("head_stride", _I), ("length", _I), ("first", _I)]


@dataclass(frozen=True)
class LayerWeights:
    """One layer's quantized projections (q, k, v, o, gate, up, down; Phi-3: k, v None where q is q, k, v fused,
    up None where gate is gate, up fused), their biases, its two norm weights [hidden] and (Qwen3) its per-head
    query and key norm weights [head_dim], which rotary table turns its queries and keys, (Gemma 3) the norm
    weights of its sublayers' outputs [hidden], and whether it attends within a sliding window."""

    weights: tuple[QuantWeight | None, ...]
    biases: tuple[torch.Tensor | None, ...]
    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    norm_q: torch.Tensor | None = None
    norm_k: torch.Tensor | None = None
    rotary: int = 0  # the rotary table (of `FusedDecoder.run`'s) of its queries and keys; NO_ROTARY: none
    norm_attn_out: torch.Tensor | None = None  # norms of the attention's and the MLP's outputs (Gemma 3)
    norm_mlp_out: torch.Tensor | None = None
    sliding: bool = False  # attends under the sequences' windowed masks


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The layer loop of one model, bound to its weights (kept alive here, so the pointers stay valid)."""

    def __init__(self, qkernel: QKernel, layers: list[LayerWeights], dims: dict, ops: dict[str, int]):
        """dims: hidden, heads, kv_heads, head_dim, inter (ints), eps, scale (floats), kv_half (the caches hold
        fp16 keys/values), rot_dim (each head's rotated dims), gelu (the MLP's activation is GeLU, else SiLU),
        softcap (the attention scores' cap, Gemma 2's; 0: none);
        ops: the fp32 kernel library's entry points (kernels/fp32.py: Kernel.addresses)."""
        self.layers, self.n_layers = layers, len(layers)
        self.config = _Config(**dims)
        self.ops = _Ops(**ops)
        self.table = (_Layer * len(layers))(
            *(
                _Layer(
                    (_P * N_WEIGHTS)(*(None if w is None else desc_address(w) for w in lw.weights)),
                    (_P * N_WEIGHTS)(*(_ptr(b) for b in lw.biases)),
                    lw.norm_attn.data_ptr(),
                    lw.norm_mlp.data_ptr(),
                    _ptr(lw.norm_q),
                    _ptr(lw.norm_k),
                    lw.rotary,
                    _ptr(lw.norm_attn_out),
                    _ptr(lw.norm_mlp_out),
                    int(lw.sliding),
                )
                for lw in layers
            )
        )
        self._fn = getattr(qkernel.lib, f"sd_decoder_{qkernel.isa}")
        self._fn.argtypes = [_P, _P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _P, _P, ctypes.c_int]
        self._fn.restype = None

    def run(
        self,
        x: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        skip: bytes,
        seqs: list,
        kv_tables: list,
        scratch: torch.Tensor,
    ) -> None:
        """Every layer on x [R, hidden] (fp32 contiguous, updated in place); tables: the rotary tables (cos, sin)
        [R, rot_dim] each, fp32 contiguous, that the layers' `rotary` index; skip: a flag
        byte per layer; seqs: (rows, first row, mask [rows, ≥ keys] fp32, the sliding layers' mask of its shape
        and strides, or None) per sequence; kv_tables: per sequence its
        cache's KVEntry array (one per layer; buffers [kv_heads, capacity, head_dim] with room for the
        sequence's rows), whose lengths the loop advances where a layer's attention runs; scratch: the
        attention's."""
        seq_arr = (_Seq * len(seqs))(*(_Seq(r, row0, m.data_ptr(), m.stride(0), _ptr(w)) for r, row0, m, w in seqs))
        if any(w is not None and w.stride() != m.stride() for _, _, m, w in seqs):
            raise ValueError("a sequence's two masks need the same strides")
        kv_arr = (_P * len(kv_tables))(*(ctypes.addressof(t) for t in kv_tables))
        cos, sin = ((_P * len(tables))(*(t[i].data_ptr() for t in tables)) for i in (0, 1))
        self._fn(
            ctypes.byref(self.config),
            self.table,
            self.n_layers,
            skip,
            ctypes.byref(self.ops),
            x.data_ptr(),
            x.shape[0],
            cos,
            sin,
            seq_arr,
            len(seqs),
            kv_arr,
            scratch.data_ptr(),
            torch.get_num_threads(),
        )
