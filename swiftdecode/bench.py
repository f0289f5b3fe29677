"""`swiftdecode bench`: decoding methods side by side on one model and prompt set, interleaved in one process.

Every method decodes the same prompt ids (chat template applied once) with the same max_new_tokens;
per prompt the methods run in rotation so machine drift hits all alike. A method's output is its new ids
cut before the first EOS (EOS excluded); that span is what is counted and compared. tokens/s = mean over
prompts of new_tokens / wall s (timed around the generate call); speedups are ratios of those means; under
greedy a method is lossless when every output is token-identical to the reference (`ar`, else `hf`); `hf`'s
row then reports how far HF `generate` agrees with `ar` (`agreement`: share of tokens before the first
divergence), i.e. the cost of the quantized path's numerics.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swiftdecode.data import Prompt, load_prompts
from swiftdecode.errors import UserError

METHODS = {
    "hf": "HF model.generate, the baseline",
    "ar": "our autoregressive loop on our forward path",
    "swift": "our engine, best configuration",
    "swift-paper": "our engine in SWIFT's published configuration",
    "uniform": "static every-other-layer skip draft, no search",
    "ngram": "ablation: our engine, n-gram branch only (no layer-skip draft)",
    "skip-only": "ablation: our engine, layer-skip draft only (no n-gram branch)",
    "pld": "HF prompt lookup decoding (10 tokens)",
    "early-exit": "HF assisted generation, early exit at L/2",
    "draft-model": "HF assisted generation with --draft-model",
    "llama.cpp": "llama.cpp plain decoding on the same GGUF (peer; needs its binaries)",
    "llama.cpp-lookup": "llama.cpp n-gram lookup speculation on the same GGUF (peer; needs its binaries)",
}
ENGINE_METHODS = ("ar", "swift", "swift-paper", "uniform", "ngram", "skip-only")
PEER_METHODS = ("llama.cpp", "llama.cpp-lookup")
DEFAULT_METHODS = "hf,ar,swift,ngram,skip-only,swift-paper,uniform,pld,early-exit"


@dataclass
class Outcome:
    """One timed generation: `token_ids` are the new ids before the first EOS."""

    token_ids: list[int]
    wall_s: float
    rounds: int | None = None
    mean_accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    optimize_s: float | None = None
    peak_rss_mb: float | None = None
    round_kinds: dict[str, int] | None = None  # our engine only: see GenerationStats
    round_seconds: dict[str, float] | None = None
    accepted_by_source: dict[str, int] | None = None


Runner = Callable[[list[int], int], Outcome]  # (prompt ids, seed) -> outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftdecode.models import add_model_argument

    add_model_argument(parser)
    parser.add_argument("--data", required=True, help="Spec-Bench JSONL, text file (one prompt a line) or 'humaneval'")
    parser.add_argument("--categories", help="comma-separated categories ('mt-bench' = its 8 sub-categories)")
    parser.add_argument("--limit", type=int, help="at most N prompts per category (evenly spaced in file order)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from: {', '.join(METHODS)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless check applies)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap prompts in the chat template (default: when the tokenizer has one)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations per method before timing")
    parser.add_argument("--draft-model", help="draft model for the draft-model method")
    parser.add_argument("--fast-path", default="auto", help="CPU matmul path of our engine: auto, torch, ...")
    parser.add_argument(
        "--hf-fast-path",
        action="store_true",
        help="run the HF methods on the fast path too (default: stock torch, as users have it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="replay the prompts through our server with N clients at once, against one client (one engine method)",
    )
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch in --concurrency mode")
    parser.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    parser.add_argument("--json", action="store_true", help="print results.json to stdout")


def parse_methods(text: str, draft_model: str | None) -> list[str]:
    """Validated, de-duplicated method list in the given order."""
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not methods:
        raise UserError("no methods given")
    for m in methods:
        if m not in METHODS:
            raise UserError(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    if "draft-model" in methods and not draft_model:
        raise UserError("method draft-model needs --draft-model MODEL")
    return methods


def check_args(args: argparse.Namespace) -> tuple[list[str], list[Prompt], Path]:
    """Everything that can be checked before loading a model."""
    methods = parse_methods(args.methods, args.draft_model)
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.concurrency < 0 or args.max_batch < 1:
        raise UserError("--concurrency must be >= 0 and --max-batch >= 1")
    if args.concurrency and (len(methods) != 1 or methods[0] not in ENGINE_METHODS):
        raise UserError(f"--concurrency serves one engine method: --methods one of {', '.join(ENGINE_METHODS)}")
    categories = args.categories.split(",") if args.categories is not None else None
    prompts = load_prompts(args.data, categories, args.limit)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    return methods, prompts, out


def run(args: argparse.Namespace) -> int:
    methods, prompts, out = check_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tok, fast_path = load_target(args)
    chat = use_chat(tok, args.chat)
    ids = [encode(tok, p.text, chat) for p in prompts]
    if args.concurrency:
        return run_concurrency(model, tok, methods[0], ids, args, out)
    switch = PathSwitch(model, fast_path["path"], args)
    peers = peer_runners(methods, tok, eos_ids(model, tok), args)
    methods = [m for m in methods if m not in PEER_METHODS or m in peers]
    runners = {m: peers[m] if m in peers else make_runner(m, model, tok, args, switch) for m in methods}
    warm_ids = [encode(tok, text, chat) for text in WARMUP_TEXTS]
    records = run_stream(runners, prompts, ids, args, warm_ids)
    results = summarize(records, methods, args, env_info(fast_path), tok, chat)
    write_outputs(results, out)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(overall_table(results))
        print()
        print(sources_table(results))
        print(f"\nwrote {out}/results.json, results.md, speedup_by_category.png, prompt_stream.png")
    return 0


def run_concurrency(model, tok, method: str, ids: list[list[int]], args: argparse.Namespace, out: Path) -> int:
    from swiftdecode import concurrency
    from swiftdecode.engine import Generator

    result = concurrency.run(Generator(model, tok, method=method), ids, args.max_new_tokens, args.concurrency,
                             args.max_batch)  # fmt: skip
    result.update(model=args.model, method=method, max_new_tokens=args.max_new_tokens, threads=args.threads)
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else concurrency.table(result))
    return 0


# ---------------------------------------------------------------- models and runners


def load_target(args: argparse.Namespace):
    """(model, tokenizer, fast-path info as a dict) of the benchmarked model, on the fast path."""
    import swiftdecode

    model, tok = swiftdecode.load(args.model, cache_dir=args.cache_dir, fast_path=args.fast_path, weights=args.weights)
    return model, tok, {"path": model.fast_path.path, "reason": model.fast_path.reason}


class PathSwitch:
    """Puts the model on the fast path for our engine and on stock torch for the HF methods (unless
    --hf-fast-path); switching re-patches the linear layers and re-lays out the MLP weights in place (well
    under a second, outside the timed generations)."""

    def __init__(self, model, path: str, args: argparse.Namespace):
        self.model, self.current = model, args.fast_path
        self.engine = args.fast_path if path != "torch" else "torch"
        self.hf = self.engine if args.hf_fast_path else "torch"

    def __call__(self, hf: bool) -> None:
        from swiftdecode.fastpath import accelerate

        mode = self.hf if hf else self.engine
        if mode != self.current:
            accelerate(self.model, mode)
            self.current = mode


def use_chat(tok, chat: bool | None) -> bool:
    """--chat/--no-chat, default: whether the tokenizer has a chat template."""
    has = bool(getattr(tok, "chat_template", None))
    if chat and not has:
        raise UserError("--chat: this tokenizer has no chat template")
    return has if chat is None else chat


def encode(tok, text: str, chat: bool) -> list[int]:
    """Prompt ids, shared by all methods: a user turn in the chat template, or the plain text."""
    if not chat:
        return tok(text).input_ids
    text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def eos_ids(model, tok) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the generation config's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return ids | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """`ids` up to, excluding, the first EOS."""
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def peer_runners(methods: list[str], tok, eos: set[int], args: argparse.Namespace) -> dict[str, Runner]:
    """Runners of the llama.cpp methods asked for whose binaries exist; says on stderr why any is left out."""
    import torch

    from swiftdecode import peers
    from swiftdecode.models import locate_gguf

    wanted = [m for m in methods if m in PEER_METHODS]
    if not wanted:
        return {}
    files = locate_gguf(args.model, cache_dir=args.cache_dir, progress=False)
    if files is None:
        print(f"swiftdecode: skipping {', '.join(wanted)}: the model has no GGUF file", file=sys.stderr)
        return {}
    threads, out = args.threads or torch.get_num_threads(), {}
    for m in wanted:
        binary = peers.find_binary(m)
        if binary is None:
            print(f"swiftdecode: skipping {m}: {peers.HOW_TO}", file=sys.stderr)
            continue

        def call(ids: list[int], seed: int, m=m, binary=binary) -> Outcome:
            prompt = tok.decode(ids)
            text, seconds = peers.run_peer(m, binary, files[0], prompt, args.max_new_tokens, threads)
            new = tok(text, add_special_tokens=False).input_ids[: args.max_new_tokens]
            return Outcome(cut_at_eos(new, eos), seconds)

        out[m] = call
    return out


def make_runner(method: str, model, tok, args: argparse.Namespace, switch: PathSwitch) -> Runner:
    run = engine_runner(method, model, tok, args) if method in ENGINE_METHODS else hf_runner(method, model, tok, args)
    hf = method not in ENGINE_METHODS

    def call(ids: list[int], seed: int) -> Outcome:
        switch(hf)
        return run(ids, seed)

    return call


def engine_runner(method: str, model, tok, args: argparse.Namespace) -> Runner:
    """One Generator for the whole run, so search state carries across prompts as in a server."""
    from swiftdecode.engine import Generator

    gen, eos = Generator(model, tok, method=method), eos_ids(model, tok)

    def call(ids: list[int], seed: int) -> Outcome:
        reset_peak_rss()
        t0 = time.perf_counter()
        res = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=seed)
        wall = time.perf_counter() - t0
        st = res.stats.to_dict()
        rounds = st["tree_rounds"] or None  # ar: no tree rounds, no acceptance
        acc = (st["mean_accepted_tokens"], st["acceptance_rate"]) if rounds else (None, None)
        opt = st["time_split"]["optimize"]
        sources = {k: st[k] for k in ("round_kinds", "round_seconds", "accepted_by_source")}
        return Outcome(cut_at_eos(list(res.token_ids), eos), wall, rounds, *acc, opt, peak_rss_mb(), **sources)

    return call


def generation_config(model, tok, args: argparse.Namespace):
    """The model's generation config, copied: pad id set, greedy at temperature 0, else plain sampling."""
    import copy

    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens, gc.max_length, gc.min_new_tokens = args.max_new_tokens, None, None
    gc.eos_token_id = sorted(eos_ids(model, tok)) or None
    if gc.pad_token_id is None:
        gc.pad_token_id = next((i for i in (tok.pad_token_id, *(gc.eos_token_id or [])) if i is not None), 0)
    sample = args.temperature > 0
    gc.do_sample, gc.num_beams = sample, 1
    gc.temperature, gc.top_p, gc.top_k = (args.temperature, 1.0, 0) if sample else (None, None, None)
    gc.repetition_penalty = None
    return gc


