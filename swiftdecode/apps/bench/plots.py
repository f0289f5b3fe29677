"""The two figures of a bench run (matplotlib, imported only here): speedup by category, and per prompt over
the prompt stream."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color(results: dict, method: str) -> str:
    """The same colour for a method in every plot."""
    return f"C{list(results['methods']).index(method) % 10}"


def plot_categories(results: dict, path: Path) -> None:
    """Grouped bars: speedup vs hf (else ar) per category and overall, one bar per method."""
    plt = _pyplot()
    ref = "hf" if "hf" in results["methods"] else "ar"
    methods = [m for m in results["methods"] if m != ref]
    cats = list(next(iter(results["methods"].values()))["by_category"]) + ["overall"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats) * max(1, len(methods)) / 3), 4.5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        res = results["methods"][m]
        vals = [(res["by_category"][c] if c != "overall" else res["overall"])[f"speedup_vs_{ref}"] for c in cats]
        ax.bar(
            [i + (j - (len(methods) - 1) / 2) * width for i in range(len(cats))],
            [v or 0.0 for v in vals],
            width,
            label=m,
            color=color(results, m),
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_ylabel(f"speedup vs {ref} (mean tokens/s ratio)")
    ax.set_title(f"{results['model']}: speedup by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_stream(results: dict, path: Path) -> None:
    """Per-prompt speedup vs hf (else ar) and acceptance over the prompt stream (cf. SWIFT Fig. 7);
    dotted lines mark where a category starts."""
    plt = _pyplot()
    ref = "hf" if "hf" in results["methods"] else "ar"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for m in results["methods"]:
        recs = sorted((r for r in results["records"] if r["method"] == m), key=lambda r: r["index"])
        if m != ref:
            xs, ys = [r["index"] for r in recs], [r[f"speedup_vs_{ref}"] or 0.0 for r in recs]
            top.plot(xs, ys, marker=".", color=color(results, m), label=m)
        acc = [(r["index"], r["acceptance_rate"]) for r in recs if r["acceptance_rate"] is not None]
        if acc:
            bottom.plot(*zip(*acc, strict=True), marker=".", color=color(results, m), label=m)
    starts = {}
    for r in sorted(results["records"], key=lambda r: r["index"]):
        starts.setdefault(r["category"], r["index"])
    for cat, x in starts.items():
        for ax in (top, bottom):
            ax.axvline(x - 0.5, color="grey", linestyle=":", linewidth=0.8)
        top.annotate(cat, (x - 0.4, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=7, color="grey")
    top.axhline(1.0, color="black", linewidth=0.8)
    top.set_ylabel(f"speedup vs {ref}")
    top.set_title(f"{results['model']}: over the prompt stream")
    top.legend(fontsize=8, loc="lower right")
    bottom.set_ylabel("acceptance")
    bottom.set_xlabel("prompt (run order)")
    bottom.set_ylim(bottom=0)
    bottom.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
