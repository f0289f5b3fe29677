"""`swiftdecode eval`: perplexity, KL divergence from the float32 reference and top-token agreement of a model's
forward on a text corpus, with llama.cpp's figures on the same text beside them (`--llama-cpp`)."""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

from swiftdecode.base.errors import UserError

REFERENCES = ("fp32", "none")  # fp32: the same GGUF dequantized exactly, on torch's float32 path (HF numerics)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftdecode.apps.pull_cli import add_model_argument

    add_model_argument(parser)
    parser.add_argument("--fast-path", default="auto", help="the evaluated forward's fast path (default: auto)")
    parser.add_argument("--corpus", default="news", help="news (Spec-Bench summarization), code (HumanEval) or a file")
    parser.add_argument("--data", default=None, help="Spec-Bench JSONL for --corpus news")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window; the second half is scored (512)")
    parser.add_argument("--windows", type=int, default=16, help="windows scored, from the start (default 16)")
    parser.add_argument("--reference", choices=REFERENCES, default="fp32", help="KL reference (default fp32)")
    parser.add_argument("--llama-cpp", action="store_true", help="also run llama-perplexity on the same text")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")


def run(args: argparse.Namespace) -> int:
    import torch

    from swiftdecode.apps.evaluate.corpus import corpus_text, windows
    from swiftdecode.apps.evaluate.fidelity import ReferenceStore, evaluate, fill
    from swiftdecode.apps.pull_cli import load_model
    from swiftdecode.hub.entries import resolve_cache_dir
    from swiftdecode.runtime.model import SwiftModel

    if args.windows < 1:
        raise UserError("--windows must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.llama_cpp:
        from swiftdecode.apps.bench.peers import find_binary
        from swiftdecode.apps.evaluate.llama_ppl import BINARY, HOW_TO

        if find_binary(BINARY) is None:  # before the long part, not after it
            raise UserError(HOW_TO)
    text = corpus_text(args.corpus, args.data)
    progress = not args.json
    model, tok = load_model(args, progress=progress)
    ids = tok.encode(text)
    bos = ids[0] if tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id] else None
    wins = windows(ids, args.ctx, args.windows, bos)
    cache = resolve_cache_dir(args.cache_dir)
    store = None
    if args.reference == "fp32":
        store = ReferenceStore(cache, f"{args.model}-fp32-torch-{torch.__version__}", wins)  # torch's numerics
        if store.missing(len(wins)):
            ref, _ = load_model(args, fast_path="torch", weights="fp32", progress=progress)
            fill(SwiftModel(ref), wins, store, progress)
            del ref
            gc.collect()
    result = {
        "model": args.model,
        "corpus": args.corpus,
        "ctx": args.ctx,
        "windows": len(wins),
        "reference": args.reference,
        "swiftdecode": {
            "weights": args.weights if args.weights == "fp32" else f"{args.weights} a{args.act_block}",
            "path": model.fast_path.path,
            **evaluate(SwiftModel(model), wins, store, progress),
        },
    }
    if args.llama_cpp:
        result["llama.cpp"] = _llama(args, text, len(wins), cache)
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        except OSError as e:
            raise UserError(f"--out: {e}") from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _llama(args: argparse.Namespace, text: str, chunks: int, cache: Path) -> dict:
    """llama-perplexity's base (F32) and quantized figures on `text`, the same windows and context."""
    import torch

    from swiftdecode.apps.evaluate.llama_ppl import f32_gguf, llama_scores
    from swiftdecode.hub import locate_gguf

    files = locate_gguf(args.model, cache_dir=args.cache_dir, progress=not args.json)
    if files is None:
        raise UserError("--llama-cpp needs a GGUF model (a registry name or a .gguf file)")
    gguf, folder = files
    (cache / "eval").mkdir(parents=True, exist_ok=True)
    f32 = f32_gguf(gguf, cache / "eval" / f"{folder.name}-f32.gguf")
    with tempfile.TemporaryDirectory(dir=cache / "eval") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(text, encoding="utf-8")
        threads = args.threads or torch.get_num_threads()
        return llama_scores(gguf, f32, corpus, Path(tmp) / "base.kld", args.ctx, chunks, threads)


FLOOR_NOTE = (
    "llama.cpp stores its reference's log-probabilities as 16-bit integers: its last row is that rounding alone "
    "(part of its KLD above)."
)
ROW = "| {:<37} | {:>9} | {:>9} | {:>9} | {:>9} | {:>8} |"


def format_table(r: dict) -> str:
    ours = r["swiftdecode"]
    lines = [
        f"{r['model']} on {r['corpus']}: {r['windows']} windows of {r['ctx']} tokens, {ours['tokens']} scored "
        f"(the second half of each window); reference: {r['reference']}",
        "",
        ROW.format("forward", "PPL", "PPL/ref", "mean KLD", "99% KLD", "same top"),
        ROW.format(*["---"] * 6),
    ]
    if "ref_ppl" in ours:
        lines.append(ROW.format("swiftdecode fp32 (torch, reference)", f"{ours['ref_ppl']:.4f}", "1", "0", "0", "100%"))
    lines.append(_row(f"swiftdecode {ours['weights']} ({ours['path']})", ours))
    if lc := r.get("llama.cpp"):
        lines.append(ROW.format("llama.cpp F32 (its reference)", f"{lc['base']['ppl']:.4f}", "1", "0", "0", "100%"))
        lines.append(_row("llama.cpp GGUF", lc["quantized"]))
        lines.append(_row("llama.cpp F32 vs its stored run", lc["storage_floor"]))
        lines += ["", FLOOR_NOTE]
    return "\n".join(lines)


def _row(label: str, s: dict) -> str:
    if "kld_mean" not in s:
        return ROW.format(label, f"{s['ppl']:.4f}", "", "", "", "")
    kld = round(s["kld_mean"], 6) + 0.0  # llama.cpp's rounding can leave a floor of -0.0
    cells = (f"{s['ppl']:.4f}", f"{s['ppl_ratio']:.4f}", f"{kld:.6f}", f"{s['kld_p99']:.5f}")
    return ROW.format(label, *cells, f"{100 * s['same_top']:.2f}%")
