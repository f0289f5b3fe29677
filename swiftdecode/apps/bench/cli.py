"""`swiftdecode bench`: its flags, the checks made before a model is loaded, and the run."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from swiftdecode.apps.bench import runners
from swiftdecode.apps.bench.follow_up import FOLLOW_UPS
from swiftdecode.apps.bench.llama_server import METHODS as SERVER_METHODS
from swiftdecode.apps.bench.methods import DEFAULT_METHODS, ENGINE_METHODS, METHODS, PEER_METHODS
from swiftdecode.apps.bench.report import failure_lines, overall_table, sources_table, write_outputs
from swiftdecode.apps.bench.stream import WARMUP_TEXTS, run_stream
from swiftdecode.apps.bench.summary import env_info, summarize
from swiftdecode.apps.data import RECORDS, RECORDS_SCHEMA, Prompt, load_prompts
from swiftdecode.apps.generate_cli import FLAGS, add_grammar_arguments, grammar_spec
from swiftdecode.base.config import FAST_PATH_HELP, PREFIX_CACHE_GB
from swiftdecode.base.errors import UserError
from swiftdecode.base.params import check_params
from swiftdecode.base.text import eos_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftdecode.apps.pull_cli import add_model_argument

    add_model_argument(parser)
    parser.add_argument(
        "--data",
        required=True,
        help="Spec-Bench JSONL, text file (one prompt a line), 'humaneval', 'code-edit' (HumanEval functions to edit) "
        "or 'json-records' (people to list as JSON, answered under its schema unless a grammar is given)",
    )
    parser.add_argument(
        "--follow-up",
        choices=sorted(FOLLOW_UPS),
        help="time a second turn instead: the model's own first answer (plain decoding, untimed), then a request to "
        "restate or revise it (chat template only; our engine's methods find the first turn in their prefix cache)",
    )
    parser.add_argument("--categories", help="comma-separated categories ('mt-bench' = its 8 sub-categories)")
    parser.add_argument("--limit", type=int, help="at most N prompts per category (evenly spaced in file order)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from: {', '.join(METHODS)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    sampled = "> 0: sampled, one seed per prompt for all methods (lossless: equal to ar's output)"
    parser.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy; {sampled}")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (default: 1)")
    add_grammar_arguments(parser)  # constrained answers, for our engine's methods
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap prompts in the chat template (default: when the tokenizer has one)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations per method before timing")
    parser.add_argument("--draft-model", help="draft model for the draft-model method")
    parser.add_argument("--fast-path", default="auto", help=FAST_PATH_HELP)
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
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="in --concurrency mode, alternate the one-client and N-client replays this many times (with --ray: "
        "rounds of our single server's pair, then each shape's); the speedup reported is the median pair's "
        "(default: 1)",
    )
    ray_help = "in --concurrency mode, also replay through `serve --ray` (local Ray; the cluster extra) per shape"
    parser.add_argument("--ray", metavar="RxT[,RxT]", help=f"{ray_help}: R replicas of T threads, e.g. 2x1,1x2")
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


def ray_shapes(text: str) -> list[tuple[int, int]]:
    """--ray's REPLICASxTHREADS list."""
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise UserError(f"--ray takes REPLICASxTHREADS[,...] with both >= 1 (e.g. 2x1,1x2), got {text!r}")
    return shapes


