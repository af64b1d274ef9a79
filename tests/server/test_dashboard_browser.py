"""The real /dashboard page in headless Chromium against a real server with traffic.

Needs Debian's `chromium` and `chromium-driver` (scripts/setup.sh installs them when it runs
as root with apt) and `selenium` (see `radixserve.bench.dashboard`). Screenshots and the
measured render times go to $RADIXSERVE_ARTIFACTS (default: test-artifacts/ in the repo).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.bench.dashboard import headless_chromium, missing, synthetic_cache
from radixserve.server.cache_tree import tree_json
from tests.support import wait_for

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are the support assistant of a library that lends books, films and tools. "
    "Answer in one short sentence, politely, and never invent opening hours."
)
QUESTIONS = [
    "Can I renew a book online?",
    "Do you lend drills?",
    "How many films can I borrow?",
    "Is there a late fee?",
    "Can kids get a card?",
    "Do you have audiobooks?",
    "Can I reserve a title?",
    "Where do I return tools?",
]


def artifacts_dir() -> Path:
    """Where screenshots and measurements of this module go (created if needed)."""
    root = Path(__file__).resolve().parents[2]
    path = Path(os.environ.get("RADIXSERVE_ARTIFACTS", root / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Debian's chromedriver; skips where it is not installed."""
    why = missing()
    if why:
        pytest.skip(why)
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def server(launch: Any) -> Iterator[Any]:
    """A real server with the default model."""
    with launch() as s:
        yield s


def _send_traffic(url: str, waves: int = 4, per_wave: int = 2) -> None:
    """Chats sharing SYSTEM, in waves a few polls apart so the hit-ratio window changes."""
    with httpx.Client(base_url=url, timeout=120) as http:
        for wave in range(waves):
            for k in range(per_wave):
                q = QUESTIONS[(wave * per_wave + k) % len(QUESTIONS)]
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                body = {"messages": messages, "max_tokens": 4, "temperature": 0}
                assert http.post("/v1/chat/completions", json=body).status_code == 200
            time.sleep(2.5)


def test_page_shows_the_shared_system_prompt_widest_and_the_hit_ratio_moving(
    browser: Any, server: Any
) -> None:
    browser.get(server.url + "/dashboard")
    wait_for(
        lambda: browser.execute_script(
            "return document.getElementById('status').textContent"
        ).startswith("live"),
        60,
        "the page to go live",
        every=0.5,
    )
    traffic = threading.Thread(target=_send_traffic, args=(server.url,))
    traffic.start()
    traffic.join(300)

    def hit_values() -> list[float]:
        series = browser.execute_script("return radixDashboard.series(0)['hit.window']")
        return sorted({round(v, 4) for _, v in series if v is not None})

    values = wait_for(lambda: len(hit_values()) >= 2 and hit_values(), 30, "the hit ratio", 0.5)
    widest = wait_for(
        lambda: (
            (w := browser.execute_script("return radixDashboard.widestNode(0)"))
            and w["hits"] >= 1
            and w
        ),
        30,
        "a reused node in the tree",
        every=0.5,
    )
    assert "support assistant of a library" in widest["text"], widest
    assert widest["depth"] == 1 and widest["hits"] >= 6
    assert values[0] < values[-1] <= 1.0
    _hover_shows_the_text(browser, widest)
    rows = browser.execute_script(
        "return [...document.querySelectorAll('table.top tbody tr')].map(r => r.innerText)"
    )
    assert "support assistant" in rows[0]
    shot = artifacts_dir() / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def _hover_shows_the_text(browser: Any, widest: dict[str, Any]) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = browser.find_element(By.CSS_SELECTOR, "canvas.tree")
    row_h = browser.execute_script("return radixDashboard.state.panels[0].layout.rowH")
    size = canvas.size
    # Selenium offsets are from the element's centre.
    x = widest["x_px"] + min(40, widest["width_px"] / 2) - size["width"] / 2
    y = (widest["depth"] + 0.5) * row_h - size["height"] / 2
    ActionChains(browser).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    tip = wait_for(
        lambda: browser.execute_script(
            "const t = document.querySelector('.tip'); return t.hidden ? '' : t.innerText"
        ),
        10,
        "the hover tooltip",
        every=0.5,
    )
    assert "support assistant of a library" in tip and "hits" in tip and "last used" in tip


def _synthetic_tree(num_nodes: int) -> dict[str, Any]:
    """An unfolded /v1/cache/tree body of a real RadixCache with `num_nodes` nodes."""
    decode = lambda lists: [f"{len(ids)} tokens" for ids in lists]  # noqa: E731
    body = tree_json(synthetic_cache(num_nodes).snapshot(), 10**6, decode, time.monotonic())
    body["enabled"] = True
    return body


def test_a_100k_node_tree_renders_in_under_a_second(browser: Any, server: Any) -> None:
    tree = _synthetic_tree(100_000)
    assert len(tree["nodes"]) > 100_000  # unfolded: the worst case the page can be sent
    browser.get(server.url + "/dashboard")
    wait_for(lambda: browser.execute_script("return window.radixDashboard"), 30, "the page", 0.5)
    browser.execute_script("document.getElementById('pause').checked = true")
    browser.execute_script("window.bigTree = arguments[0]", tree)
    times = [
        browser.execute_script("return radixDashboard.renderTree(0, window.bigTree)")
        for _ in range(5)
    ]
    parse_ms = browser.execute_script(
        "const s = JSON.stringify(window.bigTree); const t = performance.now(); JSON.parse(s);"
        "return performance.now() - t"
    )
    median = statistics.median(times)
    result = {"nodes": len(tree["nodes"]), "render_ms": times, "json_parse_ms": parse_ms}
    (artifacts_dir() / "dashboard_render_100k.json").write_text(json.dumps(result, indent=1))
    browser.save_screenshot(str(artifacts_dir() / "dashboard_100k.png"))
    print(f"100k-node tree: render median {median:.0f} ms {times}, JSON.parse {parse_ms:.0f} ms")
    assert median < 1000, result
