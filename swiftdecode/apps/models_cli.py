"""`swiftdecode models`: the registry's models, pulled or not, with their size, architecture and whether our own
layer loop runs them (native) or transformers' modules do."""

from __future__ import annotations

import argparse

from swiftdecode.hub import DEFAULT_MODEL, REGISTRY, resolve_cache_dir
from swiftdecode.hub.entries import entry_ok

# registry name -> the config's model_type (transformers' name of the architecture), known before any pull
ARCHITECTURES = {
    "smollm2-135m": "llama",
    "gemma3-270m": "gemma3_text",
    "qwen2.5-coder-0.5b": "qwen2",
    "qwen2.5-coder-1.5b": "qwen2",
}
HEADER = ("name", "model", "params", "download", "architecture", "native", "pulled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    help_text = "converted-model cache (default: $SWIFTDECODE_CACHE, else ~/.cache/swiftdecode)"
    parser.add_argument("--cache-dir", default=None, help=help_text)


def rows(cache_dir: str | None = None) -> list[tuple[str, ...]]:
    """One row of `HEADER` per registry model."""
    from swiftdecode.runtime.lean import MODEL_TYPES

    cache = resolve_cache_dir(cache_dir)
    out = []
    for spec in REGISTRY.values():
        entries = (("gguf", f"{spec.name}-gguf"), ("fp32", spec.name))
        forms = [w for w, key in entries if entry_ok(cache / key, spec.sha256)]
        name = spec.name + (" (default)" if spec.name == DEFAULT_MODEL else "")
        arch = ARCHITECTURES[spec.name]
        native = "yes" if arch in MODEL_TYPES else "no (transformers)"
        params = f"{spec.n_params / 1e9:.1f}B" if spec.n_params >= 1e9 else f"{spec.n_params / 1e6:.0f}M"
        out.append((name, spec.title, params, f"{spec.size / 1e6:.0f} MB", arch, native, ", ".join(forms) or "no"))
    return out


def table(lines: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in lines)


def run(args: argparse.Namespace) -> int:
    print(table([HEADER, *rows(args.cache_dir)]))
    print(f"\ncache: {resolve_cache_dir(args.cache_dir)}; `swiftdecode pull NAME` fetches one (pip, sha256 checked)")
    return 0
