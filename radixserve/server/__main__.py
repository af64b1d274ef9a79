"""`python -m radixserve.server [serve options]`: the `radixserve serve` command on its own."""

from __future__ import annotations

import sys

from radixserve.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    """Run `radixserve serve` with these options (its start-up checks and one-line errors)."""
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
