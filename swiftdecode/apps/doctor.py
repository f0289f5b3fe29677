"""`swiftdecode doctor`: the CPU, the matmul path, and what a forward of k new tokens costs on it.

Speculative decoding pays only if verifying k tokens in one forward costs about one token's forward. This
times full-model forwards of k = 1, 2, 4, 8, 16 new tokens after a prompt of --context tokens, on torch's
own path and on the fast path side by side (interleaved repeats, medians), next to a memory copy bandwidth.
On quantized weights it also draws the roofline: each k's time against max(weight bytes / bandwidth, the weight
products' multiply-accumulates / the measured peak of the instruction the kernel uses), so anyone can see how far
each k is from the machine's limit (attention and the float work between products are left out of the bound),
and the products' own ceiling: their MACs at the measured rate of the kernel's inner step alone (per format: the
integer dot products and the float scaling each 32-block needs, codes unpacked, inputs in cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from collections import Counter

from swiftdecode.base.config import isa_of
from swiftdecode.base.errors import UserError

KS = (1, 2, 4, 8, 16)
BUILD_KS = (1, 2, 4, 8, 16, 32)  # --builds: the k-row curve to 32 rows (verification trees, batches, prompt chunks)
DRAFT_SKIP_RATIO = 0.5  # the layer-skip draft step timed beside them: SWIFT's searched sets skip about half


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftdecode.apps.pull_cli import add_model_argument

    add_model_argument(parser)
    parser.add_argument("--fast-path", default="auto", help="fast path to compare with torch (default: auto)")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache before timing (default 200)")
    parser.add_argument("--repeats", type=int, default=7, help="timed forwards per (path, k); median (default 7)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--llama-bench",
        action="store_true",
        help="also time prompt reading (pp512) and decoding (tg128) as llama.cpp's llama-bench defines them, ours "
        "and llama-bench's own on the same GGUF file (needs its binary: ../shared/tools/llama-cpp-peer.sh)",
    )
    parser.add_argument(
        "--builds",
        action="store_true",
        help="also time k-row forwards (k = 1..32) on every build of the quantized kernel this CPU runs, side by "
        "side (each a load of the same model), and say why the others do not run",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        return m.group(1).strip() if m else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def blas_info() -> str:
    import torch

    cfg = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", cfg)
    found = [ln.strip(" -") for ln in cfg.splitlines() if re.search(r"Math Kernel|OpenBLAS|MKL-DNN|oneDNN", ln)]
    return "; ".join([f"BLAS_INFO={blas.group(1)}" if blas else "BLAS_INFO=?", *found])


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Best-of-n large tensor copy, counting bytes read + written (GB/s)."""
    import torch

    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def weight_bytes(model) -> int:
    """Bytes a forward must read: every parameter except input-only embedding tables (counted once)."""
    import torch

    emb = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lin = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    from swiftdecode.kernels.modules import QuantLinear

    seen: dict[int, int] = {id(m.qweight): m.qweight.nbytes for m in model.modules() if isinstance(m, QuantLinear)}
    for p in model.parameters():
        if p.data_ptr() not in emb or p.data_ptr() in lin:
            seen[p.data_ptr()] = p.nbytes
    return sum(seen.values())


def weight_format(model) -> str:
    """How the matmul weights are held: the GGUF block formats of the quantized path, or the float dtype."""
    import torch

    from swiftdecode.kernels.modules import QuantEmbedding, QuantLinear
    from swiftdecode.kernels.qweight import FLOAT_KINDS

    kinds = Counter(m.qweight.kind for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding))
    if not kinds:
        return f"{next(model.parameters()).dtype} (dequantised)".replace("torch.", "")
    floats = sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # GGUF types without a kernel
    dequantized = f", float32 x{floats} (GGUF types without a kernel, dequantized)" if floats else ""
    label = "unquantized " if kinds.keys() <= FLOAT_KINDS else "quantized "
    return label + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) + dequantized