def hf_runner(method: str, model, tok, args: argparse.Namespace) -> Runner:
    """HF `generate`: plain, prompt lookup, early exit at L//2, or a draft model."""
    import torch

    gc, eos = generation_config(model, tok, args), eos_ids(model, tok)
    extra = draft_kwargs(args.draft_model, tok) if method == "draft-model" else {}
    if method == "pld":
        gc.prompt_lookup_num_tokens = 10
    elif method == "early-exit":
        gc.assistant_early_exit = model.config.get_text_config().num_hidden_layers // 2

    def call(ids: list[int], seed: int) -> Outcome:
        x = torch.tensor([ids])
        torch.manual_seed(seed)
        reset_peak_rss()
        with RoundProbe(model) as probe, torch.inference_mode():
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, **extra)
            wall = time.perf_counter() - t0
        rss = peak_rss_mb()
        new = cut_at_eos(y[0, len(ids) :].tolist(), eos)
        return Outcome(new, wall, probe.rounds or None, *probe.stats(), peak_rss_mb=rss)

    return call


def draft_kwargs(name: str, tok) -> dict:
    """`generate` kwargs for assisted generation by `name` (tokenizers too if vocabularies differ)."""
    from swiftdecode.models import load_model

    draft, draft_tok = load_model(name)
    if draft_tok.get_vocab() == tok.get_vocab():
        return {"assistant_model": draft}
    return {"assistant_model": draft, "tokenizer": tok, "assistant_tokenizer": draft_tok}


