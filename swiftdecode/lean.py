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

import torch
import torch.nn.functional as F

from swiftdecode.cache import SwiftCache
from swiftdecode.kernels.modules import QuantLinear
from swiftdecode.kernels.qgemm import Plan
from swiftdecode.skip import SkipSet

MODEL_TYPES = ("llama", "qwen2", "mistral")  # same layer anatomy; Qwen3 (q/k norms) and Gemma run through HF


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
    """Forward of the decoder's layers on a SwiftCache, with the fast path's fp32 kernel library (attention,
    RMSNorm, rotary) passed to each call."""

    def __init__(self, model: torch.nn.Module):
        self.base = model.get_decoder()
        self.layers = self.base.layers
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.eps = self.layers[0].input_layernorm.variance_epsilon
        # per layer: the prepared kernel calls of q/k/v and of gate/up (None where not all quantized)
        self.plans = [
            (_plan((a.q_proj, a.k_proj, a.v_proj)), _plan((m.gate_proj, m.up_proj)))
            for a, m in ((layer.self_attn, layer.mlp) for layer in self.layers)
        ]

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
        norm = lambda x, module: kernel.rmsnorm(x, module.weight, self.eps)
        x = self.base.embed_tokens(ids)
        cos, sin = (t[0].float().contiguous() for t in self.base.rotary_emb(x[None], positions[None]))  # [R, D]
        sizes = [len(m) for m in masks]
        for i, layer in enumerate(self.layers):
            h_in = x
            if i not in skip.attn:
                h = norm(x, layer.input_layernorm)
                x = x + self._attention(layer.self_attn, h, cos, sin, masks, caches, sizes, i, kernel)
            if i not in skip.mlp:
                mlp, h = layer.mlp, norm(x, layer.post_attention_layernorm)
                gate, up = _project(h, (mlp.gate_proj, mlp.up_proj), self.plans[i][1])
                x = x + mlp.down_proj(F.silu(gate, inplace=True).mul_(up))
            if observe is not None:
                observe(i, h_in, x)
        return norm(x, self.base.norm)

    def _attention(self, attn, h, cos, sin, masks, caches, sizes, i, kernel) -> torch.Tensor:
        rows, d = h.shape[0], self.head_dim
        q, k, v = (t.view(rows, -1, d) for t in _project(h, (attn.q_proj, attn.k_proj, attn.v_proj), self.plans[i][0]))
        q, k = kernel.rope(q.contiguous(), cos, sin), kernel.rope(k.contiguous(), cos, sin)
        if len(caches) == 1:
            keys, values = caches[0].layers[i].update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            mask = masks[0][:, : keys.shape[2]]
            out = kernel.attention(q.transpose(0, 1), keys[0], values[0], mask, self.scale)
            return attn.o_proj(out.reshape(rows, -1))
        kv = [
            cache.layers[i].update(kj.transpose(0, 1)[None], vj.transpose(0, 1)[None])
            for kj, vj, cache in zip(k.split(sizes), v.split(sizes), caches, strict=True)
        ]
        out = kernel.attention_many(q, [k[0] for k, _ in kv], [v[0] for _, v in kv], masks, sizes, self.scale)
        return attn.o_proj(out.reshape(rows, -1))


def _plan(linears: tuple) -> Plan | None:
    """One kernel call for projections of the same input, when they are all quantized (x quantized once)."""
    if all(isinstance(m, QuantLinear) for m in linears):
        return Plan([m.qweight for m in linears], [m.bias for m in linears])
    return None


def _project(h: torch.Tensor, linears: tuple, plan: Plan | None) -> list[torch.Tensor]:
    return linears[0].kernel.run(plan, h) if plan is not None else [m(h) for m in linears]
