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


def _seal_if_serving(argv: list[str]) -> bool:
    """``spear serve`` holds every client's prompts and the engine core link's secret: it makes its
    process non-dumpable here, before the seconds of imports that building the parser costs, since
    a process of the same user that opens /proc/<pid>/mem while it is dumpable keeps reading it
    (spear/serve/core/wire.py). Inline, because the helpers that do it live behind those imports.
    Whether it did (Linux, serve)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "serve" and sys.platform.startswith("linux"):
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
        return True
    return False


def _engine_core_zygote():
    """The engine core's process of ``spear serve``, forked now from the sealed process, before any
    heavy import, so that it is non-dumpable from its first instruction (spear/serve/core/zygote.py);
    None where this process runs threads already (``main`` called by a program: the core is spawned)."""
    from spear.serve.core.zygote import Zygote, forkable

    return Zygote() if forkable() else None


def main(argv: list[str] | None = None) -> int:
    zygote = _engine_core_zygote() if _seal_if_serving(sys.argv[1:] if argv is None else argv) else None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        if args.quiet:  # transformers draws its own bars (loading weights) that spear's progress flag does not reach
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        try:
            return int((args.func(args) if zygote is None else args.func(args, zygote=zygote)) or 0)
        except SpearError as exc:  # one line, whatever the message a library gave us holds
            print(f"spear {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"spear {args.command}: interrupted", file=sys.stderr)
            return 130
    finally:
        if zygote is not None:
            zygote.close()


if __name__ == "__main__":
    sys.exit(main())
