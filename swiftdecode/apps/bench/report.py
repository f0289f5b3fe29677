"""The written results: results.json, results.md (tables) and the plots, and the tables printed to the terminal."""

from __future__ import annotations

import json
import resource
from pathlib import Path

from swiftdecode.apps.bench.methods import ENGINE_METHODS
from swiftdecode.apps.bench.plots import plot_categories, plot_stream


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["env"]["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_categories(results, out / "speedup_by_category.png")
    plot_stream(results, out / "prompt_stream.png")
    (out / "results.md").write_text(markdown(results))


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return f"{x:{spec}}{suffix}"


def overall_table(results: dict) -> str:
    rows = [
        "| method | tokens/s | prompt tok/s | vs hf | vs ar | accepted/round | acceptance | optimise share "
        "| peak RSS MiB | lossless | agreement | n |",
        "|" + "---|" * 12,
    ]
    ref = results["settings"]["lossless_reference"]
    for m, res in results["methods"].items():
        o = res["overall"]
        exact = m in ENGINE_METHODS or ref == "hf" or m == ref  # other paths have numerics of their own
        lossless = fmt(o["lossless"]) + (f" ({o['mismatches']} mismatches)" if o["mismatches"] else "")
        lossless = lossless if exact else f"n/a (own numerics; {o['mismatches']} differ)"
        rows.append(
            f"| {m} | {fmt(o['tokens_per_s'])} | {fmt(o.get('prompt_tokens_per_s'), '.0f')} "
            f"| {fmt(o['speedup_vs_hf'], suffix='x')} "
            f"| {fmt(o['speedup_vs_ar'], suffix='x')} | {fmt(o['mean_accepted_tokens'])} "
            f"| {fmt(o['acceptance_rate'], '.1%')} | {fmt(o['optimize_share'], '.1%')} "
            f"| {fmt(o['peak_rss_mb'], '.0f')} | {lossless} | {fmt(o.get('agreement'), '.0%')} | {o['n']} |"
        )
    return "\n".join(rows)


def sources_table(results: dict) -> str:
    """Per engine method: rounds of each kind (and their share of round time), accepted tokens by drafter."""
    kinds_shown, sources_shown = ("draft", "suffix", "ngram", "plain"), ("skip", "suffix", "ngram", "both")
    head = [f"{k} rounds" for k in kinds_shown] + [f"accepted from {s}" for s in sources_shown]
    rows = ["| method | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for m, res in results["methods"].items():
        o = res["overall"]
        if o.get("round_kinds") is None:
            continue
        kinds, secs, acc = o["round_kinds"], o["round_seconds"], o["accepted_by_source"]
        spent = sum(secs.values()) or 1.0
        cells = [f"{kinds.get(k, 0)} ({secs.get(k, 0.0) / spent:.0%} of time)" for k in kinds_shown]
        rows.append(f"| {m} | " + " | ".join(cells + [str(acc.get(k, 0)) for k in sources_shown]) + " |")
    return "\n".join(rows)


def category_table(results: dict, key: str, spec: str = ".2f") -> str:
    methods = list(results["methods"])
    cats = list(next(iter(results["methods"].values()))["by_category"])
    rows = ["| category | n | " + " | ".join(methods) + " |", "|" + "---|" * (len(methods) + 2)]
    for c in cats:
        cells = [fmt(results["methods"][m]["by_category"][c][key], spec) for m in methods]
        rows.append(f"| {c} | {results['methods'][methods[0]]['by_category'][c]['n']} | " + " | ".join(cells) + " |")
    cells = [fmt(results["methods"][m]["overall"][key], spec) for m in methods]
    return "\n".join(
        rows + ["| **overall** | " + str(results["settings"]["prompts"]) + " | " + " | ".join(cells) + " |"]
    )


def markdown(results: dict) -> str:
    s, e = results["settings"], results["env"]
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}, top-p {s.get('top_p', 1.0)}"
    fp = e["fast_path"]
    lines = [
        f"# swiftdecode bench: {results['model']}",
        "",
        f"Data `{s['data']}`: {s['prompts']} prompts; {s['max_new_tokens']} new tokens max; {mode}; "
        f"chat template {'on' if s['chat'] else 'off'}; {s['warmup']} warm-up generation(s) per method.",
        f"CPU {e['cpu']} ({e['cpu_count']} cores, {e['threads']} torch threads); torch {e['torch']}, "
        f"transformers {e['transformers']}; fast path `{fp['path']}` ({fp['reason']}).",
        f"HF methods run on {'the fast path' if s['hf_fast_path'] else 'stock torch'}. tokens/s: mean over "
        "prompts of new tokens / wall s (prompt reading included); prompt tok/s: all prompt tokens read (not "
        "found in the prefix cache) / all seconds to the first token (our engine; llama.cpp as it reports them); "
        "speedups: ratio of the tokens/s means. "
        "accepted/round (bonus token included) "
        "and acceptance are means over prompts; acceptance is accepted draft tokens per draft step for our "
        "engine, per proposed candidate token for HF assisted methods. Peak RSS: largest per-generation peak.",
        "",
        "## Overall",
        "",
        overall_table(results),
        "",
        "## Rounds and accepted draft tokens by source (our engine)",
        "",
        "Rounds: `draft` = layer-skip draft + n-gram branch, `ngram` = n-gram branch only, `plain` = one token. "
        "Accepted draft tokens by the drafter that proposed them (`both`: both proposed it). Sums over prompts.",
        "",
        sources_table(results),
    ]
    present = [k for k in ("hf", "ar") if k in results["methods"]]
    for title, key, spec in [
        ("Speedup vs hf", "speedup_vs_hf", ".2f"),
        ("Speedup vs ar", "speedup_vs_ar", ".2f"),
        ("Tokens/s", "tokens_per_s", ".2f"),
        ("Acceptance rate", "acceptance_rate", ".1%"),
        ("Mean accepted tokens per round", "mean_accepted_tokens", ".2f"),
    ]:
        if key.startswith("speedup_vs_") and key[-2:] not in present:
            continue
        lines += ["", f"## {title} by category", "", category_table(results, key, spec)]
    lines += ["", "## Lossless", ""] + lossless_lines(results)
    lines += ["", "## Failed runs", ""] + failure_lines(results) if results.get("failures") else []
    lines += [
        "",
        "![speedup by category](speedup_by_category.png)",
        "",
        "![prompt stream](prompt_stream.png)",
        "",
    ]
    return "\n".join(lines)


def failure_lines(results: dict) -> list[str]:
    """The runs that failed (a method on a prompt), each left out of its method's numbers."""
    fails = results.get("failures") or []
    head = [f"{len(fails)} run(s) failed and are left out of their method's numbers:", ""] if fails else []
    return head + [f"- `{f['method']}` on prompt {f['prompt_id']}: {f['error'][:300]}" for f in fails]


def lossless_lines(results: dict) -> list[str]:
    ref, mism = results["settings"]["lossless_reference"], results["mismatches"]
    if ref is None:
        return ["Not checked (needs greedy decoding and the hf or ar method)."]
    engine = [x for x in mism if x["method"] in ENGINE_METHODS]
    head = f"Every output of every {'engine ' if mism else ''}method is token-identical to `{ref}`."
    if not mism:
        return [head]
    lines = [
        head if not engine else f"{len(engine)} engine output(s) differ from `{ref}`.",
        f"{len(mism)} output(s) differ from `{ref}` (HF and llama.cpp methods by the numerics of their path):",
        "",
        "| method | prompt | category | first diff at | ref tokens | tokens | ref text | text |",
        "|" + "---|" * 8,
    ]
    for x in mism:
        ref_text, text = (json.dumps(t)[1:-1].replace("|", "\\|") for t in (x["reference_text"], x["text"]))
        lines.append(
            f"| {x['method']} | {x['prompt_id']} | {x['category']} | {x['position']} "
            f"| {x['reference_tokens']} | {x['tokens']} | `{ref_text}` | `{text}` |"
        )
    return lines
