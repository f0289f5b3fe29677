"""`swiftdecode pull NAME`, and the `--model`, `--weights`, `--act-block` and `--cache-dir` options of every command
that loads a model (and the load they ask for)."""

from __future__ import annotations

import argparse

from swiftdecode.base.config import ACT_BLOCKS, ACT_DEFAULT, ACT_HELP
from swiftdecode.hub import DEFAULT_MODEL, WEIGHTS, known_names, pull


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    help_text = "converted-model cache (default: $SWIFTDECODE_CACHE, else ~/.cache/swiftdecode)"
    parser.add_argument("--cache-dir", default=None, help=help_text)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """Add `--model`, `--weights`, `--act-block` and `--cache-dir`, shared by every command that loads a model."""
    names = f"registry name ({known_names()}), HF folder, .gguf file or hub id"
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{names} (default: {DEFAULT_MODEL})")
    _add_weights(parser)
    parser.add_argument("--act-block", type=int, choices=ACT_BLOCKS, default=ACT_DEFAULT, help=ACT_HELP)
    _add_cache_dir(parser)


def load_model(args: argparse.Namespace, **options):
    """(model, tokenizer) of `args.model` as a command's options ask (`--cache-dir`, `--fast-path`, `--weights`,
    `--act-block`); `options` override them or add swiftdecode.load's others."""
    import swiftdecode

    chosen = {"cache_dir": args.cache_dir, "fast_path": args.fast_path, "weights": args.weights}
    return swiftdecode.load(args.model, **(chosen | {"act_block": args.act_block} | options))


def _add_weights(parser: argparse.ArgumentParser) -> None:
    help_text = (
        "gguf: compute from the GGUF's own quantized weights (default; HF folders and hub ids load their own); "
        "fp32: dequantise once to float32 (exact agreement with HF float32 generate)"
    )
    parser.add_argument("--weights", choices=WEIGHTS, default="gguf", help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"registry model: {known_names()}")
    _add_weights(parser)
    _add_cache_dir(parser)
    parser.add_argument("--force", action="store_true", help="rebuild the cache entry even if it is complete")


def run(args: argparse.Namespace) -> int:
    """`swiftdecode pull NAME`: print the converted folder on success."""
    print(pull(args.name, args.cache_dir, progress=True, force=args.force, weights=args.weights))
    return 0
