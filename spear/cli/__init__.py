"""The ``spear`` command. Each subcommand lives in its own module with a ``register``."""

from __future__ import annotations

import argparse
import logging
import sys

from spear.errors import SpearError

# Subcommand modules, in the order --help lists them. Each defines
# ``register(subparsers)`` which adds a parser whose ``func(args)`` runs it.
COMMANDS = ["run", "select", "quantize", "calibrate", "eval", "import_", "serve", "generate", "profile", "tune_kernels"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="spear", description="4-bit LLMs with low-rank error compensators: "
                                               "quantize, calibrate, evaluate, serve.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"spear.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.quiet:  # transformers draws its own bars (loading weights) that spear's progress flag does not reach
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return int(args.func(args) or 0)
    except SpearError as exc:  # one line, whatever the message a library gave us holds
        print(f"spear {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"spear {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
