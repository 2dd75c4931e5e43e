"""The ``flashspec`` command: its parser (generate, bench, info, serve) and ``main``.

Errors a user can fix (a missing model, a hub id while offline, mismatched vocabularies, bad flag
values) print one line saying what to do and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..bench import add_parser as add_bench_parser
from ..flags.options import UserError
from . import generate, info, serve

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line with a pointer to --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flashspec`` command."""
    parser = _Parser(
        prog="flashspec",
        description="Lossless speculative decoding for HuggingFace causal LMs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # In this order in --help. `bench` lives with the benchmarks (flashspec.bench); `serve`
    # imports no FastAPI until it runs, so the other commands work without [serve].
    generate.add_parser(commands)
    add_bench_parser(commands)
    info.add_parser(commands)
    serve.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashspec`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except UserError as exc:
        print(f"flashspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nflashspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `flashspec generate ... | head`: the reader left; nothing more to say.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    return status