class RoundProbe:
    """Counts HF assisted-generation rounds, drafted and accepted tokens while entered (wraps the candidate
    generator `generate` builds; plain decoding has none, so it counts nothing)."""

    def __init__(self, model):
        self.model, self.rounds, self.drafted, self.matched = model, 0, 0, 0

    def __enter__(self) -> RoundProbe:
        original = self.model._get_candidate_generator

        def wrapped(*a, **kw):
            cg = original(*a, **kw)
            get, update = cg.get_candidates, cg.update_candidate_strategy

            def get_candidates(input_ids, *a2, **kw2):
                cand, logits = get(input_ids, *a2, **kw2)
                self.drafted += cand.shape[1] - input_ids.shape[1]
                return cand, logits

            def update_candidate_strategy(input_ids, scores, num_matches):
                self.rounds, self.matched = self.rounds + 1, self.matched + int(num_matches)
                return update(input_ids, scores, num_matches)

            cg.get_candidates, cg.update_candidate_strategy = get_candidates, update_candidate_strategy
            return cg

        self.model._get_candidate_generator = wrapped
        return self

    def __exit__(self, *exc) -> None:
        del self.model._get_candidate_generator

    def stats(self) -> tuple[float | None, float | None]:
        """(mean accepted tokens per round incl. the bonus token, acceptance rate of drafted tokens)."""
        mat = (self.matched + self.rounds) / self.rounds if self.rounds else None
        return mat, (self.matched / self.drafted if self.drafted else None)


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (Linux), so the next reading is the peak of one call."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """Peak resident set size since the last reset (process lifetime where reset is unsupported), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- the run


