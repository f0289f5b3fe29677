"""A Hugging Face causal LM whose linear layers and embedding table compute from a GGUF file's own quantized
blocks (`QuantLinear`, `QuantEmbedding`); norms and biases are float32 as stored. No float32 copy of a
quantized weight exists at any time: the model is built with empty (meta) parameters, then each GGUF tensor
is decoded straight into the kernel's planes. transformers' GGUF name map and tensor processors give each
tensor its HF parameter and any row permutation (Llama's q/k heads) or value fix-up (Gemma's norms).

The planes are laid out once per GGUF and kept in the model's cache entry (kernels/layout_cache.py): later loads
memory-map them, so a start costs no layout and the weights are page-cache pages rather than a private copy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from swiftdecode.base.errors import UserError
from swiftdecode.hub.convert import LLAMA_LIKE, ROPE_FREQS_TENSOR, attention_for, divide_rotary
from swiftdecode.kernels.gguf_index import TensorInfo, read_index
from swiftdecode.kernels.layout_cache import LAYOUT_FILE, LayoutWriter, layout_key, read_layout
from swiftdecode.kernels.modules import QuantEmbedding, QuantLinear
from swiftdecode.kernels.qgemm import QKernel
from swiftdecode.kernels.qweight import FORMATS, QuantWeight, kernel_takes

LAYOUT_CACHE_ENV = "SWIFTDECODE_LAYOUT_CACHE"  # "0": lay the weights out at every load, never read or write a cache


def _processor(arch: str, config):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = "llama" if arch in LLAMA_LIKE else arch  # stored as llama's: the q/k rows' permutation undone
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
    from gguf.quants import dequantize

    config, model = _empty_model(folder)
    meta, tensors = read_index(gguf)
    arch = str(meta.get("general.architecture"))
    processor = _processor(arch, config)
    names = _names(model, arch, config.get_text_config().num_hidden_layers)
    quantized, rest = _split(model, tensors, names)
    _say_dequantized(gguf, model, rest)
    specs = [(t, _row_order(processor, t.name, int(t.shape[1]))) for t, _, _ in quantized]
    weights = _quant_weights(gguf, folder, specs, progress)
    for t, path, module in quantized:
        if isinstance(module, nn.Embedding):
            new = QuantEmbedding(weights[t.name], kernel, getattr(module, "scalar_embed_scale", None))
        else:
            new = QuantLinear(weights[t.name], None, kernel)
        _set(model, path, new)
    for t, path, pname in rest:
        values = dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
        values = processor.process(weights=values, name=t.name, tensor_key_mapping={}, parsed_parameters={}).weights
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        setattr(model.get_submodule(path), pname, nn.Parameter(tensor, requires_grad=False))
    _tie_output(model)
    _rope_factors(model, tensors)
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise UserError(f"{gguf.name} lacks tensors for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return model.eval()


def _empty_model(folder: Path):
    """(config, model with empty (meta) parameters) of the HF folder `folder`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention_for(config))
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass
    return config, model


def _split(model: nn.Module, tensors: list[TensorInfo], names: dict[str, str]):
    """([(tensor, module path, module)] of the weights the kernel computes from, [(tensor, module path, parameter
    name)] of the rest (dequantized to float32)); tensors without an HF parameter are left out."""
    quantized, rest = [], []
    for t in tensors:
        hf = names.get(t.name)
        if hf is None:
            continue
        path, _, pname = hf.rpartition(".")
        module = model.get_submodule(path)
        kernel = kernel_takes(t.tensor_type.name, int(t.shape[0]))
        if kernel and pname == "weight" and isinstance(module, nn.Linear | nn.Embedding):
            quantized.append((t, path, module))
        else:
            rest.append((t, path, pname))
    return quantized, rest


