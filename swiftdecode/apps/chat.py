"""`swiftdecode chat`: interactive multi-turn chat in the terminal, tokens streamed as they are accepted."""

from __future__ import annotations

import argparse
import sys

from swiftdecode.apps.generate_cli import add_sampling_arguments, after_answer, sampling_kwargs
from swiftdecode.base.config import PREFIX_CACHE_GB
from swiftdecode.base.errors import UserError

WHOLE_CONTEXT = 1 << 30  # --max-new-tokens by default: the engine cuts each answer where the model's context ends


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p, max_new_tokens=None)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens is None:
        args.max_new_tokens = WHOLE_CONTEXT
    kwargs = sampling_kwargs(args)
    import swiftdecode
    from swiftdecode.apps.pull_cli import load_model

    model, tokenizer = load_model(args)
    gen = swiftdecode.Generator(model, tokenizer, method=args.method, prefix_cache_gb=PREFIX_CACHE_GB)  # earlier turns
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("swiftdecode chat — empty line or Ctrl-D to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        answer = turn(gen, history, kwargs, args)
        if answer is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


def turn(gen, history: list[dict], kwargs: dict, args: argparse.Namespace) -> str | None:
    """Stream one answer and the line after it; None where it was interrupted or the conversation does not fit."""
    answer = ""
    try:
        for ev in gen.stream(gen.chat_ids(history), **kwargs):
            print(ev.text, end="", flush=True)
            answer += ev.text
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return None
    except UserError as e:
        print(f"[{e}: /reset starts a new conversation]", file=sys.stderr)
        return None
    print()
    print(after_answer(ev.result, args, gen.max_length, cached=True), file=sys.stderr)
    return answer
