"""`swiftdecode synth`: a GGUF file of a published model's shape with random weights, for speed work on the model's
real sizes without downloading it (`--list` shows the shapes). The file's general.name ends in "(random weights)"."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from swiftdecode.apps.models_cli import table
from swiftdecode.base.errors import UserError
from swiftdecode.hub import locate_gguf
from swiftdecode.hub.shapes import SHAPES, resolve
from swiftdecode.hub.synth import DEFAULT_VOCAB, FORMATS, estimate_size, param_count, write

DEFAULT_TOKENIZER = "smollm2-135m"  # a registry model: its GGUF's tokenizer, padded to the shape's vocab
HEADER = ("shape", "architecture", "params", *(f"{fmt} size" for fmt in FORMATS))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shape", nargs="?", metavar="SHAPE", help="a shape from --list")
    parser.add_argument("-o", "--output", metavar="PATH", help="the GGUF file to write")
    parser.add_argument("--format", default="q4_k_m", choices=list(FORMATS), help="block types (default: q4_k_m)")
    parser.add_argument("--seed", type=int, default=0, help="random weights' seed (default: 0)")
    help_text = f"registry model or GGUF file whose tokenizer the file gets (default: {DEFAULT_TOKENIZER})"
    parser.add_argument("--tokenizer-from", default=DEFAULT_TOKENIZER, metavar="NAME_OR_PATH", help=help_text)
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument("--list", action="store_true", help="list the shapes with their parameters and file sizes")


def rows() -> list[tuple[str, ...]]:
    """One row of `HEADER` per shape; sizes estimated (tiny shapes with the default tokenizer's vocab)."""
    out = []
    for name, shape in SHAPES.items():
        n = param_count(shape)
        params = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        sizes = [f"{estimate_size(shape, fmt) / 1e6:,.0f} MB" for fmt in FORMATS]
        out.append((name, shape.arch, params, *sizes))
    return out


def _tokenizer_file(name_or_path: str) -> Path:
    """The GGUF file holding the tokenizer: a .gguf path as it is, a registry name pulled if absent."""
    path = Path(name_or_path).expanduser()
    found = (path, None) if path.is_file() else locate_gguf(name_or_path)
    if found is None:
        raise UserError(f"--tokenizer-from {name_or_path}: neither a registry model nor a GGUF file")
    return found[0]


def _output(args: argparse.Namespace) -> Path:
    """The output path, checked before any work: SHAPE and -o given, no file there (unless --force), folder exists."""
    if not args.shape or not args.output:
        raise UserError("give a SHAPE and -o PATH (or --list for the shapes)")
    resolve(args.shape)
    out = Path(args.output).expanduser()
    if out.is_dir():
        raise UserError(f"{out} is a directory; -o takes the GGUF file's path")
    if out.exists() and not args.force:
        raise UserError(f"{out} exists; --force overwrites it")
    if not out.parent.is_dir():
        raise UserError(f"directory {out.parent} does not exist")
    return out


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(table([HEADER, *rows()]))
        print(f"\ntiny-* shapes take the tokenizer's vocab ({DEFAULT_VOCAB} for {DEFAULT_TOKENIZER}); sizes estimated")
        return 0
    out = _output(args)
    start = time.perf_counter()
    write(args.shape, out, args.format, args.seed, tokenizer_from=_tokenizer_file(args.tokenizer_from), progress=True)
    seconds = time.perf_counter() - start
    size = out.stat().st_size / 1e6
    print(f"{out}: {args.shape} {args.format}, {size:,.0f} MB in {seconds:.1f} s; random weights (speed work only)")
    return 0