def check_args(args: argparse.Namespace) -> tuple[list[str], list[Prompt], Path]:
    """Everything that can be checked before loading a model."""
    methods = parse_methods(args.methods, args.draft_model)
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    args.params = check_params(args.max_new_tokens, args.temperature, args.top_p, names=FLAGS)  # the runners' (once)
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.concurrency < 0 or args.max_batch < 1 or args.pairs < 1:
        raise UserError("--concurrency must be >= 0, --max-batch and --pairs >= 1")
    args.ray_shapes = ray_shapes(args.ray) if args.ray else []
    if args.ray_shapes and not args.concurrency:
        raise UserError("--ray goes with --concurrency")
    if args.temperature > 0 and (peer := next((m for m in methods if m in PEER_METHODS), None)):
        raise UserError(f"{peer} runs greedy in this bench: compare it at --temperature 0")
    args.grammar = grammar_spec(args) or ({"json_schema": RECORDS_SCHEMA} if args.data == RECORDS else None)
    if args.grammar and (other := next((m for m in methods if m not in ENGINE_METHODS), None)):
        raise UserError(
            f"{other} takes no grammar in this bench: --json-schema/--regex/--lark run our engine's methods"
        )
    if args.concurrency and (
        sum(m in ENGINE_METHODS for m in methods) != 1
        or not all(m in ENGINE_METHODS or m in SERVER_METHODS for m in methods)
    ):
        raise UserError(
            f"--concurrency serves one engine method ({', '.join(ENGINE_METHODS)}), beside any of the "
            f"llama-server peers ({', '.join(SERVER_METHODS)})"
        )
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
    model, tok, fast_path = runners.load_target(args)
    chat = runners.use_chat(tok, args.chat)
    ids, earlier = [runners.encode(tok, p.text, chat) for p in prompts], {}
    if args.follow_up:
        prompts, ids, firsts = follow_ups(model, tok, prompts, args, chat)
        earlier = {tuple(conversation): first for conversation, first in zip(ids, firsts, strict=True)}
    if args.concurrency:
        return run_concurrency(model, tok, methods, ids, args, out)
    switch = runners.PathSwitch(model, fast_path["path"], args)
    with ExitStack() as stack:  # the llama-server peers' processes, stopped however the run ends
        peers = runners.peer_runners(methods, tok, eos_ids(model, tok), args, stack)
        methods = [m for m in methods if m not in PEER_METHODS or m in peers]
        by_method = {
            m: peers[m] if m in peers else runners.make_runner(m, model, tok, args, switch, earlier) for m in methods
        }
        warm_ids = [runners.encode(tok, text, chat) for text in WARMUP_TEXTS]
        records, failures = run_stream(by_method, prompts, ids, args, warm_ids)
    results = summarize(records, methods, args, env_info(fast_path), tok, chat, failures)
    write_outputs(results, out)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(overall_table(results))
        print()
        print(sources_table(results))
        if results["failures"]:
            print("\n" + "\n".join(failure_lines(results)))
        print(f"\nwrote {out}/results.json, results.md, speedup_by_category.png, prompt_stream.png")
    return 0


def ray_rounds(single: Callable[[int], dict], method: str, ids: list[list[int]], args) -> tuple[dict, dict]:
    """`--pairs` rounds, each a pair of our single server's replays (`single(1)`) then a pair through each Ray
    shape (fresh replicas): the machine's speed drifts, so each shape is compared with the single server of its
    own round (`against_single`: its N-client aggregate over the single server's, per round). Returns the single
    server's result and {shape's name: its result}, each with every round's pair (concurrency.combined)."""
    from swiftdecode.apps.bench import cluster, concurrency

    ours, theirs = [], {shape: [] for shape in args.ray_shapes}
    for _ in range(args.pairs):
        ours.append(single(1))
        answers = [a.get("text") for a in ours[-1]["one_client"]["answers"]]
        for (replicas, threads), rounds in theirs.items():
            rounds.append(cluster.run(args, method, ids, answers, replicas, threads))
    shapes = {}
    for (replicas, threads), rounds in theirs.items():
        name = f"swiftdecode {method} on Ray, {replicas} x {threads} threads"
        failed = next((r for r in rounds if "error" in r), None)
        shapes[name] = failed or cluster.against(ours, rounds)
    return concurrency.combined(ours), shapes


def follow_ups(model, tok, prompts: list[Prompt], args: argparse.Namespace, chat: bool):
    """(the prompts in categories named for the follow-up, their conversations' ids, their first turns' ids): see
    `follow_up`."""
    from swiftdecode.apps.bench.follow_up import conversations
    from swiftdecode.engine.generator import Generator

    if not chat:
        raise UserError("--follow-up needs the chat template (--chat)")
    ids, firsts = conversations(Generator(model, tok, method="ar"), prompts, args.follow_up, args.max_new_tokens)
    return [Prompt(p.id, f"{p.category}/{args.follow_up}", p.text) for p in prompts], ids, firsts


def run_concurrency(model, tok, methods: list[str], ids: list[list[int]], args: argparse.Namespace, out: Path) -> int:
    """Our server with one engine method, then each llama-server peer asked for with `--concurrency` slots
    (`-np N`), each replayed by one client and by N at once; with `--ray`, each shape's replays alternate with
    our single server's, pair by pair (see `ray_rounds`)."""
    from swiftdecode.apps.bench import concurrency
    from swiftdecode.engine.generator import Generator

    method = next(m for m in methods if m in ENGINE_METHODS)

    def make_gen() -> Generator:  # as `serve` runs it
        return Generator(model, tok, method=method, prefix_cache_gb=PREFIX_CACHE_GB)

    def single(pairs: int) -> dict:
        return concurrency.run(make_gen, ids, args.max_new_tokens, args.concurrency, args.max_batch, pairs)

    result, shapes = ray_rounds(single, method, ids, args) if args.ray_shapes else (single(args.pairs), {})
    result.update(model=args.model, method=method, max_new_tokens=args.max_new_tokens, threads=args.threads)
    peers = [m for m in methods if m in SERVER_METHODS]
    result["peers"] = {**(runners.server_replays(peers, ids, args) if peers else {}), **shapes}
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else concurrency.table(result))
    return 0
