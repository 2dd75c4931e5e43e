"""The ``flashspec`` command line: one module per subcommand (``generate``, ``info``, ``serve``;
``bench`` is ``flashspec.bench``), the engine flags they share (``options``) and argparse value
types (``argtypes``).

``main`` and ``build_parser`` load on first use (PEP 562): the engine flags' module is imported
by the cluster's replicas and the benchmarks too, which need none of the subcommands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "EXIT_USAGE": ".command",
    "build_parser": ".command",
    "main": ".command",
    "build_engine": ".generate",
    "cmd_generate": ".generate",
    "cmd_info": ".info",
}

__all__ = ["EXIT_USAGE", "build_engine", "build_parser", "cmd_generate", "cmd_info", "main"]

if TYPE_CHECKING:
    from .command import EXIT_USAGE, build_parser, main
    from .generate import build_engine, cmd_generate
    from .info import cmd_info

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