AMX_USABLE = "usable here: --fast-path skinny-amx runs the quantized products on tiles (not yet the default)"
# what csrc/roofline.cpp times per build
INSTRUCTION = {"avx512": "vpdpbusd zmm", "amx": "tdpbsud tiles", "avxvnni": "vpdpbusd ymm", "avx2": "vpmaddubsw ymm"}


def roofline(model, forward_ms: dict[int, float], nbytes: int, bandwidth_gbs: float) -> dict | None:
    """The bound of each k-row forward on quantized weights (None on float weights, or where a timing loop did not
    run): memory ms (every weight byte once at the copy bandwidth), compute ms (k rows x the weight products' MACs
    at the instruction's peak), their max, and the forward's time over it; and the inner step's ms (k rows x each
    format's MACs at its inner step's measured rate: a floor for the products that no overlap of streaming and
    compute can beat)."""
    import torch

    from swiftdecode.kernels.modules import QuantLinear

    lins = {id(m.qweight): m for m in model.modules() if isinstance(m, QuantLinear)}
    if not lins:
        return None
    kernel, threads = next(iter(lins.values())).kernel, torch.get_num_threads()
    peak = kernel.peak_macs(threads)
    by_fmt = Counter()  # weight format -> its products' MACs a row
    for m in lins.values():
        by_fmt[m.qweight.fmt] += m.qweight.n * m.qweight.k
    rates = {fmt: kernel.loop_macs(fmt, threads) for fmt in by_fmt}
    if not peak or not all(rates.values()):  # a loop did not run (a thread's tiles refused their configuration)
        return None
    macs = sum(by_fmt.values())
    step_s = sum(n / rates[fmt] for fmt, n in by_fmt.items())  # seconds per row
    memory_ms = nbytes / (bandwidth_gbs * 1e9) * 1e3
    compute_ms = {k: k * macs / peak * 1e3 for k in KS}
    bound = {k: max(memory_ms, compute_ms[k]) for k in KS}
    return {
        "instruction": f"{INSTRUCTION[kernel.isa]} ({kernel.isa} build)",
        "peak_gmacs": peak / 1e9,
        "threads": threads,
        "macs_per_row": macs,
        "memory_ms": memory_ms,
        "compute_ms": compute_ms,
        "bound_ms": bound,
        "over_bound": {k: forward_ms[k] / bound[k] for k in KS},
        "step_gmacs": macs / step_s / 1e9,
        "step_ms": {k: k * step_s * 1e3 for k in KS},
    }


