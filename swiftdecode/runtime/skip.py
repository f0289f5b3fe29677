"""Layer-skip draft model: the model itself with some attention / MLP sublayers turned into identities.

A skipped sublayer contributes nothing to the residual stream and never touches the KV cache, so the draft model
shares every weight and the cache with the full model. Skipping is switched per forward by `LayerSkipper.use`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from swiftdecode.base.errors import UserError
from swiftdecode.runtime.patches import patches_of, wrap_sublayers


@dataclass(frozen=True)
class SkipSet:
    """The draft model: decoder layers whose attention / MLP are skipped (first and last layer never are), and
    the activation-sparsity level of the MLPs that run (`fastpath.SPARSITY_LEVELS`; 0 = dense)."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()
    sparsity: int = 0

    @property
    def size(self) -> int:
        return len(self.attn) + len(self.mlp)

    def to_vector(self, n_layers: int) -> np.ndarray:
        """Length 2·(L−2)+1: attention bits of layers 1..L−2, then MLP bits, then the sparsity level."""
        inner = range(1, n_layers - 1)
        bits = [i in self.attn for i in inner] + [i in self.mlp for i in inner]
        return np.array([*bits, self.sparsity], dtype=np.float64)

    @classmethod
    def from_vector(cls, v: np.ndarray) -> SkipSet:
        n = (len(v) - 1) // 2
        return cls(
            frozenset(i + 1 for i in range(n) if v[i] > 0.5),
            frozenset(i + 1 for i in range(n) if v[n + i] > 0.5),
            int(round(v[-1])),
        )

    def to_dict(self) -> dict[str, list[int] | int]:
        return {"attn": sorted(self.attn), "mlp": sorted(self.mlp), "sparsity": self.sparsity}

    @classmethod
    def uniform(cls, n_layers: int, ratio: float = 0.5) -> SkipSet:
        """Skip attention and MLP of evenly spaced inner layers, about `ratio` of all inner sublayers."""
        inner = list(range(1, n_layers - 1))
        k = round(ratio * len(inner))
        chosen = {inner[int(j * len(inner) / k)] for j in range(k)} if k else set()
        return cls(frozenset(chosen), frozenset(chosen))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM, checked for the usual `self_attn` / `mlp` structure."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    layers = getattr(base, "layers", None)
    if layers is None or not all(hasattr(m, "self_attn") and hasattr(m, "mlp") for m in layers):
        raise UserError(
            f"{type(model).__name__} is not supported: swiftdecode needs decoder layers with `self_attn` and `mlp` "
            "sublayers (Llama, Qwen2/3, Gemma, Mistral, Phi-3, Granite, OLMo and similar)"
        )
    if len(layers) < 3:
        raise UserError(f"{type(model).__name__} has {len(layers)} layers; layer skipping needs at least 3")
    return layers


class LayerSkipper:
    """Gates each decoder layer's `self_attn` and `mlp` (`patches.wrap_sublayers`): sublayers in the active SkipSet
    return zeros."""

    def __init__(self, model: torch.nn.Module):
        self.layers = decoder_layers(model)
        self.active = SkipSet()
        wrap_sublayers(self.layers, self.skips)

    @classmethod
    def of(cls, model: torch.nn.Module) -> LayerSkipper:
        """The model's skipper, wrapping its sublayers on first use only (generators on one model share it)."""
        patches = patches_of(model)
        if patches.skipper is None:
            patches.skipper = cls(model)
        return patches.skipper

    def skips(self, index: int, kind: str) -> bool:
        """Whether sublayer `kind` ("attn" or "mlp") of layer `index` is skipped now."""
        return index in getattr(self.active, kind)

    @contextmanager
    def use(self, skip: SkipSet | None):
        previous, self.active = self.active, skip or SkipSet()
        try:
            yield
        finally:
            self.active = previous
