"""A GGUF file's tensor index (name, shape, type, where its bytes are) and its string metadata, read without
parsing the metadata arrays (the vocabulary) as gguf's GGUFReader does: that takes seconds and hundreds of MB.
Tensor bytes are read on demand with plain file reads, not memory-mapped, so a loaded model's resident memory
holds no file pages."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous (column) dimension
    tensor_type: GGMLQuantizationType
    path: Path
    offset: int  # of the first byte in the file
    n_rows: int
    row_bytes: int

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop of the raw bytes, [rows, row bytes] uint8."""
        stop = self.n_rows if stop is None else min(stop, self.n_rows)
        out = np.empty((stop - start, self.row_bytes), np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise ValueError(f"{self.path}: tensor {self.name} is truncated")
        return out

    @property
    def data(self) -> np.ndarray:
        return self.read()


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("I"), self.take("Q")
            if etype in _SCALAR:  # skipped, not decoded
                self.pos += n * struct.calcsize("<" + _SCALAR[etype])
            else:
                for _ in range(n):
                    self.value(etype)
            return None
        return self.take(_SCALAR[vtype])


def read_index(path: Path) -> tuple[dict[str, object], list[TensorInfo]]:
    """(scalar and string metadata, tensors) of a GGUF v2/v3 file; tensor bytes are memory-mapped."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")  # only the header pages parsed below become resident
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    c = _Cursor(memoryview(mm))
    c.pos = 4
    c.take("I")  # version
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("Q") for _ in range(c.take("I")))
        ttype, offset = GGMLQuantizationType(c.take("I")), c.take("Q")
        infos.append((name, dims, ttype, offset))
    align = int(meta.get("general.alignment") or 32)
    start = -(-c.pos // align) * align
    tensors = []
    for name, dims, ttype, offset in infos:
        block, size = GGML_QUANT_SIZES[ttype]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        row_bytes = dims[0] // block * size
        tensors.append(TensorInfo(name, dims, ttype, Path(path), start + offset, rows, row_bytes))
    return meta, tensors
