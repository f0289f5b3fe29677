"""Command line: `swiftdecode generate | chat | models | pull | bench | eval | serve | soak | doctor | synth`."""

from __future__ import annotations

import argparse
import importlib
import sys

from swiftdecode import __version__
from swiftdecode.base.errors import UserError

# subcommand -> module; each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "generate": ("swiftdecode.apps.generate_cli", "generate text (one or many prompts)"),
    "chat": ("swiftdecode.apps.chat", "interactive chat in the terminal"),
    "models": ("swiftdecode.apps.models_cli", "list the registry's models: pulled or not, size, architecture"),
    "pull": ("swiftdecode.apps.pull_cli", "download, assemble and convert a registry model"),
    "bench": ("swiftdecode.apps.bench.cli", "benchmark decoding methods side by side"),
    "eval": ("swiftdecode.apps.evaluate.cli", "perplexity and KL divergence from float32, beside llama.cpp's"),
    "serve": ("swiftdecode.apps.server.cli", "OpenAI-compatible HTTP server"),
    "soak": ("swiftdecode.apps.server.soak", "soak a live server with concurrent valid and abusive requests"),
    "doctor": ("swiftdecode.apps.doctor", "show the CPU matmul path and multi-token forward costs"),
    "synth": (
        "swiftdecode.apps.synth_cli",
        "write a GGUF file of a published model's shape with random weights (speed work)",
    ),
}
# torch installed by hand, pinned: an unpinned `torch` pulls a multi-GB CUDA build
TORCH_HINT = "torch is not installed; pip install torch==2.13.0 (the CPU build)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swiftdecode", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        print(f"swiftdecode {args.command}: error: {TORCH_HINT}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