WARMUP_TEXTS = (  # outside every timed set: warming up on a timed prompt would let stateful methods see it first
    "Say hello and introduce yourself in two sentences.",
    "List three colours and one thing of each colour.",
)


def run_stream(
    runners: dict[str, Runner], prompts: list[Prompt], ids: list[list[int]], args, warm_ids: list[list[int]]
) -> list[dict]:
    """Warm up on `warm_ids` (not timed prompts), then time every method on every prompt, rotating the method
    order per prompt."""
    from tqdm import tqdm

    names = list(runners)
    with tqdm(total=args.warmup * len(names), desc="warm-up", file=sys.stderr, leave=False) as bar:
        for w in range(args.warmup):
            for m in names:
                bar.set_postfix_str(m)
                runners[m](warm_ids[w % len(warm_ids)], args.seed - 1 - w)
                bar.update()
    records: list[dict] = []
    focus = next((m for m in ("swift", *names) if m in names and m != "hf"), names[0])
    with tqdm(total=len(prompts) * len(names), desc="bench", file=sys.stderr, dynamic_ncols=True) as bar:
        for i, (p, x) in enumerate(zip(prompts, ids, strict=True)):
            for m in names[i % len(names) :] + names[: i % len(names)]:
                bar.set_postfix_str(f"{m} | prompt {p.id} | {focus} {running_speedup(records, focus)}")
                o = runners[m](x, args.seed + i)
                records.append(record(i, p, m, len(x), o))
                bar.update()
    return records