def _say_dequantized(gguf: Path, model: nn.Module, rest: list[tuple[TensorInfo, str, str]]) -> None:
    """One stderr line where matrix weights of the file have no kernel (types outside FORMATS, such as IQ1-IQ3, or
    rows not in whole 32-blocks): they are dequantized to float32 and multiplied by torch, at 4 bytes a value (a
    file of such types takes a multiple of its size in memory)."""
    from collections import Counter

    matrices = [
        t
        for t, path, pname in rest
        if pname == "weight"
        and len(t.shape) == 2
        and t.tensor_type.name != "F32"
        and isinstance(model.get_submodule(path), nn.Linear | nn.Embedding)
    ]
    if not matrices:
        return
    kinds = Counter(t.tensor_type.name for t in matrices)
    gb = sum(4 * t.n_rows * int(t.shape[0]) for t in matrices) / 1e9
    print(
        f"swiftdecode: {gguf.name}: no quantized kernel for {', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))} "
        f"(kernels: {', '.join(FORMATS)}); those tensors are dequantized to float32 ({gb:.1f} GB) and run on torch",
        file=sys.stderr,
    )


def _quant_weights(
    gguf: Path, folder: Path, specs: list[tuple[TensorInfo, np.ndarray | None]], progress: bool
) -> dict[str, QuantWeight]:
    """GGUF tensor name -> its weight, for `specs` [(tensor, row order or None)]: memory-mapped from the layout
    cache in `folder` where it holds this GGUF's layout, else laid out from the GGUF's blocks and cached (in
    memory only where the folder cannot take the cache, or $SWIFTDECODE_LAYOUT_CACHE is 0)."""

    if os.environ.get(LAYOUT_CACHE_ENV) == "0":
        return dict(_lay_out(specs, progress))
    file = folder / LAYOUT_FILE
    key = layout_key(gguf, [(t.name, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]), rows) for t, rows in specs])
    cached = read_layout(file, key)
    if cached is not None and cached.keys() == {t.name for t, _ in specs}:
        return cached
    try:
        with LayoutWriter(file, key, sum(t.n_rows * t.row_bytes for t, _ in specs)) as writer:
            print(f"swiftdecode: laying out {gguf.name} for the kernel once; caching it in {file}", file=sys.stderr)
            for name, w in _lay_out(specs, progress):
                writer.add(name, w)
            writer.commit()
    except OSError as e:
        why = e.strerror or e
        print(f"swiftdecode: cannot cache the kernel layout in {folder} ({why}); loading without it", file=sys.stderr)
        return dict(_lay_out(specs, progress))
    return read_layout(file, key) or dict(_lay_out(specs, progress))


def _lay_out(specs: list[tuple[TensorInfo, np.ndarray | None]], progress: bool):
    """(GGUF tensor name, its QuantWeight) of each spec, in order, laid out from the GGUF's blocks by
    torch.get_num_threads() workers (numpy's array work releases the GIL), at most that many tensors ahead of the
    consumer, so no more than that many laid-out tensors are held at once."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    def one(t: TensorInfo, rows: np.ndarray | None) -> tuple[str, QuantWeight]:
        k, n = (int(s) for s in t.shape)
        return t.name, QuantWeight.from_gguf(t.tensor_type.name, t, n, k, rows)

    workers = max(1, torch.get_num_threads())
    with (
        ThreadPoolExecutor(workers) as pool,
        tqdm(total=len(specs), desc="loading quantized weights", disable=not progress) as bar,
    ):
        ahead: deque = deque()
        for spec in specs:
            ahead.append(pool.submit(one, *spec))
            if len(ahead) > workers:
                yield ahead.popleft().result()
                bar.update()
        while ahead:
            yield ahead.popleft().result()
            bar.update()


def _rope_factors(model: nn.Module, tensors: list[TensorInfo]) -> None:
    """Llama 3's rotary factors (`rope_freqs`), where the GGUF has them, applied (hub.convert.divide_rotary)."""
    t = next((t for t in tensors if t.name == ROPE_FREQS_TENSOR), None)
    if t is not None:
        from gguf.quants import dequantize

        divide_rotary(model, np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))


def _tie_output(model: nn.Module) -> None:
    """A GGUF without an output tensor shares the embedding table as the output head."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if not (isinstance(head, nn.Linear) and head.weight.device.type == "meta"):
        return
    if isinstance(emb, QuantEmbedding):
        model.set_output_embeddings(QuantLinear(emb.qweight, None, emb.kernel))
    else:
        head.weight = emb.weight
