"""`radixserve serve | route | bench | analyze | generate | chat`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from radixserve import __version__, errors
from radixserve.options import markdown_table

# subcommand -> (module, add-arguments function, run function, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "serve": ("radixserve.launch", "add_serve_args", "run_serve", "start the HTTP server"),
    "route": ("radixserve.router.main", "add_route_args", "run_route", "cache-aware router"),
    "bench": ("radixserve.bench.cli", "add_bench_args", "run_bench", "benchmark a server"),
    "analyze": (
        "radixserve.bench.analyze_cli",
        "add_analyze_args",
        "run_analyze",
        "analyze a trace",
    ),
    "generate": ("radixserve.offline", "add_generate_args", "run_generate", "complete a prompt"),
    "chat": ("radixserve.offline", "add_chat_args", "run_chat", "answer one chat message"),
}

# subcommand -> the radixserve.preflight check run before it starts (before weights load)
PREFLIGHT: dict[str, str] = {
    "serve": "check_serve_args",
    "generate": "check_engine_args",
    "chat": "check_engine_args",
    "route": "check_route_args",
}

# The tables of docs/options.md: (title, "module:Class", the command whose defaults it shows)
OPTION_TABLES: tuple[tuple[str, str, str | None], ...] = (
    (
        "Engine: `serve`, `generate`, `chat`, and `LLM(...)`",
        "radixserve.engine.config:EngineConfig",
        None,
    ),
    ("Server: `serve`", "radixserve.server.config:ServerConfig", "serve"),
    ("Workers: `serve`", "radixserve.launch:LaunchConfig", "serve"),
    ("Sampling: `generate`, `chat`", "radixserve.offline:GenerateConfig", "generate"),
    ("Router: `route`", "radixserve.router.main:RouteConfig", "route"),
    ("Routing policy: `route`", "radixserve.router.policy:PolicyConfig", "route"),
    ("Worker watch: `route`", "radixserve.router.worker:WorkerConfig", "route"),
    ("Benchmark: `bench`", "radixserve.bench.config:BenchConfig", "bench"),
    ("Trace analysis: `analyze`", "radixserve.bench.config:AnalyzeConfig", "analyze"),
)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `radixserve CMD: error: ... (see --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    parser = Parser(prog="radixserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, add_fn, run_fn, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        mod = importlib.import_module(module)
        getattr(mod, add_fn)(p)
        p.set_defaults(_run=(module, run_fn))
    return parser


def options_markdown() -> str:
    """docs/options.md: a table per group of options, generated from their declarations."""
    rows = []
    for title, path, command in OPTION_TABLES:
        module, name = path.split(":")
        rows.append((title, getattr(importlib.import_module(module), name), command))
    head = (
        "# Options\n\n"
        "Generated from the declarations (`radixserve.options.option` fields) by\n"
        "`python -c 'import radixserve.cli as c; print(c.options_markdown(), end=\"\")' > "
        "docs/options.md`;\n"
        "tests/test_option_declarations.py fails when this page and the code disagree.\n\n"
    )
    return head + markdown_table(rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `radixserve` console script.

    A start-up problem ends as one line on stderr and exit status 2 (bad options, as argparse)
    or 1 (the machine: memory, files); set RADIXSERVE_DEBUG=1 for the traceback instead.
    """
    args = build_parser().parse_args(argv)
    _configure_logging(args)
    module, run_fn = args._run
    try:
        if args.command in PREFLIGHT:
            check = getattr(
                importlib.import_module("radixserve.preflight"), PREFLIGHT[args.command]
            )
            check(args)
        run: Callable[[Any], int | None] = getattr(importlib.import_module(module), run_fn)
        return int(run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        status = exit_status(e)
        if status is None or os.environ.get("RADIXSERVE_DEBUG"):
            raise
        print(f"radixserve {args.command}: error: {error_text(e)}", file=sys.stderr)
        return status


def exit_status(exc: BaseException) -> int | None:
    """2 for a bad option, 1 for what the machine lacks, None for a bug (keep its traceback)."""
    if isinstance(exc, (errors.RadixServeError, ValueError)):
        return 2
    if isinstance(exc, (OSError, MemoryError)):
        return 1
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return 1
    return None


def error_text(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _configure_logging(args: argparse.Namespace) -> None:
    level = str(getattr(args, "log_level", None) or "info").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per HTTP call


if __name__ == "__main__":
    sys.exit(main())