def time_forwards(
    runs: list[tuple[object, str]], context: int, repeats: int, ks: tuple[int, ...] = KS
) -> dict[str, dict[str, dict]]:
    """Median wall and calling-thread CPU ms of the engine's k-token forward (a verification: k causal rows and
    their full-vocabulary logits) after `context` tokens, and of a one-token draft step with the inner layers'
    sublayers skipped at DRAFT_SKIP_RATIO (SkipSet.uniform), per (model, fast-path mode) run ({path: {"wall":
    {k: ms}, "cpu": {k: ms}, "draft": ms}}, paths distinct); repeats interleaved. With one torch thread, CPU time
    is the forward's own work, unaffected by other processes taking the cores."""
    import torch

    from swiftdecode.runtime.cache import SwiftCache
    from swiftdecode.runtime.fastpath import accelerate
    from swiftdecode.runtime.model import SwiftModel
    from swiftdecode.runtime.skip import SkipSet

    g = torch.Generator().manual_seed(0)
    vocab = runs[0][0].config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    new = torch.randint(0, vocab, (max(ks),), generator=g).tolist()
    times = {p: {c: {k: [] for k in ks} for c in ("wall", "cpu")} | {"draft": []} for _, p in runs}
    by_model = {id(m): SwiftModel(m) for m, _ in runs}  # one per model: a model's paths share it
    sms, caches = {p: by_model[id(m)] for m, p in runs}, {}
    draft = SkipSet.uniform(sms[runs[0][1]].n_layers, DRAFT_SKIP_RATIO)
    for model, path in runs:  # a cache per path: the fast path's holds fp16 keys/values on quantized weights
        accelerate(model, path)
        caches[path] = SwiftCache(sms[path].kv_layout().windows)
        sms[path].prefill(prompt, caches[path])
    for rep in range(repeats + 1):  # first round warms up
        for model, path in runs:
            accelerate(model, path)
            sm, cache = sms[path], caches[path]
            for k in ks:
                causal = torch.ones(k, k, dtype=torch.bool).tril_()
                t, c = time.perf_counter(), time.thread_time()
                sm.logits(sm.forward(new[:k], torch.arange(context, context + k), causal, cache))
                if rep:
                    times[path]["cpu"][k].append((time.thread_time() - c) * 1e3)
                    times[path]["wall"][k].append((time.perf_counter() - t) * 1e3)
                cache.truncate(context)
            t = time.perf_counter()
            sm.logits(sm.forward(new[:1], torch.arange(context, context + 1), causal[:1, :1], cache, skip=draft))
            if rep:
                times[path]["draft"].append((time.perf_counter() - t) * 1e3)
            cache.truncate(context)
    median = statistics.median
    return {
        p: {c: median(d) if c == "draft" else {k: median(v) for k, v in d.items()} for c, d in ts.items()}
        for p, ts in times.items()
    }


def builds(args: argparse.Namespace, model) -> dict:
    """`--builds`: {"forward_ms": {path: {k: ms}}, "unavailable": {build: why}} for every build of the quantized
    kernel (one load of the model each, on the model's activation quantization; `model` itself where it runs
    that build), k-row forwards interleaved; {} on float weights."""
    from swiftdecode.apps.pull_cli import load_model
    from swiftdecode.kernels.build import KernelUnavailable
    from swiftdecode.kernels.modules import QuantLinear
    from swiftdecode.kernels.qgemm import ISA_CPU_FLAGS, load_qkernel

    kernel = next((m.kernel for m in model.modules() if isinstance(m, QuantLinear)), None)
    if kernel is None:
        return {}
    runs, unavailable = [], {}
    for isa in ISA_CPU_FLAGS:
        try:
            load_qkernel(isa, kernel.act)
        except KernelUnavailable as e:
            unavailable[isa] = str(e)
            continue
        if isa == kernel.isa:
            runs.append((model, f"skinny-{isa}"))
        else:  # another load: its weights are the same layout file's pages (shared), its kernels that build's
            other, _ = load_model(args, fast_path=f"skinny-{isa}", act_block=kernel.act, progress=False)
            runs.append((other, f"skinny-{isa}"))
    ms = time_forwards(runs, args.context, args.repeats, BUILD_KS)
    return {"forward_ms": {p: t["wall"] for p, t in ms.items()}, "unavailable": unavailable}


