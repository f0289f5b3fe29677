"""swiftdecode: lossless on-the-fly self-speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

from importlib import import_module

from swiftdecode.base.config import ACT_DEFAULT, METHODS, check_act_block, isa_of
from swiftdecode.base.errors import UserError

__version__ = "0.1.0"
__all__ = ["load", "Generator", "GenerationResult", "StreamEvent", "UserError", "METHODS"]


def __getattr__(name: str):
    """Engine names are imported on first use, so `swiftdecode --help` does not pay for torch."""
    if name in ("Generator", "GenerationResult", "StreamEvent"):
        return getattr(import_module("swiftdecode.engine.generator"), name)
    raise AttributeError(name)


def load(
    name_or_path: str = "smollm2-135m",
    *,
    fast_path: str = "auto",
    cache_dir: str | None = None,
    weights: str = "gguf",
    progress: bool = True,
    act_block: int = ACT_DEFAULT,
):
    """Load a registry model, HF folder, .gguf file or hub id as (model, tokenizer), with the fast CPU
    matmul path installed (`fast_path="torch"` keeps torch's own attention and float matmuls).

    weights="gguf" (default): a model that comes as a GGUF computes from its own quantized blocks (the
    qgemm kernel; HF folders and hub ids load their own weights); "fp32": dequantised once to float32.
    fast_path "skinny-avx512" / "skinny-amx" / "skinny-avxvnni" / "skinny-avx2" picks that ISA's build of every
    kernel, the quantized ones included (their results are the same bits on all: only the speed differs).
    act_block: values per int8 activation scale of the quantized products (32 or 256, base.config.ACT_BLOCKS)."""
    from swiftdecode.hub import WEIGHTS, load_model, locate_gguf
    from swiftdecode.runtime.fastpath import accelerate

    if weights not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHTS)}")
    check_act_block(act_block)
    files = locate_gguf(name_or_path, cache_dir=cache_dir, progress=progress) if weights == "gguf" else None
    if files is None:
        model, tokenizer = load_model(name_or_path, cache_dir=cache_dir, progress=progress)
    else:
        model, tokenizer = _load_quantized(*files, progress, isa_of(fast_path), act_block)
    accelerate(model, mode=fast_path)  # leaves its kernel and state in model.fast_path
    return model, tokenizer


def _load_quantized(gguf, folder, progress: bool, isa: str | None, act_block: int):
    from transformers import AutoTokenizer

    from swiftdecode.kernels.build import KernelUnavailable
    from swiftdecode.kernels.qgemm import load_qkernel
    from swiftdecode.runtime.quantized import build

    try:
        kernel = load_qkernel(isa, act_block)
    except KernelUnavailable as e:
        hint = "choose another --fast-path" if isa else "use --weights fp32"
        raise UserError(f"quantized weights need the qgemm kernel ({e}); {hint}") from None
    return build(gguf, folder, kernel, progress), AutoTokenizer.from_pretrained(folder)
