"""Loading a model by name or path: the GGUF files of the quantized path (`locate_gguf`), or float weights
(`load_model`) from a registry name, HF folder, `.gguf` file or hub id."""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from swiftdecode.base.errors import UserError
from swiftdecode.hub.convert import GGUF_FILE, ROPE_FREQS_FILE, attention_for, convert_gguf, divide_rotary, quiet
from swiftdecode.hub.entries import entry_ok, resolve_cache_dir
from swiftdecode.hub.registry import REGISTRY, known_names
from swiftdecode.hub.store import pull


def locate_gguf(name_or_path: str, *, cache_dir=None, progress: bool = True, force: bool = False):
    """(GGUF file, folder with its config and tokenizer) of a registry name or a .gguf path, pulling or
    preparing the cache entry first; None for anything else (HF folders and hub ids have no GGUF)."""
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        cache = resolve_cache_dir(cache_dir)
        if not entry_ok(cache / f"{spec.name}-gguf", spec.sha256):
            print(f"swiftdecode: {spec.name} is not pulled yet; pulling it into {cache} (once)", file=sys.stderr)
        entry = pull(spec.name, cache_dir, progress, force=force)
        return entry / GGUF_FILE, entry
    path = Path(name_or_path).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return path, convert_gguf(path, cache_dir, progress, force=force, weights="gguf")
    return None


def _from_folder(folder: str | Path, dtype, progress: bool, local_only: bool = False):
    """(model, tokenizer) of an HF folder or hub id; a float32 entry of a Llama 3 GGUF gets its rotary factors."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = {"local_files_only": True} if local_only else {}
    with quiet(not progress):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        config = AutoConfig.from_pretrained(folder, **kw)
        attn = attention_for(config)
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, attn_implementation=attn, **kw)
    if (factors := Path(folder) / ROPE_FREQS_FILE).is_file():
        divide_rotary(model, np.load(factors))
    return model.eval(), tokenizer


def _load_entry(build, dtype, progress: bool):
    """Load the cache entry returned by `build(force=False)`; if it fails to load, rebuild it once."""
    folder = build(force=False)
    try:
        return _from_folder(folder, dtype, progress)
    except Exception as e:
        print(f"swiftdecode: cache entry {folder} failed to load ({type(e).__name__}); rebuilding", file=sys.stderr)
        return _from_folder(build(force=True), dtype, progress)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Quick TCP probe of the hub, so an offline machine fails in seconds instead of a minute of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # cannot probe through a proxy; let the hub client try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout).close()
        return True
    except OSError:
        return False


def _looks_like_hub_id(s: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", s) is not None and not s.endswith(".gguf")


def load_model(name_or_path: str, *, cache_dir=None, dtype=None, progress: bool = True):
    """Load (model in eval mode, tokenizer) with float weights from a registry name, HF folder, `.gguf` file or
    hub id. Registry models and GGUF files are dequantised once and cached (`--weights fp32`); the quantized
    path is `locate_gguf` + `swiftdecode.runtime.quantized.build`.
    dtype: torch dtype of the weights (default float32).
    """
    import torch

    dtype = dtype or torch.float32
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        cache = resolve_cache_dir(cache_dir)
        if not entry_ok(cache / spec.name, spec.sha256):
            print(f"swiftdecode: {spec.name} is not pulled yet; pulling it into {cache} (once)", file=sys.stderr)
        build = lambda force: pull(spec.name, cache_dir, progress, force=force, weights="fp32")
        return _load_entry(build, dtype, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face model folder (no config.json)")
        return _from_folder(path, dtype, progress)
    if path.is_file():
        with open(path, "rb") as f:
            if path.suffix.lower() != ".gguf" and f.read(4) != b"GGUF":
                raise UserError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
        build = lambda force: convert_gguf(path, cache_dir, progress, force=force)
        return _load_entry(build, dtype, progress)
    if _looks_like_hub_id(name_or_path):
        try:
            return _from_folder(name_or_path, dtype, progress, local_only=not _hub_reachable())
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"cannot load {name_or_path!r} from the Hugging Face hub ({msg}); known models: {known_names()}"
            ) from None
    raise UserError(
        f"unknown model {name_or_path!r} (not a registry name, folder or file); known models: {known_names()} "
        "(swiftdecode models lists them)"
    )
