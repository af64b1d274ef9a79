"""`python -m radixserve.server [serve options]`: the `radixserve serve` command on its own."""

from __future__ import annotations

import argparse
import sys

from radixserve.server.main import add_serve_args, run_serve


def main(argv: list[str] | None = None) -> int:
    """Parse the serve options and serve."""
    parser = argparse.ArgumentParser(prog="python -m radixserve.server")
    add_serve_args(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
