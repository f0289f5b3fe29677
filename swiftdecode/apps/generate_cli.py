"""`swiftdecode generate`: one or many prompts, in order, in one process (search state carries over)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from swiftdecode import METHODS
from swiftdecode.base.config import FAST_PATH_HELP, PREFIX_CACHE_GB
from swiftdecode.base.errors import UserError
from swiftdecode.base.params import CONTROLS, check_params

# engine keyword -> the flag a user typed, for error messages
SAMPLING = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "logprobs",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    *CONTROLS,
)
FLAGS = {k: "--" + k.replace("_", "-") for k in SAMPLING}


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int | None = 256) -> None:
    """Options shared by generate and chat (max_new_tokens None: up to the model's context)."""
    from swiftdecode.apps.pull_cli import add_model_argument

    add_model_argument(p)
    p.add_argument("--method", default="swift", choices=METHODS, help="decoding method (default: swift)")
    limit = max_new_tokens or "as many as the model's context holds"
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"answer length limit (default: {limit})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    for name, (off, what) in CONTROLS.items():
        p.add_argument(FLAGS[name], type=float, default=off, help=f"{what} (default {off:g})")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit at every step (repeatable); -100 all but bans it",
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence before this many new tokens")
    p.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence tokens to --max-new-tokens")
    add_grammar_arguments(p)
    p.add_argument("--fast-path", default="auto", help=FAST_PATH_HELP)
    p.add_argument("--verbose", action="store_true", help="after each answer, every counter instead of one short line")


def add_grammar_arguments(p: argparse.ArgumentParser) -> None:
    """--json-schema / --regex / --lark (one at most): the answer's structure (`grammar_spec`)."""
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", metavar="SCHEMA", help="answer in JSON valid for this schema (a file or JSON text)"
    )
    shape.add_argument("--regex", help="answer in text that matches this regular expression")
    shape.add_argument("--lark", metavar="FILE", help="answer in text this Lark grammar (llguidance's syntax) accepts")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-file", help="text file (one prompt per line) or Spec-Bench-form JSONL")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt per line")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log-probability and its N likeliest alternatives (0-20)",
    )
    add_sampling_arguments(p)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for Generator.stream: the parameters validated once, here, before any model is loaded
    (UserError naming the flag), the seed and the grammar."""
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    kw |= {k: getattr(args, k) for k in (*CONTROLS, "min_tokens", "ignore_eos")}
    kw |= {"logit_bias": _logit_bias(args.logit_bias)}
    logprobs = getattr(args, "logprobs", None)  # generate's option (chat has none)
    params = check_params(**kw, stop=args.stop, names=FLAGS, logprobs=logprobs)
    return dict(params=params, seed=args.seed, grammar=grammar_spec(args))


def grammar_spec(args: argparse.Namespace) -> dict | None:
    """--json-schema / --regex / --lark -> the engine's grammar spec (None: free text); files are read here."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.lark is not None:
        return {"lark": _read(args.lark, "--lark")}
    if args.json_schema is None:
        return None
    text = args.json_schema if args.json_schema.lstrip().startswith("{") else _read(args.json_schema, "--json-schema")
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema is not valid JSON: {e}") from None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID=BIAS options -> {ID: BIAS} (a later one for the same ID wins); values are checked later."""
    bias = {}
    for item in items or []:
        tok, _, value = item.partition("=")
        try:
            bias[int(tok)] = float(value)
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS (an integer token id, a number), got {item!r}") from None
    return bias or None


