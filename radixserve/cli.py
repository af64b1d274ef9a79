"""`radixserve serve | route | bench | analyze | generate | chat`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

# subcommand -> (module, add-arguments function, run function, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "serve": ("radixserve.launch", "add_serve_args", "run_serve", "start the HTTP server"),
    "route": ("radixserve.router.main", "add_route_args", "run_route", "cache-aware router"),
    "bench": ("radixserve.bench.cli", "add_bench_args", "run_bench", "benchmark a server"),
    "analyze": ("radixserve.bench.cli", "add_analyze_args", "run_analyze", "analyze a trace"),
    "generate": ("radixserve.offline", "add_generate_args", "run_generate", "complete a prompt"),
    "chat": ("radixserve.offline", "add_chat_args", "run_chat", "answer one chat message"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, add_fn, run_fn, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        mod = importlib.import_module(module)
        getattr(mod, add_fn)(p)
        p.set_defaults(_run=(module, run_fn))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixserve` console script."""
    args = build_parser().parse_args(argv)
    module, run_fn = args._run
    run: Callable[[Any], int | None] = getattr(importlib.import_module(module), run_fn)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
