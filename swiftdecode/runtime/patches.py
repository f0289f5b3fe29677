"""Every change swiftdecode makes to a transformers model's objects, in this one module, and why each is one.

A transformers decoder layer calls its sublayers (`self.self_attn(...)`, `self.mlp(...)`, each nn.Linear)
directly, and picks its attention function by name from transformers' registry. Our batch-invariant kernels and
the layer-skip draft must run inside those calls, so three things are changed, each undone by its counterpart:
- `swap_class` makes a float32 nn.Linear a `FastLinear` (a subclass: same object, same parameters) and back. A
  class swap rather than a new module, because the tied lm_head/embedding weight, transformers' own references
  (get_output_embeddings, hooks) and the caller's references must stay the same object, and a model must move
  between paths in place (`doctor` times every path on one loaded model).
- `use_attention` registers our order-invariant attention under its own name in `AttentionInterface`
  (transformers' documented extension point; its registry is process-wide, our names are per ISA, so models on
  different paths share a process) and selects it with `set_attn_implementation`; `restore_attention` selects
  the model's previous implementation again.
- `wrap_sublayers` gives each decoder layer's `self_attn` and `mlp` instance (not class) a forward that returns
  zeros while `skips(layer, kind)` says so: other models of the class are untouched and the module tree (and
  its state_dict) is unchanged. A model's sublayers are wrapped once (`Patches.skipper`).
What swiftdecode keeps on a model beside `model.fast_path` (`fastpath.info_of`) is its `Patches`, one attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ATTR = "_swiftdecode"  # the one attribute (a `Patches`) swiftdecode writes on a model besides `fast_path`


@dataclass
class Patches:
    """What swiftdecode changed on one model: the attention implementation it replaced (None: none replaced) and
    the object gating its sublayers (None before the first SwiftModel on it)."""

    attention_before: str | None = None
    skipper: object | None = None


def patches_of(model: nn.Module) -> Patches:
    """The model's Patches, made empty on first use."""
    if ATTR not in model.__dict__:
        model.__dict__[ATTR] = Patches()
    return model.__dict__[ATTR]


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Make `module` an instance of `cls` (nn.Linear or a subclass of it that adds no parameters), in place."""
    module.__class__ = cls


def use_attention(model: nn.Module, name: str, attention: Callable, mask: Callable) -> None:
    """Register `attention` (and its `mask` function) as transformers' implementation `name` and select it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    patches_of(model).attention_before = model.config._attn_implementation
    model.set_attn_implementation(name)


def restore_attention(model: nn.Module) -> None:
    """Select the implementation `use_attention` replaced, if it replaced one."""
    patches = patches_of(model)
    if patches.attention_before is not None:
        model.set_attn_implementation(patches.attention_before)
        patches.attention_before = None


def wrap_sublayers(layers: nn.ModuleList, skips: Callable[[int, str], bool]) -> None:
    """Each layer's `self_attn` and `mlp` return zeros (attention: (zeros, None)) while skips(index, kind) with
    kind "attn" or "mlp"; their own forward otherwise."""

    def gated(forward: Callable, index: int, kind: str) -> Callable:
        def skippable(*args, **kwargs):
            if skips(index, kind):
                zeros = torch.zeros_like(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
                return (zeros, None) if kind == "attn" else zeros
            return forward(*args, **kwargs)

        return skippable

    for i, layer in enumerate(layers):
        layer.self_attn.forward = gated(layer.self_attn.forward, i, "attn")
        layer.mlp.forward = gated(layer.mlp.forward, i, "mlp")
