"""A real browser for tests of the operator web console: an ASGI app served by uvicorn on
127.0.0.1, and Debian's chromium (headless) driven through Selenium and chromedriver.

``LiveServer`` serves any ASGI app (a Starlette app mounting the console under a prefix is
just another app); ``chromium`` yields a ``webdriver.Chrome`` with a fresh profile. Without
chromium or chromedriver the test skips (fails when CI=true: ``apt-get install chromium
chromium-driver``). Selenium Manager never runs: the binary and driver paths are given, and
``SE_OFFLINE`` is set while the driver starts, so nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.db import CI

__all__ = ["LiveServer", "chromium", "screenshot", "wait_until"]

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "apt-get install chromium chromium-driver"


class LiveServer:
    """``app`` served by uvicorn on a daemon thread at :attr:`url` (127.0.0.1, a free port)
    while the block runs; ``config`` goes to ``uvicorn.Config`` as is."""

    def __init__(self, app: Any, **config: Any) -> None:
        # The socket is bound here, before the thread starts: the port is known (and ours)
        # up front, with no window for another process to take it between a probe and a bind.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # log_config=None: uvicorn leaves the logging setup alone, and what it logs at warning
        # and above reaches pytest's capture (shown with a failing test).
        options: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": self.port,
            "log_level": "warning",
            "log_config": None,
            "access_log": False,
            "timeout_graceful_shutdown": 5,
        }
        options.update(config)
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> LiveServer:
        self._thread.start()
        # started: lifespan startup done and the socket being served. A thread that ended
        # first failed its startup (uvicorn exits the thread quietly); its log says why.
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self._thread.is_alive():
                self._socket.close()
                raise AssertionError(f"uvicorn did not start serving {self.url} (see its log)")
            if time.monotonic() > deadline:
                self._stop()
                raise AssertionError(f"uvicorn did not start serving {self.url} within 15s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()
        assert not self._thread.is_alive(), f"uvicorn serving {self.url} did not stop in 10s"

    def _stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._socket.close()  # uvicorn closes it too; closing twice is harmless


def _missing() -> str | None:
    """What of chromium and chromedriver cannot be found, or None."""
    missing = [
        name
        for name, fallback in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER))
        if not (shutil.which(name) or os.access(fallback, os.X_OK))
    ]
    return " and ".join(missing) or None


@contextlib.contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """Headless chromium with a fresh profile, 1280x900, no implicit wait; quit on exit.
    Skips the test when chromium or chromedriver is missing (fails it when CI=true)."""
    missing = _missing()
    if missing:
        message = f"{missing} not found: {INSTALL}"
        if CI:
            pytest.fail(f"{message} (CI=true: browser tests must run, not skip)", pytrace=False)
        pytest.skip(message)
    binary = shutil.which("chromium") or CHROMIUM
    driver_path = shutil.which("chromedriver") or CHROMEDRIVER
    with (
        tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile,
        _offline(),
    ):
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        # --no-sandbox: CI runs as root in a container, where chromium's sandbox cannot start;
        # --disable-dev-shm-usage: a container's /dev/shm is often 64 MB, too small for it.
        for argument in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--window-size=1280,900",
        ):
            options.add_argument(argument)
        driver = webdriver.Chrome(options=options, service=Service(driver_path))
        try:
            driver.implicitly_wait(0)
            yield driver
        finally:
            driver.quit()


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """SE_OFFLINE=true while the block runs: Selenium Manager, should anything start it
    despite the explicit paths, finds what is installed and downloads nothing."""
    before = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"
    try:
        yield
    finally:
        if before is None:
            del os.environ["SE_OFFLINE"]
        else:
            os.environ["SE_OFFLINE"] = before


def wait_until(
    driver: webdriver.Chrome,
    condition: Callable[[webdriver.Chrome], T],
    timeout: float = 10,
    message: str = "",
) -> T:
    """What ``condition(driver)`` returns once it is truthy (an ``expected_conditions`` works);
    past ``timeout`` seconds a ``TimeoutException`` with ``message``."""
    return WebDriverWait(driver, timeout).until(condition, message)


def screenshot(driver: webdriver.Chrome, name: str) -> Path | None:
    """The page as ``<name>.png`` in the directory ``OUTBOX_SCREENSHOTS`` names (created), and
    that file's path; nothing, and None, when the variable is unset or empty."""
    folder = os.environ.get("OUTBOX_SCREENSHOTS")
    if not folder:
        return None
    path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not driver.save_screenshot(str(path)):
        raise AssertionError(f"chromium could not save a screenshot to {path}")
    return path
