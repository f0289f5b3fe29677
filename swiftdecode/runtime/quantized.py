"""A Hugging Face causal LM whose linear layers and embedding table compute from a GGUF file's own quantized
blocks (`QuantLinear`, `QuantEmbedding`); norms and biases are float32 as stored. No float32 copy of a
quantized weight exists at any time: the model is built with empty (meta) parameters, then each GGUF tensor
is decoded straight into the kernel's planes. transformers' GGUF name map and tensor processors give each
tensor its HF parameter and any row permutation (Llama's q/k heads) or value fix-up (Gemma's norms).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from swiftdecode.base.errors import UserError
from swiftdecode.kernels.gguf_index import read_index
from swiftdecode.kernels.modules import QuantEmbedding, QuantLinear
from swiftdecode.kernels.qgemm import QKernel
from swiftdecode.kernels.qweight import FORMATS, QuantWeight


def _processor(arch: str, config):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())


def _names(model: nn.Module, arch: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf's tensor name map of the architecture."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        raise UserError(f"GGUF architecture {arch!r} is unknown to the gguf package; use --weights fp32")
    name_map = get_tensor_name_map(key, n_layers)
    out = {}
    for hf in model.state_dict():
        base, dot, suffix = hf.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            out.setdefault(gguf_name + dot + suffix, hf)
    return out


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The processor's row permutation of tensor `name` (None: rows stay in order); UserError if the processor
    does more than reorder rows (then quantized blocks cannot follow it)."""
    idx = np.arange(n, dtype=np.float64).reshape(n, 1)
    out = processor.process(weights=idx, name=name, tensor_key_mapping={}, parsed_parameters={}).weights
    out = np.asarray(out).reshape(-1)
    if np.array_equal(out, idx[:, 0]):
        return None
    if sorted(out.tolist()) != list(range(n)):
        raise UserError(f"GGUF tensor {name} needs a value transform the quantized path lacks; use --weights fp32")
    return out.astype(np.int64)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def build(gguf: Path, folder: Path, kernel: QKernel, progress: bool = False) -> nn.Module:
    """The model of `gguf` (config and tokenizer in `folder`) on the quantized path, in eval mode."""
    from accelerate import init_empty_weights
    from gguf.quants import dequantize
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass
    meta, tensors = read_index(gguf)
    arch = str(meta.get("general.architecture"))
    processor = _processor(arch, config)
    names = _names(model, arch, config.get_text_config().num_hidden_layers)
    quantized, rest = [], []
    for t in tensors:
        hf = names.get(t.name)
        if hf is None:
            continue
        path, _, pname = hf.rpartition(".")
        module = model.get_submodule(path)
        kind = t.tensor_type.name
        if kind in FORMATS and pname == "weight" and isinstance(module, nn.Linear | nn.Embedding):
            quantized.append((t, path, module))
        else:
            rest.append((t, path, pname))
    for t, path, module in tqdm(quantized, desc="loading quantized weights", disable=not progress):
        k, n = (int(s) for s in t.shape)
        qw = QuantWeight.from_gguf(t.tensor_type.name, t, n, k, _row_order(processor, t.name, n))
        if isinstance(module, nn.Embedding):
            new = QuantEmbedding(qw, kernel, getattr(module, "scalar_embed_scale", None))
        else:
            new = QuantLinear(qw, None, kernel)
        _set(model, path, new)
    for t, path, pname in rest:
        values = dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
        values = processor.process(weights=values, name=t.name, tensor_key_mapping={}, parsed_parameters={}).weights
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        setattr(model.get_submodule(path), pname, nn.Parameter(tensor, requires_grad=False))
    _tie_output(model)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise UserError(f"{gguf.name} lacks tensors for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return model.eval()


def _tie_output(model: nn.Module) -> None:
    """A GGUF without an output tensor shares the embedding table as the output head."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if not (isinstance(head, nn.Linear) and head.weight.device.type == "meta"):
        return
    if isinstance(emb, QuantEmbedding):
        model.set_output_embeddings(QuantLinear(emb.qweight, None, emb.kernel))
    else:
        head.weight = emb.weight
