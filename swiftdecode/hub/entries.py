"""Cache entries: the cache folder and how an entry is built, checked and locked.

Invariant: a folder `<cache>/<key>/` is used only if its marker file (written last, inside a temp folder that is
then renamed into place) exists and lists every file with its exact size. Anything else is a half-written or
corrupt entry and is rebuilt, never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from swiftdecode.base.errors import UserError

MARKER = ".swiftdecode-complete.json"
FORMAT = 1  # bump to invalidate all cache entries when the conversion changes


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` > $SWIFTDECODE_CACHE > $XDG_CACHE_HOME/swiftdecode > ~/.cache/swiftdecode."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("SWIFTDECODE_CACHE"):
        return Path(os.environ["SWIFTDECODE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swiftdecode"


def entry_ok(folder: Path, source_sha256: str) -> bool:
    """True iff the marker exists, matches the source and format, and every listed file has its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        ok = marker["format"] == FORMAT and marker["source_sha256"] == source_sha256
        return ok and bool(files) and all((folder / n).stat().st_size == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def make_dir(folder: Path) -> None:
    """Create `folder` (and its parents) if missing; UserError, not a traceback, where that is impossible."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the cache directory {folder}: {e.strerror or e}") from None


@contextmanager
def locked(cache: Path, key: str):
    """Exclusive lock on `<cache>/.<key>.lock` so two processes never build the same entry at once."""
    import fcntl

    make_dir(cache)
    with open(cache / f".{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_space(folder: Path, need: int, what: str) -> None:
    make_dir(folder)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise UserError(
            f"not enough disk space in {folder} to {what}: need ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        )


def write_entry(entry: Path, source_sha256: str, source: Path, fill) -> None:
    """Build cache entry `entry` atomically: `fill(tmp)` writes its files into a temp folder, then the marker
    (listing every file with its size) is written last and the folder renamed into place."""
    remove_leftovers(entry.parent, entry.name, ("tmp", "trash"))
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


def remove_leftovers(parent: Path, name: str, kinds: tuple[str, ...]) -> None:
    """Delete temp folders `.{kind}-{name}-*` left by a killed build (call with the lock for `name` held)."""
    for kind in kinds:
        for p in parent.glob(f".{kind}-{name}-*"):
            shutil.rmtree(p, ignore_errors=True)
