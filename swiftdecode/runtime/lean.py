"""A lean forward for Llama-family decoders (Llama, Qwen2, Mistral: pre-norm RMSNorm, rotary, grouped-query
attention, SiLU-gated MLP), over the model's own modules and weights.

Why: with quantized weights a decoder layer's matmuls take ~0.5 ms, and transformers' module stack around them
(hooks, mask and cache plumbing, a dozen small tensor ops per norm and rotary) costs about as much again. This
forward calls the same projections in gpt-fast style: one loop over layers, norms and attention in the
batch-invariant kernel, sublayers of the skip set left out. Every row's result depends only on its own inputs,
so verification stays bit-identical to one-token decoding. Other architectures run through transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from swiftdecode.kernels.decoder import SKIP_ATTN, SKIP_MLP, FusedDecoder, LayerWeights
from swiftdecode.kernels.modules import QuantLinear
from swiftdecode.kernels.qgemm import Plan
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.skip import SkipSet

MODEL_TYPES = ("llama", "qwen2", "mistral")  # same layer anatomy; Qwen3 (q/k norms) and Gemma run through HF
DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies change with the sequence: HF's module computes those tables


def supported(model: torch.nn.Module) -> bool:
    """Whether `model` has the plain Llama anatomy this forward implements."""
    config = model.config.get_text_config()
    if config.model_type not in MODEL_TYPES or getattr(config, "hidden_act", "silu") != "silu":
        return False
    window = getattr(config, "sliding_window", None)
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen2 configs carry a window size that only applies when use_sliding_window is set
    return not window


class LeanDecoder:
    """Forward of the decoder's layers on SwiftCaches, with the fast path's fp32 kernel library (attention,
    RMSNorm, rotary, SiLU) passed to each call. When every projection is quantized the layer loop runs natively
    (kernels/decoder.py: the same kernels in the same order, so the same bits); a forward that observes hidden
    states, or a model with float projections, runs the loop below."""

    def __init__(self, model: torch.nn.Module):
        self.base = model.get_decoder()
        self.layers = self.base.layers
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.eps = self.layers[0].input_layernorm.variance_epsilon
        # per layer: the prepared kernel calls of q/k/v and of gate/up (None where not all quantized)
        self.plans = [
            (_plan((a.q_proj, a.k_proj, a.v_proj)), _plan((m.gate_proj, m.up_proj)))
            for a, m in ((layer.self_attn, layer.mlp) for layer in self.layers)
        ]
        self._fused: tuple[object, FusedDecoder] | None = None  # (fp32 kernel it is bound to, the native loop)
        self.quantized = all(isinstance(m, QuantLinear) for layer in self.layers for m in _linears(layer))
        # On quantized weights the caches hold fp16 keys/values (as llama.cpp's do): half the bytes each row's
        # attention reads, which for a small model's batch of requests is as much as the 4-bit weights. A float
        # model keeps its activations' dtype (so the fp32 path still agrees with transformers).
        self.kv_dtype = torch.float16 if self.quantized else None

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: list[torch.Tensor],
        caches: list[SwiftCache],
        skip: SkipSet,
        kernel,
        observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Rows of one or more sequences in one pass: ids, positions [R], sequence j's rows next after sequence
        j−1's, each attending only to its own cache `caches[j]` under `masks[j]` [q_j, T_j] (additive over the
        keys of a layer that has every entry; a layer whose attention a draft skipped has fewer: its keys are the
        mask's first columns). Returns [R, H]. Row r's result depends on its own inputs and sequence only, bit
        for bit: every other operation is row-local."""
        x = self.base.embed_tokens(ids).contiguous()
        cos, sin = rotary(self.base.rotary_emb, x, positions)
        fused = self._native(kernel) if observe is None else None
        if fused is not None:
            self._run_native(fused, x, cos, sin, masks, caches, skip, kernel)
        else:
            x = self._run_python(x, cos, sin, masks, caches, skip, kernel, observe)
        return kernel.rmsnorm(x, self.base.norm.weight, self.eps)

    def _run_python(self, x, cos, sin, masks, caches, skip, kernel, observe) -> torch.Tensor:
        norm = lambda x, module: kernel.rmsnorm(x, module.weight, self.eps)
        for i, layer in enumerate(self.layers):
            h_in = x
            if i not in skip.attn:
                h = norm(x, layer.input_layernorm)
                x = x + self._attention(layer.self_attn, h, cos, sin, masks, caches, i, kernel)
            if i not in skip.mlp:
                mlp, h = layer.mlp, norm(x, layer.post_attention_layernorm)
                gate, up = _project(h, (mlp.gate_proj, mlp.up_proj), self.plans[i][1])
                x = x + mlp.down_proj(kernel.silu_mul(gate.contiguous(), up.contiguous()))
            if observe is not None:
                observe(i, h_in, x)
        return x

    def _attention(self, attn, h, cos, sin, masks, caches, i, kernel) -> torch.Tensor:
        rows, d = h.shape[0], self.head_dim
        q, k, v = (t.view(rows, -1, d) for t in _project(h, (attn.q_proj, attn.k_proj, attn.v_proj), self.plans[i][0]))
        q, k = kernel.rope(q.contiguous(), cos, sin), kernel.rope(k.contiguous(), cos, sin)
        sizes = [len(m) for m in masks]
        dtype = self.kv_dtype or k.dtype
        kv = [
            cache.layers[i].update(kj.transpose(0, 1)[None].to(dtype), vj.transpose(0, 1)[None].to(dtype))
            for kj, vj, cache in zip(k.split(sizes), v.split(sizes), caches, strict=True)
        ]
        out = kernel.attention_many(q, [k[0] for k, _ in kv], [v[0] for _, v in kv], masks, sizes, self.scale)
        return attn.o_proj(out.reshape(rows, -1))

    def _native(self, kernel) -> FusedDecoder | None:
        """The native layer loop bound to `kernel`'s fp32 entry points, when every projection is quantized."""
        if self._fused is None or self._fused[0] is not kernel:
            linears = [_linears(layer) for layer in self.layers]
            fused = None
            if hasattr(kernel, "addresses") and self.quantized:
                weights = [
                    LayerWeights(
                        tuple(m.qweight for m in ms),
                        tuple(m.bias for m in ms),
                        layer.input_layernorm.weight.float().contiguous(),
                        layer.post_attention_layernorm.weight.float().contiguous(),
                    )
                    for layer, ms in zip(self.layers, linears, strict=True)
                ]
                attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
                dims = dict(
                    hidden=attn.o_proj.out_features,
                    heads=attn.q_proj.out_features // self.head_dim,
                    kv_heads=self.kv_heads,
                    head_dim=self.head_dim,
                    inter=mlp.gate_proj.out_features,
                    eps=self.eps,
                    scale=self.scale,
                    kv_half=int(self.kv_dtype == torch.float16),
                )
                fused = FusedDecoder(attn.q_proj.kernel, weights, dims, kernel.addresses)
            self._fused = (kernel, fused)
        return self._fused[1]

    def _run_native(self, fused: FusedDecoder, x, cos, sin, masks, caches, skip, kernel) -> None:
        """All layers on x in place, through the native loop; the caches gain the rows of every layer that ran
        (the loop advances their lengths in the caches' native tables)."""
        flags = bytes(
            (SKIP_ATTN if i in skip.attn else 0) | (SKIP_MLP if i in skip.mlp else 0) for i in range(len(self.layers))
        )
        seqs, row, max_t, dtype = [], 0, 1, self.kv_dtype or x.dtype
        for cache, mask in zip(caches, masks, strict=True):
            rows = len(mask)
            seqs.append((rows, row, mask))
            row += rows
            cache.reserve(rows, self.kv_heads, self.head_dim, dtype)
            max_t = max(max_t, cache.length + rows)  # layer 0 (never skipped) is the longest
        fused.run(x, cos, sin, flags, seqs, [c.table for c in caches], kernel.attention_scratch(max_t))


