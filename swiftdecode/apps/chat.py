"""`swiftdecode chat`: interactive multi-turn chat in the terminal, tokens streamed as they are accepted."""

from __future__ import annotations

import argparse
import sys

from swiftdecode.apps.generate_cli import add_sampling_arguments, sampling_kwargs, stats_line
from swiftdecode.base.config import PREFIX_CACHE_GB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p)


def run(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    import swiftdecode

    model, tokenizer = swiftdecode.load(
        args.model, cache_dir=args.cache_dir, fast_path=args.fast_path, weights=args.weights
    )
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
        answer = ""
        try:
            for ev in gen.stream(gen.chat_ids(history), **kwargs):
                print(ev.text, end="", flush=True)
                answer += ev.text
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        print()
        print(stats_line(ev.result.stats.to_dict()), file=sys.stderr)
        history.append({"role": "assistant", "content": answer})
