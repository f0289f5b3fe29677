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

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: SwiftCache,
        skip: SkipSet,
        kernel,
        observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """ids, positions [q]; mask [q, T] additive over the keys of a layer that has every entry (a layer whose
        attention was skipped in a draft has fewer: its keys are the mask's first columns). Returns [q, H]."""
        norm = lambda x, module: kernel.rmsnorm(x, module.weight, self.eps)
        x = self.base.embed_tokens(ids)
        cos, sin = (t[0].float().contiguous() for t in self.base.rotary_emb(x[None], positions[None]))  # [q, D]
        for i, layer in enumerate(self.layers):
            h_in = x
            if i not in skip.attn:
                h = norm(x, layer.input_layernorm)
                x = x + self._attention(layer.self_attn, h, cos, sin, mask, cache, i, kernel)
            if i not in skip.mlp:
                mlp, h = layer.mlp, norm(x, layer.post_attention_layernorm)
                gate, up = _project(h, (mlp.gate_proj, mlp.up_proj))
                x = x + mlp.down_proj(F.silu(gate, inplace=True).mul_(up))
            if observe is not None:
                observe(i, h_in, x)
        return norm(x, self.base.norm)

    def _attention(self, attn, h, cos, sin, mask, cache, i, kernel) -> torch.Tensor:
        q_len, d = h.shape[0], self.head_dim
        q, k, v = (t.view(q_len, -1, d) for t in _project(h, (attn.q_proj, attn.k_proj, attn.v_proj)))
        q, k = kernel.rope(q.contiguous(), cos, sin), kernel.rope(k.contiguous(), cos, sin)
        keys, values = cache.layers[i].update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        t = keys.shape[2]
        out = kernel.attention(q.transpose(0, 1), keys[0], values[0], mask[:, :t], self.scale)
        return attn.o_proj(out.reshape(q_len, -1))


def _project(h: torch.Tensor, linears: tuple) -> list[torch.Tensor]:
    """The projections of one input: a single kernel call when they are all quantized (x quantized once)."""
    if all(isinstance(m, QuantLinear) for m in linears):
        return linears[0].kernel.linear_many(h, [m.qweight for m in linears], [m.bias for m in linears])
    return [m(h) for m in linears]
