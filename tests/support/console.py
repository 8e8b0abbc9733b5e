"""The operator console over HTTP in tests: a Starlette test client of a console with a users
file, logging in, the session's CSRF token, and following a bulk change to its job page."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
from starlette.testclient import TestClient

from relay.console import Auth, Role, UsersFile, add_user, create_app

__all__ = [
    "CSRF",
    "HIDDEN",
    "NONCE",
    "OUTCOME",
    "PASSWORD",
    "SAME",
    "client",
    "csrf_of",
    "finished_job",
    "job_path",
    "login",
    "users_file",
]

PASSWORD = "correct horse battery"
NONCE = re.compile(r'name="nonce" value="([^"]+)"')
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
HIDDEN = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)"')
OUTCOME = re.compile(r'<p id="outcome"[^>]*>(.*?)</p>', re.DOTALL)
SAME = {"Sec-Fetch-Site": "same-origin"}  # what a browser says of a form of the page's own site
REFRESH = '<meta http-equiv="refresh"'


def users_file(folder: Path, **more: Role) -> Path:
    """A users file in ``folder``: olga@example.com (operator) and vic (viewer), and ``more``
    by name, all with :data:`PASSWORD`."""
    path = folder / "users"
    for name, role in {"olga@example.com": Role.OPERATOR, "vic": Role.VIEWER, **more}.items():
        add_user(path, name, role, PASSWORD)
    return path


def client(engine: sa.Engine, users: Path, **kw: Any) -> TestClient:
    """A test client of a console over ``engine`` (insecure cookies: plain HTTP), redirects
    not followed."""
    app = create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False, **kw)
    return TestClient(app, base_url="http://console.test", follow_redirects=False)


def login(c: TestClient, name: str, password: str = PASSWORD) -> Any:
    """Log ``c`` in through the login form; the response to its POST."""
    page = c.get("/login")
    nonce = NONCE.search(page.text)
    assert nonce is not None, page.text
    return c.post(
        "/login",
        data={"name": name, "password": password, "nonce": nonce.group(1)},
        headers=SAME,
    )


def csrf_of(c: TestClient, path: str) -> str:
    """The session's CSRF token, as the page at ``path`` carries it."""
    token = CSRF.search(c.get(path).text)
    assert token is not None
    return token.group(1)


def job_path(started: Any) -> str:
    """The job page a bulk apply's answer (a 303) sends the browser to."""
    assert started.status_code == 303, started.text
    path = urlsplit(started.headers["location"]).path
    assert path.startswith("/actions/jobs/"), path
    return path


def finished_job(c: TestClient, started: Any, timeout: float = 30.0) -> Any:
    """The job page of a bulk apply's answer once the job ended: the page stops reloading
    itself (no meta refresh) when it has its outcome."""
    path = job_path(started)
    deadline = time.monotonic() + timeout
    while True:
        page = c.get(path)
        if REFRESH not in page.text:
            return page
        assert time.monotonic() < deadline, f"the job at {path} did not end in {timeout}s"
        time.sleep(0.02)
