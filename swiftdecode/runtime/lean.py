"""A lean forward for Llama-family decoders (Llama 2/3, Qwen2, Qwen3, Mistral: pre-norm RMSNorm, rotary,
grouped-query attention, SiLU-gated MLP; Qwen3's per-head query/key RMSNorm), over the model's own modules and
weights.

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

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")  # one anatomy (Qwen3: q/k norms; Phi-3: fused)
DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies change with the sequence: HF's module computes those tables


def why_not(model: torch.nn.Module) -> str | None:
    """Why this forward cannot run `model` (its layers then run through transformers' modules); None: it can."""
    config = model.config.get_text_config()
    if config.model_type not in MODEL_TYPES:
        return f"no lean forward for {config.model_type!r} yet (lean: {', '.join(MODEL_TYPES)})"
    if (act := getattr(config, "hidden_act", "silu")) != "silu":
        return f"activation {act!r} (lean: silu)"
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen configs carry a window size that only applies when use_sliding_window is set
    if window and window >= getattr(config, "max_position_embeddings", window + 1):
        window = None  # a window as long as the context (Phi-4-mini's) never hides a key
    return f"sliding-window attention ({window} tokens)" if window else None


class LeanDecoder:
    """Forward of the decoder's layers on SwiftCaches, with the fast path's fp32 kernel library (attention,
    RMSNorm, rotary, SiLU) passed to each call. When every projection is quantized the layer loop runs natively
    (kernels/decoder.py: the same kernels in the same order, so the same bits); a forward that observes hidden
    states, or a model with float projections, runs the loop below."""

    def __init__(self, model: torch.nn.Module):
        self.base = model.get_decoder()
        self.layers = self.base.layers
        attn, config = self.layers[0].self_attn, model.config.get_text_config()
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.widths = (self.heads * self.head_dim, *2 * (self.kv_heads * self.head_dim,))  # q, k, v outputs
        self.eps = self.layers[0].input_layernorm.variance_epsilon
        self.qk_norm = hasattr(attn, "q_norm")  # Qwen3: RMSNorm of each head's query and key (the layers' eps)
        # per layer: the prepared kernel calls of q/k/v and of gate/up (None where not all quantized)
        self.plans = [(_plan(_qkv(layer.self_attn)), _plan(_gate_up(layer.mlp))) for layer in self.layers]
        self._fused: tuple[object, FusedDecoder] | None = None  # (fp32 kernel it is bound to, the native loop)
        linears = [m for layer in self.layers for m in _linears(layer) if m is not None]
        self.quantized = all(isinstance(m, QuantLinear) for m in linears)
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
                gate, up = _split(_project(h, _gate_up(mlp), self.plans[i][1]), 2 * (mlp.down_proj.in_features,))
                x = x + mlp.down_proj(kernel.silu_mul(gate.contiguous(), up.contiguous()))
            if observe is not None:
                observe(i, h_in, x)
        return x

    def _attention(self, attn, h, cos, sin, masks, caches, i, kernel) -> torch.Tensor:
        rows, d = h.shape[0], self.head_dim
        qkv = _split(_project(h, _qkv(attn), self.plans[i][0]), self.widths)
        q, k, v = (t.contiguous().view(rows, -1, d) for t in qkv)
        if self.qk_norm:
            q, k = (kernel.rmsnorm(t, n.weight, self.eps) for t, n in ((q, attn.q_norm), (k, attn.k_norm)))
        q, k = _rope(kernel, q, cos, sin), _rope(kernel, k, cos, sin)
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
                        tuple(None if m is None else m.qweight for m in ms),
                        tuple(None if m is None else m.bias for m in ms),
                        layer.input_layernorm.weight.float().contiguous(),
                        layer.post_attention_layernorm.weight.float().contiguous(),
                        *(_norm(layer.self_attn, n) for n in ("q_norm", "k_norm")),
                    )
                    for layer, ms in zip(self.layers, linears, strict=True)
                ]
                attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
                dims = dict(
                    hidden=attn.o_proj.out_features,
                    heads=self.heads,
                    kv_heads=self.kv_heads,
                    head_dim=self.head_dim,
                    inter=mlp.down_proj.in_features,
                    eps=self.eps,
                    scale=self.scale,
                    kv_half=int(self.kv_dtype == torch.float16),
                    rot_dim=2 * self.base.rotary_emb.inv_freq.numel(),
                )
                fused = FusedDecoder(attn.o_proj.kernel, weights, dims, kernel.addresses)
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
    """cos, sin [R, D] fp32 of HF's rotary embedding `rope` at `positions` [R] (D: the rotated dims of a head):
    the same formula (float32 angles position * inv_freq, halves repeated, times attention_scaling), with cos and
    sin evaluated in float64 by numpy and rounded to float32. Why not torch's float32 cos: in a process's first
    forward, under CPU contention, it sometimes returned a table up to 1.5e-4 off (README, "A process's first
    forward"); numpy's float64 functions (no MKL) return the same bits on every call. Frequencies that change
    with the sequence (longrope: past the original context) come from HF's module, one row at a time, so a row's
    table depends on its own position only (HF takes the batch's longest)."""
    if getattr(rope, "rope_type", None) in DYNAMIC_ROPE:
        rows = [rope(x[None, r : r + 1], positions[None, r : r + 1]) for r in range(len(positions))]
        return tuple(torch.cat([row[i][0] for row in rows]).float().contiguous() for i in (0, 1))
    angles = (positions.float()[:, None] * rope.inv_freq.float()[None, :]).numpy().astype(np.float64)  # [R, D/2]
    halves = (torch.from_numpy(f(angles).astype(np.float32)) * rope.attention_scaling for f in (np.cos, np.sin))
    return tuple(torch.cat((h, h), dim=-1) for h in halves)


