"""The browser harness (:mod:`tests.support.browser`) proven on a tiny Starlette app mounted
under ``/console``, as the operator console will be: a form POSTed by chromium, a session
cookie set by the app and sent back, the page's text read through the driver, screenshots.

The cookie is set as the console sets its own (``HttpOnly; SameSite=Strict; Secure;
Path=/``) over plain http://127.0.0.1: Chromium counts loopback as a secure context (a
"potentially trustworthy" origin), keeps a Secure cookie set from there, and sends it back.
Over plain http to a non-loopback address the same cookie is dropped: a console reached that
way needs HTTPS in front of it.
"""

from __future__ import annotations

import html
import socket
from urllib.parse import parse_qs

import pytest
from selenium.webdriver.common.by import By
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route

from tests.support.browser import LiveServer, chromium, screenshot, wait_until

SESSION = "console_session"


def console_app(seen: list[str | None]) -> Starlette:
    """A sign-in page, a POST that sets the session cookie, and a page showing who the cookie
    says is signed in; ``seen`` collects the cookie each request to that page carried."""

    async def sign_in(request: Request) -> Response:
        return HTMLResponse(
            "<!doctype html><title>Outbox console</title><h1>Sign in</h1>"
            '<form method="post" action="sign-in">'
            '<input name="operator"><button id="go" type="submit">Sign in</button></form>'
        )

    async def signed_in(request: Request) -> Response:
        # parsed by hand: request.form() needs python-multipart, not a test dependency
        form = parse_qs((await request.body()).decode())
        response = RedirectResponse("whoami", status_code=303)
        response.set_cookie(
            SESSION, form["operator"][0], httponly=True, samesite="strict", secure=True, path="/"
        )
        return response

    async def whoami(request: Request) -> Response:
        operator = request.cookies.get(SESSION)
        seen.append(operator)
        text = f"Signed in as {operator}" if operator else "Not signed in"
        return HTMLResponse(
            f"<!doctype html><title>Outbox console</title><p id=who>{html.escape(text)}"
        )

    console = Starlette(
        routes=[
            Route("/", sign_in),
            Route("/sign-in", signed_in, methods=["POST"]),
            Route("/whoami", whoami),
        ]
    )
    return Starlette(routes=[Mount("/console", console)])


def test_secure_cookie_set_over_http_127_0_0_1_is_kept_and_sent_back() -> None:
    seen: list[str | None] = []
    with LiveServer(console_app(seen)) as server, chromium() as driver:
        driver.get(f"{server.url}/console/")
        driver.find_element(By.NAME, "operator").send_keys("alice")
        driver.find_element(By.ID, "go").click()
        wait_until(driver, lambda d: "whoami" in d.current_url, message="the POST's redirect")
        # the redirect after the POST, then a fresh navigation: both carry the cookie
        driver.get(f"{server.url}/console/whoami")
        who = driver.find_element(By.ID, "who").text
        secure_context = driver.execute_script("return window.isSecureContext")
        cookies = {c["name"]: c for c in driver.get_cookies()}

    assert seen == ["alice", "alice"], "chromium did not send the Secure cookie back"
    assert who == "Signed in as alice"
    assert secure_context is True
    cookie = cookies[SESSION]
    assert (cookie["value"], cookie["path"]) == ("alice", "/")
    assert (cookie["secure"], cookie["httpOnly"], cookie["sameSite"]) == (True, True, "Strict")


def test_page_text_is_read_through_the_driver_and_the_server_stops() -> None:
    with LiveServer(console_app([])) as server, chromium() as driver:
        driver.get(f"{server.url}/console/whoami")
        assert driver.title == "Outbox console"
        assert driver.find_element(By.ID, "who").text == "Not signed in"
        port = server.port

    # stopped: the port no longer takes connections
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_screenshot_is_written_only_when_outbox_screenshots_is_set(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "shots"
    with LiveServer(console_app([])) as server, chromium() as driver:
        driver.get(f"{server.url}/console/")
        monkeypatch.delenv("OUTBOX_SCREENSHOTS", raising=False)
        assert screenshot(driver, "unset") is None
        monkeypatch.setenv("OUTBOX_SCREENSHOTS", str(folder))
        path = screenshot(driver, "sign-in")

    assert path == folder / "sign-in.png"
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in folder.iterdir()] == ["sign-in.png"]
