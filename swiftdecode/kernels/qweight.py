"""GGUF block-quantized weights kept quantized in memory, re-laid out for the qgemm kernel (csrc/qgemm.cpp).

`QuantWeight.from_gguf(type, blocks, n, k)` decodes a GGUF tensor's blocks into the kernel's planes: the same
codes, scales and mins (same bit widths, fp16 scales as stored), with rows interleaved in tiles of 16 lanes so
one vector load feeds 16 output rows. Memory is the GGUF tensor's size (K-quant 6-bit scales take a byte each:
+2.8% for Q4_K, +3.6% for Q3_K); nothing is expanded to float32. F16 and BF16 tensors keep their 16-bit values,
as the `d` plane alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

LANES = 16  # output rows per tile (csrc LANES)

# GGUF type name -> (kernel format id, low-code plane width (2, 4, or 8: whole-byte codes; 16: float values, no
# codes), high-bit plane width (0-2), values per block). The IQ4 formats keep their 4-bit codebook indices; the
# kernel maps them.
FORMATS = {
    "Q4_0": (0, 4, 0, 32),
    "Q4_1": (1, 4, 0, 32),
    "Q5_0": (2, 4, 1, 32),
    "Q5_1": (3, 4, 1, 32),
    "Q8_0": (4, 8, 0, 32),
    "Q4_K": (5, 4, 0, 256),
    "Q5_K": (6, 4, 1, 256),
    "Q6_K": (7, 4, 2, 256),
    "Q3_K": (8, 2, 1, 256),
    "IQ4_NL": (9, 4, 0, 32),
    "IQ4_XS": (10, 4, 0, 256),
    "Q2_K": (11, 2, 0, 256),
    "F16": (12, 16, 0, 1),
    "BF16": (13, 16, 0, 1),
}
FLOAT_BITS = 16  # FORMATS' low-plane width of the float formats
FLOAT_KINDS = frozenset(kind for kind, (_, lo, _, _) in FORMATS.items() if lo == FLOAT_BITS)
PLANES = ("lo", "hi", "d", "d2", "sc", "mn")
LAYOUT_VERSION = 1  # of the planes (_planes, csrc/qgemm.cpp): change it with them, so no cached layout reads stale
CHUNK_ROWS = 4096  # rows decoded at a time at load (a multiple of LANES): bounds the load's transient memory


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, value i = bit i."""
    v = np.ascontiguousarray(qh).view(np.uint32)
    return ((v >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _kscales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K-quant 12-byte packed 6-bit scales and mins [..., 12] -> ([..., 8], [..., 8])."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12-byte packed 6-bit scales [..., 12] -> [..., 16] int8 (scale - 32): low nibbles in bytes 0-7
    (scales 0-7, then their high nibbles 8-15), 2 high bits each in bytes 8-11 (scale i: byte 8 + i % 4, bits
    2 (i // 4))."""
    low = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], axis=-1)
    high = np.concatenate([(s[..., 8:12] >> (2 * i)) & 3 for i in range(4)], axis=-1)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def _two_bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's 2-bit codes: [N, nblk, 64] bytes -> [N, nblk, 256], value 128h + 32j + l at bits 2j of
    byte 32h + l."""
    n, nblk = qs.shape[:2]
    return ((qs.reshape(n, nblk, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3).reshape(
        n, nblk, 256
    )


def _decode_low_k(kind: str, b: np.ndarray, out: dict[str, np.ndarray]) -> np.ndarray:
    """Q2_K, Q3_K and IQ4_XS blocks [N, nblk, bytes] -> codes [N, nblk, 256], their scales into `out`."""
    n, nblk = b.shape[:2]
    if kind == "Q2_K":  # scale | min << 4 per 16 values, kept as stored
        out["d"], out["d2"], out["sc"] = _f16(b[..., 80:82]), _f16(b[..., 82:84]), b[..., 0:16].reshape(n, -1)
        return _two_bit(b[..., 16:80])
    if kind == "Q3_K":  # value 128h + 32j + l: bits 2j of qs[32h + l], bit 4h + j of hmask[l] (its 4)
        out["d"] = _f16(b[..., 108:110])
        out["sc"] = _q3_scales(b[..., 96:108]).reshape(n, -1)
        qh = (b[..., 0:32].reshape(n, nblk, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        return _two_bit(b[..., 32:96]) | (qh.reshape(n, nblk, 256) << 2)
    hs = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0]  # IQ4_XS: 6-bit scales, low nibbles in 4-7
    low = (b[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(n, nblk, 8) & 15
    high = (hs[..., None] >> (2 * np.arange(8, dtype=np.uint16))).astype(np.uint8) & 3
    out["sc"] = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1)
    return _nibbles(b[..., 8:136].reshape(n, nblk, 8, 16)).reshape(n, nblk, 256)


def _decode(kind: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """Blocks [N, nblk, bytes] -> codes `u` [N, K] and per-row scale arrays, as GGUF defines each type."""
    n = b.shape[0]
    out: dict[str, np.ndarray] = {"d": _f16(b[..., 0:2])}
    if kind in ("Q2_K", "Q3_K", "IQ4_XS"):
        u = _decode_low_k(kind, b, out)
    elif kind == "IQ4_NL":
        u = _nibbles(b[..., 2:18])
    elif kind in ("Q4_0", "Q4_1"):
        o = 2 if kind == "Q4_0" else 4
        if kind == "Q4_1":
            out["d2"] = _f16(b[..., 2:4])
        u = _nibbles(b[..., o : o + 16])
    elif kind in ("Q5_0", "Q5_1"):
        o = 2 if kind == "Q5_0" else 4
        if kind == "Q5_1":
            out["d2"] = _f16(b[..., 2:4])
        u = _nibbles(b[..., o + 4 : o + 20]) | (_bits(b[..., o : o + 4]) << 4)
    elif kind == "Q8_0":
        u = b[..., 2:34] ^ np.uint8(0x80)  # int8 q -> q + 128
    elif kind in ("Q4_K", "Q5_K"):
        out["d2"] = _f16(b[..., 2:4])
        out["sc"], out["mn"] = (a.reshape(n, -1) for a in _kscales(b[..., 4:16]))
        qs = b[..., -128:].reshape(*b.shape[:2], 4, 1, 32)
        u = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(*b.shape[:2], 256)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(*b.shape[:2], 1, 32)
            u = u | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4).reshape(*b.shape[:2], 256)
    elif kind == "Q6_K":
        out["d"] = _f16(b[..., 208:210])
        out["sc"] = b[..., 192:208].reshape(n, -1)  # int8 bits
        ql = b[..., 0:128].reshape(*b.shape[:2], 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        u = ((ql & 15).reshape(*b.shape[:2], 256)) | (((qh & 3).reshape(*b.shape[:2], 256)) << 4)
    else:
        raise ValueError(kind)
    out["u"] = u.reshape(n, -1)
    return out


def _tile(a: np.ndarray, t: int) -> np.ndarray:
    """Per-row [N, ...] -> [T, 16, ...] with zero rows padding N up to T * 16."""
    pad = t * LANES - a.shape[0]
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(t, LANES, *a.shape[1:])


def _nibble_plane(c: np.ndarray, t: int) -> np.ndarray:
    """Codes [N, K] (< 16) -> [T, K/32, 4, 16, 4]: byte (h, j, t) = c[j, 8h+t] | c[j, 8h+4+t] << 4."""
    x = _tile(c, t).reshape(t, LANES, -1, 4, 2, 4)
    return np.ascontiguousarray((x[..., 0, :] | (x[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4))


def _byte_plane(c: np.ndarray, t: int) -> np.ndarray:
    """Codes [N, K] (< 256) -> [T, K/32, 8, 16, 4]: byte (g, j, t) = c[j, 4g+t]."""
    return np.ascontiguousarray(_tile(c, t).reshape(t, LANES, -1, 8, 4).transpose(0, 2, 3, 1, 4))


def _hi_plane(c: np.ndarray, t: int, hb: int) -> np.ndarray:
    """High bits [N, K] -> the kernel's hb-bit plane (see csrc/qgemm.cpp)."""
    if hb == 2:  # [T, K/32, 2, 16, 4]: load p, byte t: bits 2s of value 16p + 4s + t (also Q2_K's, Q3_K's lo)
        x = _tile(c, t).reshape(t, LANES, -1, 2, 4, 4).astype(np.uint8)
        v = sum(x[..., s, :] << (2 * s) for s in range(4)).astype(np.uint8)
        return np.ascontiguousarray(v.transpose(0, 2, 3, 1, 4))
    x = _tile(c, t).reshape(t, LANES, -1, 8, 4).astype(np.uint8)  # hb == 1: bit g of byte t: value 4g + t
    v = sum(x[..., g, :] << g for g in range(8)).astype(np.uint8)
    return np.ascontiguousarray(v.transpose(0, 2, 1, 3))


def _scale_plane(a: np.ndarray, t: int) -> np.ndarray:
    """Per-row, per-block [N, nb] -> [T, nb, 16]."""
    return np.ascontiguousarray(_tile(a, t).transpose(0, 2, 1))


def _planes(kind: str, blocks: np.ndarray, lo: int, hb: int) -> dict[str, np.ndarray]:
    """Blocks of some rows [rows, nblk, bytes] -> their kernel planes, tiles first (rows padded to 16)."""
    t = -(-blocks.shape[0] // LANES)
    if lo == FLOAT_BITS:  # [rows, K, 2] bytes of 16-bit values -> d [T, K, 16]
        return {"d": _scale_plane(np.ascontiguousarray(blocks).view(np.uint16)[..., 0], t)}
    f = _decode(kind, blocks)
    u = f.pop("u")
    if lo == 8:
        planes = {"lo": _byte_plane(u, t)}
    else:
        planes = {"lo": _nibble_plane(u & 15, t) if lo == 4 else _hi_plane(u & 3, t, 2)}
        if hb:
            planes["hi"] = _hi_plane(u >> lo, t, hb)
    for name, a in f.items():
        planes[name] = _scale_plane(a.view(np.uint16) if a.dtype == np.float16 else a, t)
    return planes


def kernel_takes(kind: str, k: int) -> bool:
    """Whether the kernel computes from a GGUF tensor of type `kind` with rows of k values (whole 32-blocks)."""
    return kind in FORMATS and k % FORMATS[kind][3] == 0 and k % 32 == 0


@dataclass(frozen=True)
class QuantWeight:
    """A [n, k] weight in kernel planes (uint8 / fp16-bits torch tensors; None where the format has none)."""

    kind: str
    n: int
    k: int
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    d: torch.Tensor
    d2: torch.Tensor | None
    sc: torch.Tensor | None
    mn: torch.Tensor | None

    @property
    def fmt(self) -> int:
        return FORMATS[self.kind][0]

    @property
    def floats(self) -> bool:
        """16-bit float values (F16, BF16): products take the input as fp32, not as int8 codes."""
        return self.kind in FLOAT_KINDS

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes() if p is not None)

    def planes(self) -> list[torch.Tensor | None]:
        return [getattr(self, p) for p in PLANES]

    @classmethod
    def from_gguf(cls, kind: str, data, n: int, k: int, rows: np.ndarray | None = None) -> QuantWeight:
        """data: the GGUF tensor's bytes [n, row bytes], or an object whose read(start, stop) returns those rows
        (read in chunks); rows: optional order of the rows (a permutation)."""
        if kind not in FORMATS:
            raise ValueError(f"GGUF type {kind} has no quantized kernel (supported: {', '.join(FORMATS)})")
        _, lo, hb, block = FORMATS[kind]
        if not kernel_takes(kind, k):
            raise ValueError(f"{kind} weight with k={k} not a multiple of {max(block, 32)}")
        read = getattr(data, "read", None)
        if rows is not None or read is None:
            whole = np.asarray(data if read is None else read(), dtype=np.uint8)
            whole = whole if rows is None else whole[rows]
            read = lambda start, stop: whole[start:stop]
        t, block_bytes = -(-n // LANES), GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
        planes: dict[str, np.ndarray] = {}
        for r0 in range(0, n, CHUNK_ROWS):  # row chunks: the decoded codes never exist for the whole tensor
            part = read(r0, min(n, r0 + CHUNK_ROWS)).reshape(-1, k // block, block_bytes)
            for name, a in _planes(kind, part, lo, hb).items():
                if name not in planes:
                    planes[name] = np.empty((t, *a.shape[1:]), a.dtype)
                planes[name][r0 // LANES : r0 // LANES + len(a)] = a
        tensors = {p: torch.from_numpy(planes[p]) if p in planes else None for p in PLANES}
        return cls(kind, n, k, **tensors)

    def select_rows(self, ids: torch.Tensor) -> QuantWeight:
        """A weight holding rows `ids` (in that order), e.g. the draft vocabulary's rows of the output head.
        Reads only those rows (a few ms for 16k rows of a 150k-row head)."""
        t = -(-len(ids) // LANES)
        tiles, lanes = ids // LANES, ids % LANES
        out = {}
        for name in PLANES:
            p = getattr(self, name)
            if p is None:
                out[name] = None
                continue
            lane = p.dim() - 2 if name in ("lo", "hi") else p.dim() - 1
            sel = p.movedim(lane, 1)[tiles, lanes]  # [len(ids), ...]: a gather of the selected rows only
            sel = torch.cat([sel, sel.new_zeros((t * LANES - len(ids), *sel.shape[1:]))])
            out[name] = sel.reshape(t, LANES, *sel.shape[1:]).movedim(1, lane).contiguous()
        return replace(self, n=len(ids), **out)

    def put_rows(self, slots: torch.Tensor, src: QuantWeight, ids: torch.Tensor) -> None:
        """Overwrite rows `slots` of this weight with rows `ids` of `src` (same format and K), in place: the
        planes keep their storage, so descriptors and plans built on this weight stay valid. Touches only those
        rows (~0.1 ms for a hundred, where `select_rows` rebuilds a 16k-row draft head in ~25 ms)."""
        if src.kind != self.kind or src.k != self.k or len(slots) != len(ids):
            raise ValueError("put_rows needs rows of a weight of the same format and K, one per slot")
        for name in PLANES:
            dst, p = getattr(self, name), getattr(src, name)
            if dst is None:
                continue
            if dst.dtype == torch.uint16:  # fp16 bits: torch's index_put has no uint16 kernel, int16 is the same
                dst, p = dst.view(torch.int16), p.view(torch.int16)
            lane = p.dim() - 2 if name in ("lo", "hi") else p.dim() - 1
            dst.movedim(lane, 1)[slots // LANES, slots % LANES] = p.movedim(lane, 1)[ids // LANES, ids % LANES]
