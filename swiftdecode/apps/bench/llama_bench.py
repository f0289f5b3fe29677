"""Throughput beside llama.cpp's `llama-bench` on the same GGUF file, as llama-bench defines its two tests:
prompt reading (pp N: N random token ids in one forward on an empty cache, the last row's logits) and decoding
(tg N: N one-token forwards with their full logits, from an empty cache), tokens per second, the median of
--repeats runs after one untimed run.

Ours is the model-level forward the engine runs (`SwiftModel`, the native layer loop where the architecture has
one); llama-bench runs with the same threads in each weight layout it offers (`--repack 1`, its repacked
kernels, and `0`, the blocks as stored), and its best figure per test is the one compared. The binary is not a
dependency: it is found as the other llama.cpp peers are (peers.find_binary).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from swiftdecode.apps.bench.peers import find_binary
from swiftdecode.base.errors import UserError

BINARY = "llama-bench"
HOW_TO = f"{BINARY} not found: build it with ../shared/tools/llama-cpp-peer.sh (or set SWIFTDECODE_LLAMA_CPP)"
PP, TG = 512, 128  # llama-bench's default tests: pp512, tg128
REPACK = ("1", "0")  # its weight layouts: repacked for its kernels (AMX where it has tiles), or as in the file
TIMEOUT_S = 3600  # one llama-bench run of an 8B file on 2 threads takes ~10 minutes


def ours(model, pp: int = PP, tg: int = TG, repeats: int = 3) -> dict[str, float]:
    """{"pp": tokens/s, "tg": tokens/s} of our forward on `model` (loaded, accelerated)."""
    import torch

    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.model import SwiftModel

    sm = SwiftModel(model)
    prompt = torch.randint(0, sm.vocab_size, (pp + tg,), generator=torch.Generator().manual_seed(0)).tolist()
    one = torch.ones(1, 1, dtype=torch.bool)
    times: dict[str, list[float]] = {"pp": [], "tg": []}
    for rep in range(repeats + 1):  # the first run warms up, as llama-bench's does
        t = time.perf_counter()
        sm.logits(sm.prefill(prompt[:pp], SwiftCache(sm.kv_layout().windows))[-1:])
        pp_s, cache, t2 = time.perf_counter() - t, SwiftCache(sm.kv_layout().windows), time.perf_counter()
        for i in range(tg):
            sm.logits(sm.forward(prompt[pp + i : pp + i + 1], torch.tensor([i]), one, cache))
        if rep:
            times["pp"].append(pp / pp_s)
            times["tg"].append(tg / (time.perf_counter() - t2))
    return {test: statistics.median(v) for test, v in times.items()}


def peer(gguf: Path, threads: int, pp: int = PP, tg: int = TG, repeats: int = 3) -> dict[str, float | str]:
    """{"pp", "tg": llama-bench's best tokens/s over its weight layouts, "pp_repack", "tg_repack": the layout
    that gave it, "build": its commit}. A layout that fails (llama.cpp's AMX path dies on some CPUs) is left out."""
    binary = find_binary(BINARY)
    if binary is None:
        raise UserError(HOW_TO)
    best: dict[str, float | str] = {}
    errors = []
    for repack in REPACK:
        cmd = [str(binary), "-m", str(gguf), "-p", str(pp), "-n", str(tg), "-t", str(threads)]
        cmd += ["-r", str(repeats), "--repack", repack, "-o", "json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            errors.append(f"--repack {repack}: exit {proc.returncode}")
            continue
        for row in json.loads(proc.stdout):
            test = "pp" if row["n_gen"] == 0 else "tg"
            if row["avg_ts"] > best.get(test, 0.0):
                best |= {test: row["avg_ts"], f"{test}_repack": repack, "build": row.get("build_commit", "?")}
    if "pp" not in best or "tg" not in best:
        raise UserError(f"{BINARY} failed on {gguf}: {'; '.join(errors)}")
    return best


def report_lines(ours_ts: dict[str, float], peer_ts: dict[str, float | str], pp: int = PP, tg: int = TG) -> list[str]:
    """The side-by-side table `doctor --llama-bench` prints."""
    lines = [f"{'beside llama-bench':<20}{'ours tok/s':>12}{'llama.cpp':>12}{'ours / llama.cpp':>18}"]
    for test, n in (("pp", pp), ("tg", tg)):
        theirs = float(peer_ts[test])
        lines.append(f"{f'{test}{n}':<20}{ours_ts[test]:12.2f}{theirs:12.2f}{ours_ts[test] / theirs:17.2f}x")
    lines.append(
        f"{'':<20}(llama.cpp {peer_ts['build']}: best of --repack 1/0; pp took --repack "
        f"{peer_ts['pp_repack']}, tg --repack {peer_ts['tg_repack']})"
    )
    return lines


def gguf_of(args):
    """The GGUF file `doctor --llama-bench` runs llama.cpp on, checked (with the binary) before the model loads."""
    from swiftdecode.hub import locate_gguf

    if find_binary(BINARY) is None:
        raise UserError(HOW_TO)
    found = locate_gguf(args.model, cache_dir=args.cache_dir, progress=False)
    if found is None:
        raise UserError(f"--llama-bench runs llama.cpp on the model's GGUF file; {args.model!r} has none")
    return found[0]


def beside(model, gguf, repeats: int) -> dict:
    """{"ours": {"pp", "tg"}, "llama.cpp": {...}} tokens/s (apps/bench/llama_bench.py) on the same GGUF file."""
    import torch

    theirs = peer(gguf, torch.get_num_threads(), repeats=repeats)
    return {"ours": ours(model, repeats=repeats), "llama.cpp": theirs}