def rotary(rope: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, D] fp32 of HF's rotary embedding `rope` at `positions` [R]: the same formula (float32 angles
    position * inv_freq, halves repeated, times attention_scaling), with cos and sin evaluated in float64 by numpy
    and rounded to float32. Why not torch's float32 cos: in a process's first forward, under CPU contention, it
    sometimes returned a table up to 1.5e-4 off (README, "A process's first forward"); numpy's float64 functions
    (no MKL) return the same bits on every call."""
    if getattr(rope, "rope_type", None) in DYNAMIC_ROPE:
        return tuple(t[0].float().contiguous() for t in rope(x[None], positions[None]))
    angles = (positions.float()[:, None] * rope.inv_freq.float()[None, :]).numpy().astype(np.float64)  # [R, D/2]
    halves = (torch.from_numpy(f(angles).astype(np.float32)) * rope.attention_scaling for f in (np.cos, np.sin))
    return tuple(torch.cat((h, h), dim=-1) for h in halves)


def _plan(linears: tuple) -> Plan | None:
    """One kernel call for projections of the same input, when they are all quantized (x quantized once)."""
    if all(isinstance(m, QuantLinear) for m in linears):
        return Plan([m.qweight for m in linears], [m.bias for m in linears])
    return None


def _linears(layer) -> tuple:
    """A layer's projections in the native loop's order: q, k, v, o, gate, up, down."""
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


def _project(h: torch.Tensor, linears: tuple, plan: Plan | None) -> list[torch.Tensor]:
    return linears[0].kernel.run(plan, h) if plan is not None else [m(h) for m in linears]
