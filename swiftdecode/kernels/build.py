"""Build a C++ kernel source into a cached shared library, and the CPU features that choose its ISA build.

Libraries are keyed by source, flags and compiler version under <cache>/kernels, built with g++ on first use
(8-10 s each on two cores: a fresh install's first command says so on stderr rather than sit silent) and
renamed into place atomically, so concurrent builders race harmlessly.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


class KernelUnavailable(RuntimeError):
    """A kernel cannot run here (CPU, compiler, build or self-test); the message says why."""


def cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo (empty off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_platform() -> None:
    """KernelUnavailable unless this is Linux on x86-64 (the kernels use x86 SIMD intrinsics)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"no kernel for {platform.system()}/{platform.machine()} (Linux x86-64 only)")


def pick_isa(table: dict[str, set[str]], isa: str | None = None) -> str:
    """`isa` if this CPU has its features, else (isa None) the first build of `table` (widest first) it runs;
    KernelUnavailable if none. table: ISA name -> the /proc/cpuinfo flags that build needs."""
    check_platform()
    flags = cpu_flags()
    if isa is not None:
        if not table[isa] <= flags:
            raise KernelUnavailable(f"CPU lacks {'+'.join(sorted(table[isa] - flags))} ({isa} build)")
        return isa
    for name, need in table.items():
        if need <= flags:
            return name
    raise KernelUnavailable(f"CPU lacks {'+'.join(sorted(table[next(reversed(table))]))}")


def kernel_dir() -> Path:
    from swiftdecode.hub.entries import resolve_cache_dir

    return resolve_cache_dir() / "kernels"


# Written float expressions (a * b + c in plain C) are evaluated as written on every build: the compiler may not
# fuse them into FMAs, which it otherwise does where the vectorised loop happens to allow, so builds for
# different ISAs (and compilers) could round differently. Explicit FMA intrinsics are unaffected.
COMMON_FLAGS = ["-ffp-contract=off"]


def build(sources: Path | list[Path], name: str, flags: list[str], out_dir: Path | None = None) -> Path:
    """Compile `sources` (one library) with `flags` into `<out_dir>/<name>_<key>.so`, cached by the sources, the
    headers beside them, the flags and the compiler; KernelUnavailable on failure."""
    sources = [sources] if isinstance(sources, Path) else list(sources)
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx}) on PATH")
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", *COMMON_FLAGS, *flags]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cxx} --version failed: {e}") from e
    text = b"".join(f.read_bytes() for f in (*sources, *headers))
    key = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    out_dir = out_dir or kernel_dir()
    lib = out_dir / f"{name}_{key}.so"
    if lib.exists():
        return lib
    tmp = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        print(f"swiftdecode: compiling the {name} kernels into {out_dir} (first use only, ~10 s)", file=sys.stderr)
        r = subprocess.run([cxx, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise KernelUnavailable(f"kernel build failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"kernel build failed: {e}") from e
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    return lib