def _norm(attn: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The attention module's `name` norm weight (fp32, contiguous), if it has one."""
    module = getattr(attn, name, None)
    return None if module is None else module.weight.float().contiguous()


def _rope(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on x [q, heads, D] (contiguous, in place): each head's first cos.shape[-1] dims (all, but for a
    partial rotary: Phi-4), the rest as they are."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return kernel.rope(x, cos, sin)
    x[..., :rot] = kernel.rope(x[..., :rot].contiguous(), cos, sin)
    return x


def _split(outs: list[torch.Tensor], widths: tuple[int, ...]) -> list[torch.Tensor]:
    """The projections' outputs, one per width: as computed, or a fused projection's [R, sum] split."""
    return outs if len(outs) == len(widths) else list(outs[0].split(widths, dim=-1))


def _plan(linears: tuple) -> Plan | None:
    """One kernel call for projections of the same input, when they are all quantized (x quantized once)."""
    if all(isinstance(m, QuantLinear) for m in linears):
        return Plan([m.qweight for m in linears], [m.bias for m in linears])
    return None


def _qkv(attn: torch.nn.Module) -> tuple:
    """The attention's q, k, v projections, or Phi-3's one fused projection (rows: q's, then k's, then v's)."""
    return (attn.qkv_proj,) if hasattr(attn, "qkv_proj") else (attn.q_proj, attn.k_proj, attn.v_proj)


def _gate_up(mlp: torch.nn.Module) -> tuple:
    """The MLP's gate and up projections, or Phi-3's one fused projection (rows: gate's, then up's)."""
    return (mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj)


def _linears(layer) -> tuple:
    """A layer's projections in the native loop's order: q, k, v, o, gate, up, down (None after a fused one)."""
    qkv, gate_up = _qkv(layer.self_attn), _gate_up(layer.mlp)
    pad = lambda ms, n: (*ms, *(None,) * (n - len(ms)))
    return *pad(qkv, 3), layer.self_attn.o_proj, *pad(gate_up, 2), layer.mlp.down_proj


def _project(h: torch.Tensor, linears: tuple, plan: Plan | None) -> list[torch.Tensor]:
    return linears[0].kernel.run(plan, h) if plan is not None else [m(h) for m in linears]