def diagnose(model, fast_path: str = "auto", context: int = 200, repeats: int = 7) -> dict:
    """Everything `doctor` prints, as a dict; leaves `model` accelerated with `fast_path`."""
    import torch

    from swiftdecode.kernels.amx import amx_status
    from swiftdecode.runtime.fastpath import accelerate
    from swiftdecode.runtime.lean import why_not
    from swiftdecode.runtime.model import SwiftModel

    if context < 1 or repeats < 1:
        raise UserError("--context and --repeats must be >= 1")
    info = accelerate(model, fast_path)
    paths = ["torch"] + ([fast_path] if info.path != "torch" else [])
    ms = time_forwards([(model, p) for p in paths], context, repeats)
    info = accelerate(model, fast_path)
    sm, nbytes = SwiftModel(model), weight_bytes(model)

    per_path = {
        ("torch" if p == "torch" else info.path): {
            "forward_ms": ms[p]["wall"],
            "ratio": {k: v / ms[p]["wall"][1] for k, v in ms[p]["wall"].items()},
            "effective_gbs": {k: nbytes / v / 1e6 for k, v in ms[p]["wall"].items()},
            "forward_cpu_ms": ms[p]["cpu"],
            "draft_ms": ms[p]["draft"],
        }
        for p in paths
    }
    used, bandwidth = per_path[info.path], copy_bandwidth_gbs()
    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "blas": blas_info(),
        "path": info.path,
        "reason": info.reason,
        "amx": dict(zip(("usable", "why"), amx_status(), strict=True)),
        "weight_mb": nbytes / 1e6,
        "weight_format": weight_format(model),
        "layers": sm.layer_loop(),
        "layers_why": why_not(model) or "the torch path" if sm.layer_loop() == "transformers" else None,
        "kv_bytes_per_token": (layout := sm.kv_layout()).bytes(1),
        "kv_sliding": layout.sliding(),
        "kv_at_context": (sm.max_length, layout.bytes(sm.max_length)),  # one sequence at the model's context length
        "context": context,
        "forward_ms": used["forward_ms"],
        "ratio": used["ratio"],
        "bandwidth_gbs": bandwidth,
        "effective_gbs": used["effective_gbs"][1],
        "paths": per_path,
        "roofline": roofline(model, used["forward_ms"], nbytes, bandwidth) if info.path != "torch" else None,
    }


def builds_lines(b: dict) -> list[str]:
    """`--builds`' table: each build's k-row forwards and their ratio to its one row; the AMX build's forwards over
    the AVX-512 build's, where both ran (below 1 from the row count where tiles pay); the builds that do not run."""
    if not b:
        return ["builds:     none to compare: the model's weights are not quantized"]
    ms = b["forward_ms"]
    lines = ["the quantized kernel's builds, whole forwards (k rows, and over one row):"]
    lines.append(f"{'build':<16}" + "".join(f"{f'k={k}':>16}" for k in BUILD_KS))
    for name, f in ms.items():
        lines.append(f"{name:<16}" + "".join(f"{f[k]:8.1f}ms {f[k] / f[1]:4.2f}x" for k in BUILD_KS))
    if (tiles := ms.get("skinny-amx")) and (vectors := ms.get("skinny-avx512")):
        lines.append(f"{'amx / avx512':<16}" + "".join(f"{tiles[k] / vectors[k]:15.2f}x" for k in BUILD_KS))
    return lines + [f"{f'skinny-{isa}':<16}not on this CPU: {why}" for isa, why in b["unavailable"].items()]


LAYER_LOOPS = {
    "native": "native loop (every layer in one C call: kernels/csrc/decoder.cpp)",
    "python": "lean Python loop over the kernel library (some projections are not quantized)",
    "transformers": "transformers' modules",
}


SLIDING_NOTE = "; {} sliding-window layers hold at most {} tokens each"  # the KV line's, where a model has them
CONTEXT_NOTE = "; one sequence at the model's {:,}-token context holds {:.2f} GB"


