"""The kernel layout of a GGUF's quantized weights, made once and kept: every QuantWeight's planes in one file
beside the model's cache entry, memory-mapped on later loads. The planes are views of the mapping (zero copy), so
a loaded model's weights are page-cache pages shared with the file (evictable, shared between processes), not a
private copy, and a start costs a few page lookups instead of re-laying out every block.

File: MAGIC, the planes (each at a page-aligned offset), the index (JSON: the key and, per tensor, its format,
shape and planes' dtype, shape and offset), the index's length (u64) and TRAILER. Invariants: it is written to a
temp file, flushed to disk and renamed into place, so a file under the final name is complete; it is read only
if both magics are in place and the index parses and holds the expected key (a stale, truncated or foreign file
is rebuilt, never read). The key (`layout_key`) covers the GGUF's size and mtime, `LAYOUT_VERSION`, the format
table and every tensor's name, format, shape and row order. Plane bytes carry no checksum: verifying them would
read the whole file at every start, which is what the mapping saves.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from swiftdecode.kernels.qweight import FORMATS, LANES, LAYOUT_VERSION, PLANES, QuantWeight

LAYOUT_FILE = "quant-layout.bin"
MAGIC, TRAILER = b"SDLAYOUT", b"SDLAYEND"
ALIGN = 4096  # planes start on page boundaries: no plane shares a page with another, kernel loads stay aligned
# Cache size over the GGUF's quantized bytes, for the space check: K-quant 6-bit scales take a byte each (+2.8% for
# Q4_K), rows are padded to 16 and planes to pages.
OVERHEAD = 1.05
SPACE_MARGIN = 256 << 20  # free disk space the cache leaves behind it, so it never fills a disk to the last byte

Spec = tuple[str, str, int, int, np.ndarray | None]  # (tensor name, GGUF type, n, k, row order or None)


def layout_key(gguf: Path, specs: list[Spec]) -> str:
    """Identity of `gguf`'s layout for these tensors; anything that changes the planes changes it."""
    st = gguf.stat()
    tensors = [
        (name, kind, n, k, None if rows is None else hashlib.sha256(rows.tobytes()).hexdigest())
        for name, kind, n, k, rows in specs
    ]
    ident = [st.st_size, st.st_mtime_ns, LAYOUT_VERSION, LANES, FORMATS, tensors]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()


def read_layout(file: Path, key: str) -> dict[str, QuantWeight] | None:
    """Tensor name -> weight, its planes views of a copy-on-write mapping of `file` (pages shared with the page
    cache while unwritten; the kernel only reads them); None if `file` is missing or not a complete layout of
    `key`."""
    try:
        with open(file, "rb") as f:
            index = _index(f, key)
            if index is None:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        mm.madvise(mmap.MADV_WILLNEED)  # a cold page cache reads ahead instead of faulting page by page
        return {name: _weight(mm, *entry) for name, entry in index["tensors"].items()}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _index(f, key: str) -> dict | None:
    """The parsed index of an open layout file if it is complete and of `key`, else None."""
    size = os.fstat(f.fileno()).st_size
    tail = 8 + len(TRAILER)
    if size < len(MAGIC) + tail or f.read(len(MAGIC)) != MAGIC:
        return None
    f.seek(size - tail)
    (length,), end = struct.unpack("<Q", f.read(8)), f.read(len(TRAILER))
    if end != TRAILER or length > size - tail - len(MAGIC):
        return None
    f.seek(size - tail - length)
    index = json.loads(f.read(length))
    return index if isinstance(index, dict) and index.get("key") == key else None


def _weight(mm: mmap.mmap, kind: str, n: int, k: int, planes: dict[str, list]) -> QuantWeight:
    """A weight whose planes (dtype name, shape, offset) are views of `mm`."""
    tensors = {}
    for name in PLANES:
        if name in planes:
            dtype, shape, offset = planes[name]
            a = np.frombuffer(mm, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
            tensors[name] = torch.from_numpy(a)
        else:
            tensors[name] = None
    return QuantWeight(kind, n, k, **tensors)


class LayoutWriter:
    """Writes a layout file: `add` each weight, then `commit` renames it into place. Leaving the `with` block
    without a commit (an error, a full disk) deletes the temp file; the constructor raises OSError at once where
    the folder cannot be written or lacks ~`need` * OVERHEAD bytes of free space."""

    def __init__(self, file: Path, key: str, need: int):
        _remove_stale(file)
        if shutil.disk_usage(file.parent).free < need * OVERHEAD + SPACE_MARGIN:
            raise OSError(errno.ENOSPC, f"no space for a ~{need * OVERHEAD / 1e9:.1f} GB layout file")
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.tmp-", dir=file.parent)
        self.f, self.tmp, self.file = os.fdopen(fd, "wb"), Path(tmp), file
        fcntl.flock(self.f, fcntl.LOCK_EX)  # marks the temp file as in use (see _remove_stale)
        self.index: dict = {"key": key, "tensors": {}}
        self.f.write(MAGIC)

    def __enter__(self) -> LayoutWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self.f.closed:
            self.f.close()
        self.tmp.unlink(missing_ok=True)

    def add(self, name: str, w: QuantWeight) -> None:
        """Append `w`'s planes (each at the next page boundary) and record them under `name`."""
        planes = {}
        for p in PLANES:
            t = getattr(w, p)
            if t is None:
                continue
            a = t.contiguous().numpy()
            self.f.write(bytes(-self.f.tell() % ALIGN))
            planes[p] = [a.dtype.name, list(a.shape), self.f.tell()]
            self.f.write(memoryview(a).cast("B"))
        self.index["tensors"][name] = [w.kind, w.n, w.k, planes]

    def commit(self) -> None:
        """Write the index and trailer, flush the file to disk and rename it into place."""
        index = json.dumps(self.index).encode()
        self.f.write(index + struct.pack("<Q", len(index)) + TRAILER)
        self.f.flush()
        os.fsync(self.f.fileno())  # the data reach the disk before the name does: no complete-looking torn file
        self.f.close()
        self.tmp.chmod(0o644)
        os.replace(self.tmp, self.file)


def _remove_stale(file: Path) -> None:
    """Delete temp files of `file` that no live writer holds (left by a killed process)."""
    for p in file.parent.glob(f".{file.name}.tmp-*"):
        try:
            with open(p, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                p.unlink()
        except OSError:
            pass  # held by a writer still at work, or already gone
