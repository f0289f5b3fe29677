"""swiftdecode: lossless on-the-fly self-speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

from importlib import import_module

from swiftdecode.errors import UserError

__version__ = "0.1.0"
METHODS = ("swift", "swift-paper", "uniform", "ar")  # decoding methods of the engine (see engine.preset)
__all__ = ["load", "Generator", "GenerationResult", "StreamEvent", "UserError", "METHODS"]


def __getattr__(name: str):
    """Engine names are imported on first use, so `swiftdecode --help` does not pay for torch."""
    if name in ("Generator", "GenerationResult", "StreamEvent"):
        return getattr(import_module("swiftdecode.engine"), name)
    raise AttributeError(name)


def load(name_or_path: str = "smollm2-135m", *, fast_path: str = "auto", cache_dir: str | None = None, **kwargs):
    """Load a registry model, HF folder, .gguf file or hub id as (model, tokenizer), with the fast CPU
    matmul path installed (`fast_path="torch"` keeps torch's own)."""
    from swiftdecode.fastpath import accelerate
    from swiftdecode.models import load_model

    model, tokenizer = load_model(name_or_path, cache_dir=cache_dir, **kwargs)
    model.fast_path = accelerate(model, mode=fast_path)
    return model, tokenizer