def format_report(d: dict) -> str:
    lines = [
        f"CPU:        {d['cpu']}   torch threads: {d['threads']}",
        f"torch:      {d['torch']}   {d['blas']}",
        f"matmul:     {d['path']} — {d['reason']}",
        *(
            ["lossless:   verification on torch is not batch-invariant here (near-ties may flip a token vs ar)"]
            if d["path"] == "torch"
            else []
        ),
        f"layers:     {LAYER_LOOPS[d['layers']]}" + (f": {d['layers_why']}" if d.get("layers_why") else ""),
        "AMX tiles:  "
        + (AMX_USABLE if d["amx"]["usable"] else f"{d['amx']['why']}; the AMX build (skinny-amx) does not run"),
        f"memory:     {d['bandwidth_gbs']:.1f} GB/s (large tensor copy, read+write)",
        f"weights:    {d['weight_format']}; {d['weight_mb']:.0f} MB read per forward; cache of {d['context']} tokens",
        f"KV cache:   {d['kv_bytes_per_token'] / 1024:.1f} KB per token, all layers (fp16 on quantized weights)"
        + (SLIDING_NOTE.format(*d["kv_sliding"]) if d.get("kv_sliding") else "")
        + CONTEXT_NOTE.format(d["kv_at_context"][0], d["kv_at_context"][1] / 1e9),
        "",
        f"{'path':<16}" + "".join(f"{f'k={k}':>16}" for k in KS) + f"{'GB/s @k=1':>12}",
    ]
    for name, p in d["paths"].items():
        cells = "".join(f"{p['forward_ms'][k]:8.1f}ms {p['ratio'][k]:4.2f}x" for k in KS)
        lines.append(f"{name:<16}{cells}{p['effective_gbs'][1]:12.1f}")
    p = d["paths"][d["path"]]
    lines.append(
        f"{'draft step':<16}{p['draft_ms']:8.1f}ms {p['draft_ms'] / p['forward_ms'][1]:4.2f}x   (one token with "
        f"{DRAFT_SKIP_RATIO:.0%} of the inner layers' sublayers skipped: a layer-skip draft's step)"
    )
    if len(d["paths"]) == 2:
        t, f = d["paths"]["torch"]["forward_ms"], d["forward_ms"]
        lines.append(f"{'speedup':<16}" + "".join(f"{t[k] / f[k]:15.2f}x" for k in KS))
    if r := d.get("roofline"):
        lines += [
            "",
            f"roofline:   {r['peak_gmacs']:.0f} GMAC/s peak of {r['instruction']}, {r['threads']} threads; "
            f"{r['macs_per_row'] / 1e6:.0f} M MACs a row in the weight products",
            f"{'compute bound':<16}" + "".join(f"{r['compute_ms'][k]:8.1f}ms{'':6}" for k in KS),
            f"{'bound':<16}"
            + "".join(f"{r['bound_ms'][k]:8.1f}ms{'':6}" for k in KS)
            + f"   (memory: {r['memory_ms']:.1f} ms)",
            f"{'forward / bound':<16}" + "".join(f"{r['over_bound'][k]:15.2f}x" for k in KS),
            f"{'inner step':<16}"
            + "".join(f"{r['step_ms'][k]:8.1f}ms{'':6}" for k in KS)
            + f"   (the products' inner step alone: {r['step_gmacs']:.0f} GMAC/s)",
        ]
    if "builds" in d:
        lines += ["", *builds_lines(d["builds"])]
    if b := d.get("llama_bench"):
        from swiftdecode.apps.bench.llama_bench import report_lines

        lines += ["", *report_lines(b["ours"], b["llama.cpp"])]
    if d["threads"] == 1:
        lines += ["", "CPU time of the forward (1 thread: its own work, whatever else runs on the machine)"]
        for name, p in d["paths"].items():
            c = p["forward_cpu_ms"]
            lines.append(f"{name:<16}" + "".join(f"{c[k]:8.1f}ms {c[k] / c[1]:4.2f}x" for k in KS))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from swiftdecode.apps.bench import llama_bench
    from swiftdecode.apps.pull_cli import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    gguf = llama_bench.gguf_of(args) if args.llama_bench else None
    # a named ISA picks the quantized kernel's build too (that is chosen when the model loads)
    load_path = args.fast_path if isa_of(args.fast_path) else "torch"
    model, _ = load_model(args, fast_path=load_path, progress=not args.json)
    d = diagnose(model, args.fast_path, args.context, args.repeats)
    if args.builds:
        d["builds"] = builds(args, model)
    if args.llama_bench:
        d["llama_bench"] = llama_bench.beside(model, gguf, args.repeats)
    print(json.dumps(d, indent=2) if args.json else format_report(d))
    return 0
