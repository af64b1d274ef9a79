"""`python -m radixserve CMD ...`: the `radixserve` command (e.g. how `serve --workers N`
starts its workers: `python -m radixserve serve ...`)."""

from __future__ import annotations

import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
