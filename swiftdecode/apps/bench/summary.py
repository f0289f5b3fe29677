"""results.json: per-method and per-category metrics over the records, lossless check, environment."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable


def summarize(
    records: list[dict], methods: list[str], args, env: dict, tok, chat: bool, failures: list[dict] = ()
) -> dict:
    """results.json: settings, env, per-method overall and per-category metrics, mismatches, records, and the
    runs that failed (see stream.run_stream)."""
    reference = lossless_reference(methods, args.temperature)
    mismatches = compare(records, reference, tok) if reference else []
    for r in records:
        for ref in ("hf", "ar"):
            other = next((o for o in records if o["index"] == r["index"] and o["method"] == ref), None)
            ok = other is not None and other["tokens_per_s"] > 0
            r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / other["tokens_per_s"] if ok else None
    categories, failed = list(dict.fromkeys(r["category"] for r in records)), [f["method"] for f in failures]
    per_method = {}
    for m in methods:
        per_method[m] = {
            "overall": aggregate(records, m, lambda r: True, reference) | {"failed": failed.count(m)},
            "by_category": {c: aggregate(records, m, lambda r, c=c: r["category"] == c, reference) for c in categories},
        }
    settings = {
        k: getattr(args, k)
        for k in (
            "data",
            "categories",
            "limit",
            "max_new_tokens",
            "temperature",
            "top_p",
            "warmup",
            "draft_model",
            "seed",
            "fast_path",
            "hf_fast_path",
            "grammar",
        )
    }
    prompts = len({r["index"] for r in records} | {f["index"] for f in failures})
    settings.update(methods=methods, chat=chat, prompts=prompts, lossless_reference=reference)
    return {
        "model": args.model,
        "settings": settings,
        "env": env,
        "methods": per_method,
        "mismatches": mismatches,
        "failures": list(failures),
        "records": records,
    }


def lossless_reference(methods: list[str], temperature: float) -> str | None:
    """The method whose outputs the others must equal: greedy, `ar` (else `hf`); sampling, `ar`, since every
    method runs a prompt with the same seed and our engine's methods are seed-identical to our plain decoding
    (HF and llama.cpp draw their own samples: their rows say how many outputs differ)."""
    if temperature == 0:
        return next((m for m in ("ar", "hf") if m in methods), None)
    return "ar" if "ar" in methods else None


def compare(records: list[dict], reference: str, tok) -> list[dict]:
    """Mark each record `identical` to the reference's output on its prompt; list every mismatch."""
    refs = {r["index"]: r for r in records if r["method"] == reference}
    out = []
    for r in records:
        a, b = refs[r["index"]]["token_ids"], r["token_ids"]
        r["identical"] = a == b
        pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        r["agreement"] = 1.0 if a == b else pos / max(len(a), 1)  # share of the reference before divergence
        if a == b:
            continue
        out.append(
            {
                "method": r["method"],
                "prompt_id": r["prompt_id"],
                "category": r["category"],
                "index": r["index"],
                "position": pos,
                "reference_tokens": len(a),
                "tokens": len(b),
                "reference_text": tok.decode(a[pos : pos + 16]),
                "text": tok.decode(b[pos : pos + 16]),
            }
        )
    return out


def aggregate(records: list[dict], method: str, keep: Callable[[dict], bool], reference: str | None) -> dict:
    """Metrics of `method` over the kept prompts; speedups: ratios of mean tokens/s over the same prompts."""
    kept = [r for r in records if keep(r)]
    mine = [r for r in kept if r["method"] == method]
    tps = mean_tps(mine, method)

    def speedup(ref: str) -> float | None:
        other = mean_tps(kept, ref)
        return tps / other if tps is not None and other else None

    return {
        "tokens_per_s": tps,
        "prompt_tokens_per_s": prompt_rate(mine),
        "speedup_vs_hf": speedup("hf"),
        "speedup_vs_ar": speedup("ar"),
        "prompt_speedup_vs_hf": mean([r["speedup_vs_hf"] for r in mine]),
        "prompt_speedup_vs_ar": mean([r["speedup_vs_ar"] for r in mine]),
        "mean_accepted_tokens": mean([r["mean_accepted_tokens"] for r in mine]),
        "acceptance_rate": mean([r["acceptance_rate"] for r in mine]),
        "optimize_share": mean([r["optimize_share"] for r in mine]),
        "peak_rss_mb": max((r["peak_rss_mb"] for r in mine if r["peak_rss_mb"] is not None), default=None),
        "new_tokens": sum(r["new_tokens"] for r in mine),
        **{k: total([r[k] for r in mine]) for k in ("round_kinds", "round_seconds", "accepted_by_source")},
        "lossless": all(r["identical"] for r in mine) if reference else None,
        "mismatches": sum(not r["identical"] for r in mine) if reference else None,
        "agreement": mean([r["agreement"] for r in mine]) if reference else None,
        "n": len(mine),
    }


def prompt_rate(records: list[dict]) -> float | None:
    """Prompt tokens read per second of prompt reading, over the records that measured it (all their prompt
    tokens not found in a prefix cache over all their prefill seconds, as llama-bench's pp tokens/s)."""
    timed = [r for r in records if r["prefill_s"]]
    read = sum(r["prompt_tokens"] - r["cached_prompt_tokens"] for r in timed)
    return read / sum(r["prefill_s"] for r in timed) if timed else None


def mean_tps(records: list[dict], method: str) -> float | None:
    v = [r["tokens_per_s"] for r in records if r["method"] == method]
    return sum(v) / len(v) if v else None


def mean(values: list) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def total(counts: list[dict | None]) -> dict | None:
    """Key-wise sum of the dicts given (None entries skipped); None if there are none."""
    present = [c for c in counts if c is not None]
    return {k: sum(c[k] for c in present) for k in present[0]} if present else None


def env_info(fast_path: dict) -> dict:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "fast_path": fast_path,
    }
