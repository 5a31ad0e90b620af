"""Run the demo server in a subprocess and drive it with headless Chromium.

Used by the tests (``tests/test_demo*.py``) and to make the README's screenshot::

    python -m demo.screenshot --out docs/demo.png [--text "A dog runs on the beach."]

Chromium and ChromeDriver are Debian's (``apt-get install chromium chromium-driver``, which
``make browser`` does); nothing is downloaded. Headless Chromium in a closed network stalls
without the flags in ``CHROMIUM_FLAGS``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars")
REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def browser_missing() -> str | None:
    """Why the browser cannot run here (None when Chromium and ChromeDriver are present)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return (f"{' and '.join(missing)} not found; install Debian's chromium and "
                f"chromium-driver (`make browser`)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'aiayn[dev]')"
    return None


class DemoServer:
    """``aiayn demo`` in a subprocess on a free port of 127.0.0.1.

    ``start(timeout)`` waits until the page answers (raising RuntimeError with the server's
    log if it exits or does not answer in ``timeout`` seconds); ``stop()`` terminates it
    (then kills it). Also a context manager.
    """

    def __init__(self, *args: str, port: int | None = None, log_path: Path | None = None,
                 env: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.args = ["--port", str(self.port), *args]
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(
            prefix="aiayn-demo-", suffix=".log")[1])
        self.env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def start(self, timeout: float = 300.0) -> DemoServer:
        cmd = [sys.executable, "-m", "runtime.dispatch", "demo", *self.args]
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the demo server exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            if self._answers():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the demo server did not answer on {self.url} within {timeout:.0f} "
                           f"s:\n{self.log()[-4000:]}")

    def _answers(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "config", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def __enter__(self) -> DemoServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def chromium(user_data_dir: Path, width: int = 1400, height: int = 1000, log_network: bool = False):
    """A headless Chromium WebDriver on Debian's chromium + chromedriver (no downloads);
    ``user_data_dir`` should be a fresh folder. Quit it when done."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not fetch anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={user_data_dir}")
    opts.add_argument(f"--window-size={width},{height}")
    if log_network:
        opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))


def wait_for_page(driver, url: str, timeout: float = 60.0) -> None:
    """Open ``url`` and wait until the demo's source box and Translate button are there."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, timeout).until(
        EC.element_to_be_clickable((By.CSS_SELECTOR, "#translate-btn")))
    WebDriverWait(driver, timeout).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, "#source textarea")))


def translate_in_page(driver, text: str, timeout: float = 60.0, press_enter: bool = False
                      ) -> str:
    """Type ``text`` into the source box, press Translate (or Enter), and return the German
    output once it appears. Raises TimeoutException if none does in ``timeout`` seconds."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    box = driver.find_element(By.CSS_SELECTOR, "#source textarea")
    box.clear()
    out = driver.find_element(By.CSS_SELECTOR, "#translation textarea")
    before = out.get_attribute("value")  # wait for a fresh output, not the previous one
    box.send_keys(text)
    if press_enter:
        box.send_keys(Keys.ENTER)
    else:
        driver.find_element(By.CSS_SELECTOR, "#translate-btn").click()

    def output(d):
        value = d.find_element(By.CSS_SELECTOR, "#translation textarea").get_attribute("value")
        return value if value and value != before else False

    return WebDriverWait(driver, timeout).until(output)


def screenshot(url: str, out: Path, text: str, user_data_dir: Path | None = None) -> str:
    """Open the demo at ``url``, translate ``text``, wait for the alignment plot, and save a
    full-page PNG to ``out``. Returns the translation shown."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    tmp = Path(user_data_dir or tempfile.mkdtemp(prefix="aiayn-chromium-"))
    driver = chromium(tmp)
    try:
        wait_for_page(driver, url)
        translation = translate_in_page(driver, text)
        WebDriverWait(driver, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#alignment img"))
        time.sleep(1.0)  # let the plot image and table finish rendering
        height = driver.execute_script(
            "const app = document.querySelector('gradio-app');"
            "return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight,"
            " app ? app.scrollHeight : 0);")
        width = driver.execute_script("return window.innerWidth")
        # the whole page, not just the window (Chrome DevTools: a taller virtual viewport)
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": int(width), "height": int(height) + 24, "deviceScaleFactor": 1,
            "mobile": False})
        time.sleep(0.5)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        return translation
    finally:
        driver.quit()
        if user_data_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.screenshot", description=(
        "Start the demo, translate a sentence in headless Chromium and save a screenshot."))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "demo.png")
    p.add_argument("--text", default="A man is playing the guitar on a small stage. "
                                     "A crowd of people is watching him.")
    p.add_argument("--url", default=None, help="an already running demo (default: start one)")
    p.add_argument("demo_args", nargs="*", help="options passed to `aiayn demo` (after --)")
    args = p.parse_args(argv)
    reason = browser_missing()
    if reason:
        print(f"demo.screenshot: {reason}", file=sys.stderr)
        return 2
    if args.url:
        print(screenshot(args.url, args.out, args.text))
    else:
        with DemoServer(*args.demo_args) as server:
            print(screenshot(server.url, args.out, args.text))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
