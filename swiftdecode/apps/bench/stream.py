"""The timed run: warm-up on untimed texts, then every method on every prompt, in an order rotating per prompt."""

from __future__ import annotations

import sys

from swiftdecode.apps.bench.methods import Outcome, Runner
from swiftdecode.apps.bench.summary import mean_tps
from swiftdecode.apps.data import Prompt

WARMUP_TEXTS = (  # outside every timed set: warming up on a timed prompt would let stateful methods see it first
    "Say hello and introduce yourself in two sentences.",
    "List three colours and one thing of each colour.",
)


def run_stream(
    runners: dict[str, Runner], prompts: list[Prompt], ids: list[list[int]], args, warm_ids: list[list[int]]
) -> tuple[list[dict], list[dict]]:
    """Warm up on `warm_ids` (not timed prompts), then time every method on every prompt, rotating the method
    order per prompt: (records, failures). A method that raises on a prompt costs that row, not the run: the
    failure (index, prompt_id, method, error) is kept instead of a record; one that raises in the warm-up is left
    out of the timed run (its failure's prompt_id: "warm-up")."""
    from tqdm import tqdm

    names, failures = list(runners), []
    with tqdm(total=args.warmup * len(names), desc="warm-up", file=sys.stderr, leave=False) as bar:
        for w in range(args.warmup):
            for m in list(names):
                bar.set_postfix_str(m)
                try:
                    runners[m](warm_ids[w % len(warm_ids)], args.seed - 1 - w)
                except Exception as e:  # a method that cannot run at all is left out of the timed run
                    names.remove(m)
                    failures.append(
                        {"index": -1, "prompt_id": "warm-up", "method": m, "error": f"{type(e).__name__}: {e}"}
                    )
                    bar.write(f"swiftdecode bench: {m} failed in the warm-up, left out: {failures[-1]['error'][:300]}")
                bar.update()
    records: list[dict] = []
    focus = next((m for m in ("swift", *names) if m in names and m != "hf"), names[0])
    with tqdm(total=len(prompts) * len(names), desc="bench", file=sys.stderr, dynamic_ncols=True) as bar:
        for i, (p, x) in enumerate(zip(prompts, ids, strict=True)):
            for m in names[i % len(names) :] + names[: i % len(names)]:
                bar.set_postfix_str(f"{m} | prompt {p.id} | {focus} {running_speedup(records, focus)}")
                try:
                    records.append(record(i, p, m, len(x), runners[m](x, args.seed + i)))
                except Exception as e:
                    failures.append({"index": i, "prompt_id": p.id, "method": m, "error": f"{type(e).__name__}: {e}"})
                    bar.write(f"swiftdecode bench: {m} failed on prompt {p.id}: {failures[-1]['error'][:300]}")
                bar.update()
    return records, failures


def record(index: int, p: Prompt, method: str, prompt_tokens: int, o: Outcome) -> dict:
    n = len(o.token_ids)
    share = o.optimize_s / o.wall_s if o.optimize_s is not None and o.wall_s > 0 else None
    return {
        "index": index,
        "prompt_id": p.id,
        "category": p.category,
        "method": method,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": o.cached_prompt_tokens,
        "new_tokens": n,
        "wall_s": o.wall_s,
        "prefill_s": o.prefill_s,
        "tokens_per_s": n / o.wall_s if o.wall_s > 0 else 0.0,
        "rounds": o.rounds,
        "mean_accepted_tokens": o.mean_accepted_tokens,
        "acceptance_rate": o.acceptance_rate,
        "optimize_share": share,
        "peak_rss_mb": o.peak_rss_mb,
        "round_kinds": o.round_kinds,
        "round_seconds": o.round_seconds,
        "accepted_by_source": o.accepted_by_source,
        "token_ids": o.token_ids,
    }


def running_speedup(records: list[dict], method: str) -> str:
    ref = "hf" if any(r["method"] == "hf" for r in records) else "ar"
    a, b = mean_tps(records, method), mean_tps(records, ref)
    return f"{a / b:.2f}x {ref}" if a and b else "-"
