"""Command line: `swiftdecode generate | chat | bench | serve | pull | doctor | eval`."""

from __future__ import annotations

import argparse
import importlib
import sys

from swiftdecode.base.errors import UserError

# subcommand -> module; each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "generate": ("swiftdecode.apps.generate_cli", "generate text (one or many prompts)"),
    "chat": ("swiftdecode.apps.chat", "interactive chat in the terminal"),
    "bench": ("swiftdecode.apps.bench.cli", "benchmark decoding methods side by side"),
    "serve": ("swiftdecode.apps.server.cli", "OpenAI-compatible HTTP server"),
    "soak": ("swiftdecode.apps.server.soak", "soak a live server with concurrent valid and abusive requests"),
    "pull": ("swiftdecode.apps.pull_cli", "download, assemble and convert a registry model"),
    "doctor": ("swiftdecode.apps.doctor", "show the CPU matmul path and multi-token forward costs"),
    "eval": ("swiftdecode.apps.evaluate.cli", "perplexity and KL divergence from float32, beside llama.cpp's"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swiftdecode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args.module).run(args)
    except UserError as e:
        print(f"swiftdecode {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
