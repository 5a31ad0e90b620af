"""The demo in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven
by selenium) opens the page served by ``aiayn demo``, types a sentence, clicks Translate and
finds the translation on the page; a screenshot lands in the test's output folder.

Skips with the reason when Chromium, ChromeDriver or selenium are missing (``make browser``
installs Debian's packages; nothing is downloaded by the test).
"""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import pytest

pytest.importorskip("gradio", reason="the demo needs the 'demo' extra")

from demo.engine import Settings, load_backend  # noqa: E402
from demo.screenshot import (  # noqa: E402
    browser_missing,
    chromium,
    screenshot,
    translate_in_page,
    wait_for_page,
)

_missing = browser_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

SENTENCE = "A small boy in a green jacket is flying a kite on the beach."


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server  # one real server for both demo test files (tests/conftest.py)


@pytest.fixture(scope="module")
def default_backend(server) -> str:
    m = re.search(r"offering (.+) \(default (\S+)\)", server.log())
    assert m, server.log()
    return m.group(2)


@pytest.fixture(scope="module")
def expected(default_backend):
    """The translation the page must show: the default backend, the page's default settings
    (beam 4, alpha 0.6 gnmt, max_len_b 50), computed here with the same translator API."""
    translator = load_backend(None, default_backend)
    return lambda text: translator.translate([text], **Settings().kwargs())[0].text


@pytest.fixture
def driver(tmp_path):
    d = chromium(tmp_path / "chromium-profile", log_network=True)
    yield d
    d.quit()


def test_type_click_translate_and_screenshot(server, driver, expected, tmp_path):
    from selenium.webdriver.common.by import By

    wait_for_page(driver, server.url)
    assert "Attention Is All You Need" in driver.title + driver.page_source
    shown = translate_in_page(driver, SENTENCE, timeout=60)
    assert shown == expected(SENTENCE)
    # the rest of the page followed: stats, n-best table, alignment heat map
    stats = driver.find_element(By.CSS_SELECTOR, "#stats").text
    assert re.search(r"Latency \d+ ms · \d+ tokens · \d+ tokens/s · 1 sentence", stats), stats
    assert shown in driver.find_element(By.CSS_SELECTOR, "#nbest").text
    assert driver.find_elements(By.CSS_SELECTOR, "#alignment img")
    shot = tmp_path / "demo-translate.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    # Enter in the source box translates too
    other = "Two dogs are playing with a ball in the snow."
    assert translate_in_page(driver, other, timeout=60, press_enter=True) == expected(other)

    # the page fetched nothing from the network: every request went to the demo server
    hosts = set()
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            url = msg["params"]["request"]["url"]
            if url.startswith(("http:", "https:", "ws:", "wss:")):
                hosts.add(urlparse(url).hostname)
    assert hosts == {"127.0.0.1"}, hosts


def test_empty_input_shows_a_friendly_message(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait_for_page(driver, server.url)
    driver.find_element(By.CSS_SELECTOR, "#translate-btn").click()
    WebDriverWait(driver, 30).until(
        lambda d: "Type or paste an English sentence" in d.find_element(
            By.CSS_SELECTOR, "#notice").text)


def test_full_page_screenshot(server, tmp_path):
    """The README's picture (docs/demo.png is made the same way: python -m demo.screenshot)."""
    out = tmp_path / "demo-full.png"
    text = "A man is playing the guitar on a small stage. A crowd of people is watching him."
    shown = screenshot(server.url, out, text, user_data_dir=tmp_path / "profile")
    assert shown.count(".") >= 2 and out.stat().st_size > 50_000
