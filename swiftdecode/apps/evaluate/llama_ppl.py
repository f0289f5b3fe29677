"""llama.cpp's figures on the same text: `llama-perplexity` on an F32 GGUF of the model's own weights (the base
run, whose log-probabilities it stores) and then on the quantized GGUF (`--kl-divergence` against that store).

The F32 GGUF is the quantized file with every tensor dequantized by the `gguf` package (GGUF's reference
dequantization, as our `--weights fp32`), metadata copied; it is written once beside our cache. Like the bench's
peers, the binaries are not a dependency (peers.find_binary).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

from swiftdecode.apps.bench.peers import NO_REPACK, find_binary
from swiftdecode.base.errors import UserError

BINARY = "llama-perplexity"
HOW_TO = f"{BINARY} not found: build it with ../shared/tools/llama-cpp-peer.sh (or set SWIFTDECODE_LLAMA_CPP)"
FLOAT_TYPES = {"F32", "F16", "BF16"}  # kept as they are (only the quantized tensors are dequantized)
_NUM = r"([-\d.]+)"
PATTERNS = {  # llama-perplexity's summary lines (tools/perplexity/perplexity.cpp)
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ref_ppl": rf"Mean PPL\(base\)\s*:\s*{_NUM}",
    "ppl_ratio": rf"Mean PPL\(Q\)/PPL\(base\)\s*:\s*{_NUM}",
    "kld_mean": rf"Mean\s+KLD:\s*{_NUM}",
    "kld_p99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "same_top": rf"Same top p:\s*{_NUM}",
}
_BASE_PPL = re.compile(rf"Final estimate: PPL = {_NUM}")


def f32_gguf(src: Path, dst: Path) -> Path:
    """`dst`: `src` with its quantized tensors dequantized to F32 (written once; atomically)."""
    if dst.is_file():
        return dst
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    tmp = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(tmp, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        if t.tensor_type.name in FLOAT_TYPES:
            data = np.asarray(t.data)
        else:
            data = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, timeout=7200)
    if proc.returncode < 0:  # killed by a signal: see peers.NO_REPACK
        proc = subprocess.run([*cmd, NO_REPACK], capture_output=True, timeout=7200)
    out = (proc.stdout + proc.stderr).decode("utf-8", "replace")
    if proc.returncode != 0:
        raise UserError(f"{BINARY} failed ({proc.returncode}): {out.strip().splitlines()[-1:]}")
    return out


def llama_scores(gguf: Path, f32: Path, text: Path, base: Path, ctx: int, chunks: int, threads: int) -> dict:
    """llama-perplexity's figures on `text` (`base`: its log-probability file, rewritten): "base" {ppl} of the F32
    run; "quantized" and "storage_floor" (the F32 model against its own stored run) {ppl, ppl_ratio (over the F32
    run's ppl), kld_mean, kld_p99, same_top, and its own reported ref_ppl and ppl ratio}. llama.cpp stores the
    base log-probabilities as 16-bit integers, so its KLD includes that rounding: the floor shows how much."""
    binary = find_binary(BINARY)
    if binary is None:
        raise UserError(HOW_TO)
    common = [str(binary), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)]
    out = _run([*common, "-m", str(f32), "--kl-divergence-base", str(base)])
    if not (m := _BASE_PPL.search(out)):
        raise UserError(f"{BINARY}: no final estimate in the base run's output")
    result = {"base": {"ppl": float(m.group(1))}}
    for name, model in (("quantized", gguf), ("storage_floor", f32)):
        s = parse_kld(_run([*common, "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence"]))
        s["reported_ref_ppl"], s["reported_ppl_ratio"] = s.pop("ref_ppl"), s.pop("ppl_ratio")
        result[name] = {**s, "ppl_ratio": s["ppl"] / result["base"]["ppl"]}
    return result


def parse_kld(out: str) -> dict:
    """The summary of a `--kl-divergence` run's output (same_top as a fraction)."""
    result = {}
    for key, pattern in PATTERNS.items():
        if not (m := re.search(pattern, out)):
            raise UserError(f"{BINARY}: no {key!r} in the KL divergence run's output")
        result[key] = float(m.group(1)) / (100.0 if key == "same_top" else 1.0)
    return result
