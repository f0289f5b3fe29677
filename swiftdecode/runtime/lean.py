"""A lean forward for Llama-family decoders (Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3, SmolLM3, Gemma 2 and 3:
pre-norm RMSNorm, rotary, grouped-query attention, gated MLP; Qwen3's and Gemma 3's per-head query/key RMSNorm,
SmolLM3's layers without rotary, Gemma's GeLU, norms of the sublayers' outputs and sliding-window layers (Gemma
3's with a rotary of their own), Gemma 2's soft-capped attention scores), over the model's own modules and
weights.

Why: with quantized weights a decoder layer's matmuls take ~0.5 ms, and transformers' module stack around them
(hooks, mask and cache plumbing, a dozen small tensor ops per norm and rotary) costs about as much again. This
forward calls the same projections in gpt-fast style: one loop over layers, norms and attention in the
batch-invariant kernel, sublayers of the skip set left out. Every row's result depends only on its own inputs,
so verification stays bit-identical to one-token decoding. Other architectures run through transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from swiftdecode.kernels.decoder import NO_ROTARY, SKIP_ATTN, SKIP_MLP, FusedDecoder, LayerWeights
from swiftdecode.kernels.modules import QuantLinear
from swiftdecode.kernels.qgemm import Plan
from swiftdecode.runtime.cache import SwiftCache
from swiftdecode.runtime.skip import SkipSet

# one anatomy (Qwen3: q/k norms; Phi-3: fused projections; SmolLM3: layers without rotary; Gemma: GeLU, norms of
# the sublayers' outputs, sliding-window layers, Gemma 2's capped scores, Gemma 3's q/k norms and second rotary)
GEMMA = ("gemma2", "gemma3_text")
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "smollm3", *GEMMA)
DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies change with the sequence: HF's module computes those tables
GELU_TANH = "gelu_pytorch_tanh"  # Gemma's MLP activation (the kernel library's gelu_mul)
NORM_PLUS_ONE = GEMMA  # their RMSNorm scales by 1 + weight
SLIDING = "sliding_attention"  # config.layer_types' name of a layer attending within the sliding window


def why_not(model: torch.nn.Module) -> str | None:
    """Why this forward cannot run `model` (its layers then run through transformers' modules); None: it can."""
    config = model.config.get_text_config()
    if config.model_type not in MODEL_TYPES:
        return f"no lean forward for {config.model_type!r} yet (lean: {', '.join(MODEL_TYPES)})"
    gemma = config.model_type in GEMMA
    if (act := _activation(config)) != (GELU_TANH if gemma else "silu"):
        return f"activation {act!r} (lean: silu; Gemma: {GELU_TANH})"
    if gemma and getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None  # sliding-window layers (_spec) and Gemma 2's capped scores run here


@dataclass(frozen=True)
class _Layer:
    """A layer as both loops run it (the fields of kernels/decoder.py's LayerWeights after its projections): norm
    weights fp32 [hidden] before attention and MLP, Qwen3's and Gemma's per-head query/key norm weights
    [head_dim], the rotary table of its queries and keys (NO_ROTARY: none), Gemma's norm weights of the
    attention's and the MLP's outputs [hidden], and whether it attends within the sliding window. Gemma's norm
    weights are 1 + its weights, as its RMSNorm scales (the same float32 sum)."""

    norm_attn: torch.Tensor
    norm_mlp: torch.Tensor
    norm_q: torch.Tensor | None
    norm_k: torch.Tensor | None
    rotary: int
    norm_attn_out: torch.Tensor | None
    norm_mlp_out: torch.Tensor | None
    sliding: bool


class LeanDecoder:
    """Forward of the decoder's layers on SwiftCaches, with the fast path's fp32 kernel library (attention,
    RMSNorm, rotary, SiLU, GeLU) passed to each call. When every projection is quantized the layer loop runs
    natively (kernels/decoder.py: the same kernels in the same order, so the same bits); a forward that observes
    hidden states, or a model with float projections, runs the loop below."""

    def __init__(self, model: torch.nn.Module):
        self.base = model.get_decoder()
        self.layers = self.base.layers
        attn, config = self.layers[0].self_attn, model.config.get_text_config()
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.softcap = getattr(config, "attn_logit_softcapping", None)  # Gemma 2's cap of the attention scores
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.widths = (self.heads * self.head_dim, *2 * (self.kv_heads * self.head_dim,))  # q, k, v outputs
        norm = self.layers[0].input_layernorm
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))  # Gemma's RMSNorm: eps
        rope = self.base.rotary_emb
        # the rotary tables: one, or one per layer type (Gemma 3: the sliding layers' base differs)
        self.kinds = list(rope.layer_types) if hasattr(rope, "layer_types") else [None]
        self.rot_dim = 2 * _inv_freq(rope, self.kinds[0]).numel()
        plus = config.model_type in NORM_PLUS_ONE
        self.specs = [_spec(layer, config, self.kinds, plus) for layer in self.layers]
        self.final_norm = _weight(self.base.norm, plus)
        self.window = config.sliding_window if any(s.sliding for s in self.specs) else None
        self.gelu = _activation(config) == GELU_TANH
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
        mask's first columns; the sliding layers' masks hide the keys a window or more behind too: `windowed`).
        Returns [R, H]. Row r's result depends on its own inputs and sequence only, bit for bit: every other
        operation is row-local."""
        x = self.base.embed_tokens(ids).contiguous()
        tables = [rotary(self.base.rotary_emb, x, positions, kind) for kind in self.kinds]
        masks = [(m, windowed(m, p, self.window) if self.window else None) for m, p in _per_sequence(masks, positions)]
        if self.window:
            for cache, rows in zip(caches, positions.split([len(m) for m, _ in masks]), strict=True):
                cache.check_window(int(rows.min()))
        fused = self._native(kernel) if observe is None else None
        if fused is not None:
            self._run_native(fused, x, tables, masks, caches, skip, kernel)
        else:
            x = self._run_python(x, tables, masks, caches, skip, kernel, observe)
        return kernel.rmsnorm(x, self.final_norm, self.eps)

    def _run_python(self, x, tables, masks, caches, skip, kernel, observe) -> torch.Tensor:
        """The layers on x; masks: (mask, the sliding layers' or None) per sequence."""
        for i, (layer, spec) in enumerate(zip(self.layers, self.specs, strict=True)):
            h_in = x
            if i not in skip.attn:
                h = kernel.rmsnorm(x, spec.norm_attn, self.eps)
                own = [local if spec.sliding else full for full, local in masks]
                out = self._attention(layer.self_attn, spec, h, tables, own, caches, i, kernel)
                x = x + self._post(kernel, out, spec.norm_attn_out)
            if i not in skip.mlp:
                mlp, h = layer.mlp, kernel.rmsnorm(x, spec.norm_mlp, self.eps)
                gate, up = _split(_project(h, _gate_up(mlp), self.plans[i][1]), 2 * (mlp.down_proj.in_features,))
                act = kernel.gelu_mul if self.gelu else kernel.silu_mul
                x = x + self._post(kernel, mlp.down_proj(act(gate.contiguous(), up.contiguous())), spec.norm_mlp_out)
            if observe is not None:
                observe(i, h_in, x)
        return x

    def _post(self, kernel, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output as the residual stream adds it: normed first where the layer says (Gemma 3)."""
        return out if norm is None else kernel.rmsnorm(out.contiguous(), norm, self.eps)

    def _attention(self, attn, spec: _Layer, h, tables, masks, caches, i, kernel) -> torch.Tensor:
        rows, d = h.shape[0], self.head_dim
        qkv = _split(_project(h, _qkv(attn), self.plans[i][0]), self.widths)
        q, k, v = (t.contiguous().view(rows, -1, d) for t in qkv)
        if spec.norm_q is not None:
            q, k = kernel.rmsnorm(q, spec.norm_q, self.eps), kernel.rmsnorm(k, spec.norm_k, self.eps)
        if spec.rotary != NO_ROTARY:
            q, k = _rope(kernel, q, *tables[spec.rotary]), _rope(kernel, k, *tables[spec.rotary])
        sizes = [len(m) for m in masks]
        dtype = self.kv_dtype or k.dtype
        kv = [
            cache.layers[i].update(kj.transpose(0, 1)[None].to(dtype), vj.transpose(0, 1)[None].to(dtype))
            for kj, vj, cache in zip(k.split(sizes), v.split(sizes), caches, strict=True)
        ]
        keys, values = [k[0] for k, _ in kv], [v[0] for _, v in kv]
        masks = [m[:, c.layers[i].first :] for m, c in zip(masks, caches, strict=True)]  # keys held from `first` on
        out = kernel.attention_many(q, keys, values, masks, sizes, self.scale, self.softcap)
        return attn.o_proj(out.reshape(rows, -1))

    def _native(self, kernel) -> FusedDecoder | None:
        """The native layer loop bound to `kernel`'s fp32 entry points, when every projection is quantized."""
        if self._fused is None or self._fused[0] is not kernel:
            fused = None
            if hasattr(kernel, "addresses") and self.quantized:
                weights = [
                    LayerWeights(
                        tuple(None if m is None else m.qweight for m in ms),
                        tuple(None if m is None else m.bias for m in ms),
                        **vars(spec),
                    )
                    for spec, ms in zip(self.specs, map(_linears, self.layers), strict=True)
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
                    rot_dim=self.rot_dim,
                    gelu=int(self.gelu),
                    softcap=self.softcap or 0.0,
                )
                fused = FusedDecoder(attn.o_proj.kernel, weights, dims, kernel.addresses)
            self._fused = (kernel, fused)
        return self._fused[1]

    def _run_native(self, fused: FusedDecoder, x, tables, masks, caches, skip, kernel) -> None:
        """All layers on x in place, through the native loop; the caches gain the rows of every layer that ran
        (the loop advances their lengths in the caches' native tables)."""
        flags = bytes(
            (SKIP_ATTN if i in skip.attn else 0) | (SKIP_MLP if i in skip.mlp else 0) for i in range(len(self.layers))
        )
        seqs, row, max_t, dtype = [], 0, 1, self.kv_dtype or x.dtype
        for cache, (mask, local) in zip(caches, masks, strict=True):
            rows = len(mask)
            seqs.append((rows, row, mask, local))
            row += rows
            cache.reserve(rows, self.kv_heads, self.head_dim, dtype)
            max_t = max(max_t, cache.length + rows)  # layer 0 (never skipped) is the longest
        fused.run(x, tables, flags, seqs, [c.table for c in caches], kernel.attention_scratch(max_t))


def windowed(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """One sequence's mask [q, T] (its q rows at `positions` [q] after T − q cached keys) with the keys `window` or
    more positions behind a row hidden too, as HF's sliding window hides them (a key at p_k is visible from p_q
    only when p_q − p_k < window). A cached key's position is its index (runtime/tree.py), a new row's key its
    row's position. A row's mask depends on its own position and mask row only."""
    q, t = mask.shape
    keys = torch.cat([torch.arange(t - q), positions])
    return mask.masked_fill(positions[:, None] - keys[None, :] >= window, torch.finfo(mask.dtype).min)


def _per_sequence(masks: list[torch.Tensor], positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mask, its rows' positions) per sequence: sequence j's rows follow sequence j−1's."""
    return list(zip(masks, positions.split([len(m) for m in masks]), strict=True))


def _activation(config) -> str:
    """The MLP's activation function's name (Gemma's config calls it hidden_activation)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _weight(norm: torch.nn.Module | None, plus_one: bool) -> torch.Tensor | None:
    """An RMSNorm's weight fp32 contiguous, as the kernel scales by it: Gemma's 1 + weight (its RMSNorm's float32
    sum), else the weight itself (no copy when it is fp32 contiguous)."""
    if norm is None:
        return None
    return (norm.weight.float() + 1 if plus_one else norm.weight.float()).contiguous()


def _spec(layer, config, kinds: list[str | None], plus_one: bool) -> _Layer:
    """Layer `layer` as the loops run it; kinds: the rotary tables' layer types (None: one table for all)."""
    attn, types = layer.self_attn, getattr(config, "layer_types", None) or []
    kind = types[attn.layer_idx] if types else None
    sliding = kind == SLIDING if types else _uniform_window(config) is not None
    rotary = kinds.index(kind if kind in kinds else None) if getattr(attn, "use_rope", True) else NO_ROTARY
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # norms around both sublayers; its MLP's input norm is this
    w = lambda name: _weight(getattr(layer, name), plus_one)
    return _Layer(
        w("input_layernorm"),
        w("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"),
        _weight(getattr(attn, "q_norm", None), plus_one),
        _weight(getattr(attn, "k_norm", None), plus_one),
        rotary,
        w("post_attention_layernorm") if gemma else None,
        w("post_feedforward_layernorm") if gemma else None,
        sliding,
    )


def _uniform_window(config) -> int | None:
    """The window every layer attends within, for a config without layer types (Mistral's, Phi-3-mini's), or
    None: none, or one as long as the context (Phi-4-mini's), which never hides a key."""
    window = getattr(config, "sliding_window", None)
    return window if window and window < getattr(config, "max_position_embeddings", window + 1) else None


def rotary(
    rope: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, kind: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, D] fp32 of HF's rotary embedding `rope` at `positions` [R] (D: the rotated dims of a head; kind:
    the layer type whose table, for a module with one per type: Gemma 3's): the same formula (float32 angles
    position * inv_freq, halves repeated, times attention_scaling), with cos and sin evaluated in float64 by numpy
    and rounded to float32. Why not torch's float32 cos: in a process's first forward, under CPU contention, it
    sometimes returned a table up to 1.5e-4 off (README, "A process's first forward"); numpy's float64 functions
    (no MKL) return the same bits on every call. Frequencies that change with the sequence (longrope: past the
    original context) come from HF's module, one row at a time, so a row's table depends on its own position only
    (HF takes the batch's longest)."""
    prefix, args = ("", ()) if kind is None else (f"{kind}_", (kind,))
    rope_type = getattr(rope, "rope_type", None)
    if (rope_type if kind is None else rope_type[kind]) in DYNAMIC_ROPE:
        rows = [rope(x[None, r : r + 1], positions[None, r : r + 1], *args) for r in range(len(positions))]
        return tuple(torch.cat([row[i][0] for row in rows]).float().contiguous() for i in (0, 1))
    inv_freq, scaling = _inv_freq(rope, kind), getattr(rope, f"{prefix}attention_scaling")
    angles = (positions.float()[:, None] * inv_freq.float()[None, :]).numpy().astype(np.float64)  # [R, D/2]
    halves = (torch.from_numpy(f(angles).astype(np.float32)) * scaling for f in (np.cos, np.sin))
    return tuple(torch.cat((h, h), dim=-1) for h in halves)


def _inv_freq(rope: torch.nn.Module, kind: str | None) -> torch.Tensor:
    """The rotary's inverse frequencies [D/2] (of layer type `kind`'s table, if given)."""
    return getattr(rope, "inv_freq" if kind is None else f"{kind}_inv_freq")


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
