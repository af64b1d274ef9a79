"""Tools to measure the cache dashboard: headless Chromium and a synthetic big tree.

selenium's own driver manager would download a browser; pointing its Service at the system
chromedriver keeps everything offline. Install with `apt-get install chromium
chromium-driver` (scripts/setup.sh does it as root) and `pip install selenium`.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from radixserve.cache import BlockPool, RadixCache

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def missing() -> str | None:
    """Why a browser cannot start here, or None if it can."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if absent:
        return (
            f"{', '.join(absent)} not installed: install Debian's chromium and chromium-driver "
            "(scripts/setup.sh does it when run as root with apt)"
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    return None


@contextmanager
def headless_chromium(width: int = 1400, height: int = 1100) -> Iterator[Any]:
    """A selenium driver on a fresh profile, quit and cleaned up on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="radixserve-chromium-")
    for flag in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def synthetic_cache(num_nodes: int, block_size: int = 16, seed: int = 0) -> RadixCache:
    """A cache of chats (1-3 turns under 8 shared system prompts) with `num_nodes` nodes."""
    rng = random.Random(seed)
    bs = block_size
    cache = RadixCache(BlockPool(num_nodes * 3), bs)
    systems = [[1000 + 64 * s + i for i in range(4 * bs)] for s in range(8)]
    while cache.stats().num_nodes < num_nodes:
        seq = list(rng.choice(systems))
        for _ in range(rng.randint(1, 3)):
            seq += [rng.randrange(40_000) for _ in range(bs * rng.randint(1, 3))]
            cache.match_prefix(seq + [0])
            res = cache.insert(seq, cache.allocate(len(seq) // bs))
            cache.pool.free(res.duplicate_blocks)
    return cache