def run(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    prompts = list(args.prompt)
    if args.prompt_file:
        from swiftdecode.apps.data import load_prompts

        prompts += [p.text for p in load_prompts(args.prompt_file)]
    if not prompts:
        raise UserError("give --prompt TEXT or --prompt-file FILE")
    if args.logprobs is not None and not args.json:
        raise UserError("--logprobs needs --json (the log-probabilities are fields of its records)")
    if any(not p.strip() for p in prompts):
        raise UserError("prompt is empty")

    import swiftdecode
    from swiftdecode.apps.pull_cli import load_model

    model, tokenizer = load_model(args)
    shared = PREFIX_CACHE_GB if len(prompts) > 1 else 0.0  # later prompts may begin as earlier ones (chat template)
    gen = swiftdecode.Generator(model, tokenizer, method=args.method, prefix_cache_gb=shared)
    for prompt in prompts:
        if args.json:
            res = gen.generate(prompt, chat=args.chat, **kwargs)
            print(json.dumps(record(res)), flush=True)
            continue
        for ev in gen.stream(prompt, chat=args.chat, **kwargs):
            print(ev.text, end="", flush=True)
        print()
        print(after_answer(ev.result, args, gen.max_length), file=sys.stderr)
    return 0


def record(res) -> dict:
    """The JSON line of one generation (contract used by other tools)."""
    s = res.stats.to_dict()
    keys = ("new_tokens", "wall_s", "tokens_per_s", "mean_accepted_tokens", "acceptance_rate", "tree_rounds")
    return {
        "text": res.text,
        "token_ids": res.token_ids,
        "finish_reason": res.finish_reason,
        "prompt_tokens": res.prompt_tokens,
        "cached_prompt_tokens": s["cached_prompt_tokens"],
        **{k: s[k] for k in keys},
        "skip": s["skip"],
        "time_split": s["time_split"],
        "round_kinds": s["round_kinds"],
        "round_seconds": s["round_seconds"],
        "accepted_by_source": s["accepted_by_source"],
        "search": s["search"],
    } | ({"logprobs": [asdict(e) for e in res.logprobs]} if res.logprobs is not None else {})


def after_answer(res, args: argparse.Namespace, context: int, cached: bool = False) -> str:
    """What follows an answer: every counter with --verbose, else `summary_line`; and, where a limit cut the
    answer, which one."""
    s = res.stats.to_dict()
    line = stats_line(s) if args.verbose else summary_line(s, args.method, cached)
    if res.finish_reason != "length":
        return line
    if res.prompt_tokens + s["new_tokens"] >= context:
        return line + f"\n[the answer filled the model's context ({context} tokens)]"
    return line + f"\n[stopped at --max-new-tokens {args.max_new_tokens}; raise it for a longer answer]"


def summary_line(s: dict, method: str, cached: bool = False) -> str:
    """One short line: speed, the speed-up over plain decoding, and where the accepted draft tokens came from."""
    n = s["new_tokens"]
    parts = [f"{n} token{'s' * (n != 1)} in {s['wall_s']:.1f} s, {s['tokens_per_s']:.1f} tok/s"]
    if method != "ar":
        parts += filter(None, [_speedup(s)])
        by = s["accepted_by_source"]
        copied, skipped = by["suffix"] + by["ngram"] + by["both"], by["skip"]
        drafts = f"drafts accepted: {copied} copied from the text, {skipped} from the layer-skip draft"
        parts.append(drafts if copied + skipped else "no draft tokens accepted")
    if cached:
        parts.append(f"prompt tokens cached {s['cached_prompt_tokens']}")
    return "[" + "; ".join(parts) + "]"


def _speedup(s: dict) -> str | None:
    """Decoding time over what plain decoding would take for the same tokens, that time estimated from this
    answer's own plain rounds (one token each, as plain decoding's); None without a plain round to tell."""
    plain_rounds, decode_s = s["round_kinds"]["plain"], sum(s["round_seconds"].values())
    if not plain_rounds or not decode_s or s["new_tokens"] < 2:
        return None
    plain_s = s["round_seconds"]["plain"] / plain_rounds * (s["new_tokens"] - 1)  # the first token is the prefill's
    return f"~{plain_s / decode_s:.2f}x plain decoding"


def stats_line(s: dict) -> str:
    skipped = len(s["skip"]["attn"]) + len(s["skip"]["mlp"])
    return (
        f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, {s['mean_accepted_tokens']:.2f} tokens/round, "
        f"acceptance {s['acceptance_rate']:.0%}, rounds {_counts(s['round_kinds'])}, accepted from "
        f"{_counts(s['accepted_by_source'])}, {skipped} sublayers skipped, MLP sparsity level "
        f"{s['skip'].get('sparsity', 0)}, search {s['search']}, prompt tokens cached {s['cached_prompt_tokens']}]"
    )


def _counts(counts: dict[str, int]) -> str:
    """{"draft": 3, "plain": 1} -> "draft 3/plain 1"."""
    return "/".join(f"{k} {n}" for k, n in counts.items())
