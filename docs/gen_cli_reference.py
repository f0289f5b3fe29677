"""Writes the CLI reference page (reference/cli.md) from the argparse definitions at `mkdocs build` time
(mkdocs-gen-files), so the page is the parser's own help and cannot drift from it."""

from __future__ import annotations

import os

import mkdocs_gen_files

from swiftdecode.apps.cli import COMMANDS, build_parser

WIDTH = "80"  # argparse wraps help to $COLUMNS; 80 fits the page


def subparsers(parser):
    """{command name: its parser}, in COMMANDS' order."""
    choices = next(a.choices for a in parser._actions if a.dest == "command")
    return {name: choices[name] for name in COMMANDS}


def page() -> str:
    os.environ["COLUMNS"] = WIDTH
    parser = build_parser()
    lines = [
        "# Command-line reference",
        "",
        "Generated from the argparse definitions when the site is built (`docs/gen_cli_reference.py`); "
        "`swiftdecode COMMAND --help` prints the same. What the options do, with examples: [Usage](../cli.md).",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in subparsers(parser).items():
        lines += ["", f"## `swiftdecode {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


with mkdocs_gen_files.open("reference/cli.md", "w") as f:
    f.write(page())