def record(index: int, p: Prompt, method: str, prompt_tokens: int, o: Outcome) -> dict:
    n = len(o.token_ids)
    share = o.optimize_s / o.wall_s if o.optimize_s is not None and o.wall_s > 0 else None
    return {
        "index": index,
        "prompt_id": p.id,
        "category": p.category,
        "method": method,
        "prompt_tokens": prompt_tokens,
        "new_tokens": n,
        "wall_s": o.wall_s,
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


def mean_tps(records: list[dict], method: str) -> float | None:
    v = [r["tokens_per_s"] for r in records if r["method"] == method]
    return sum(v) / len(v) if v else None


def mean(values: list) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


# ---------------------------------------------------------------- results


def summarize(records: list[dict], methods: list[str], args, env: dict, tok, chat: bool) -> dict:
    """results.json: settings, env, per-method overall and per-category metrics, mismatches, records."""
    greedy = args.temperature == 0
    reference = next((m for m in ("ar", "hf") if m in methods), None) if greedy else None
    mismatches = compare(records, reference, tok) if reference else []
    for r in records:
        for ref in ("hf", "ar"):
            other = next((o for o in records if o["index"] == r["index"] and o["method"] == ref), None)
            ok = other is not None and other["tokens_per_s"] > 0
            r[f"speedup_vs_{ref}"] = r["tokens_per_s"] / other["tokens_per_s"] if ok else None
    categories = list(dict.fromkeys(r["category"] for r in records))
    per_method = {}
    for m in methods:
        per_method[m] = {
            "overall": aggregate(records, m, lambda r: True, reference),
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
            "warmup",
            "draft_model",
            "seed",
            "fast_path",
            "hf_fast_path",
        )
    }
    settings.update(methods=methods, chat=chat, prompts=len(records) // len(methods), lossless_reference=reference)
    return {
        "model": args.model,
        "settings": settings,
        "env": env,
        "methods": per_method,
        "mismatches": mismatches,
        "records": records,
    }


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
        "| method | tokens/s | vs hf | vs ar | accepted/round | acceptance | optimise share | peak RSS MiB "
        "| lossless | agreement | n |",
        "|" + "---|" * 11,
    ]
    ref = results["settings"]["lossless_reference"]
    for m, res in results["methods"].items():
        o = res["overall"]
        exact = m in ENGINE_METHODS or ref == "hf" or m == ref  # other paths have numerics of their own
        lossless = fmt(o["lossless"]) + (f" ({o['mismatches']} mismatches)" if o["mismatches"] else "")
        lossless = lossless if exact else f"n/a (own numerics; {o['mismatches']} differ)"
        rows.append(
            f"| {m} | {fmt(o['tokens_per_s'])} | {fmt(o['speedup_vs_hf'], suffix='x')} "
            f"| {fmt(o['speedup_vs_ar'], suffix='x')} | {fmt(o['mean_accepted_tokens'])} "
            f"| {fmt(o['acceptance_rate'], '.1%')} | {fmt(o['optimize_share'], '.1%')} "
            f"| {fmt(o['peak_rss_mb'], '.0f')} | {lossless} | {fmt(o.get('agreement'), '.0%')} | {o['n']} |"
        )
    return "\n".join(rows)


def sources_table(results: dict) -> str:
    """Per engine method: rounds of each kind (and their share of round time), accepted tokens by drafter."""
    rows = [
        "| method | draft rounds | ngram rounds | plain rounds | accepted from skip | from ngram | from both |",
        "|" + "---|" * 7,
    ]
    for m, res in results["methods"].items():
        o = res["overall"]
        if o.get("round_kinds") is None:
            continue
        kinds, secs, acc = o["round_kinds"], o["round_seconds"], o["accepted_by_source"]
        spent = sum(secs.values()) or 1.0
        cells = [f"{kinds[k]} ({secs[k] / spent:.0%} of time)" for k in ("draft", "ngram", "plain")]
        rows.append(f"| {m} | " + " | ".join(cells + [str(acc[k]) for k in ("skip", "ngram", "both")]) + " |")
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
    mode = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    fp = e["fast_path"]
    lines = [
        f"# swiftdecode bench: {results['model']}",
        "",
        f"Data `{s['data']}`: {s['prompts']} prompts; {s['max_new_tokens']} new tokens max; {mode}; "
        f"chat template {'on' if s['chat'] else 'off'}; {s['warmup']} warm-up generation(s) per method.",
        f"CPU {e['cpu']} ({e['cpu_count']} cores, {e['threads']} torch threads); torch {e['torch']}, "
        f"transformers {e['transformers']}; fast path `{fp['path']}` ({fp['reason']}).",
        f"HF methods run on {'the fast path' if s['hf_fast_path'] else 'stock torch'}. tokens/s: mean over "
        "prompts of new tokens / wall s; speedups: ratio of those means. accepted/round (bonus token included) "
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
    lines += [
        "",
        "![speedup by category](speedup_by_category.png)",
        "",
        "![prompt stream](prompt_stream.png)",
        "",
    ]
    return "\n".join(lines)


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
