"""The console mounted in the frameworks an app already has, as docs/operations/console.md
shows: under a prefix in FastAPI (ASGI), and in Flask through a2wsgi's ASGI-to-WSGI bridge
with werkzeug's dispatcher. Its login, its cookie's path and its links keep the prefix."""

from __future__ import annotations

import re

import pytest
from a2wsgi import ASGIMiddleware
from fastapi import FastAPI
from fastapi.testclient import TestClient
from flask import Flask
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.test import Client

from relay.console import Auth, Role, UsersFile, add_user, create_app
from tests.support.factories import email, enqueue

PASSWORD = "correct horse battery"
NONCE = re.compile(r'name="nonce" value="([^"]+)"')


@pytest.fixture
def console(engine, tmp_path):
    users = tmp_path / "users"
    add_user(users, "olga@example.com", Role.OPERATOR, PASSWORD)
    return create_app(engine, auth=Auth(users_file=UsersFile(users)), secure_cookies=False)


def test_mounted_in_fastapi_under_a_prefix(engine, console):
    (mid,) = enqueue(engine, [email(1)])
    app = FastAPI()
    app.mount("/outbox", console)

    @app.get("/")
    def home() -> dict[str, str]:
        return {"app": "its own"}

    c = TestClient(app, follow_redirects=False)
    assert c.get("/").json() == {"app": "its own"}
    assert c.get("/outbox/").headers["location"] == "/outbox/login"
    page = c.get("/outbox/login")
    assert 'action="/outbox/login"' in page.text
    nonce = NONCE.search(page.text)
    assert nonce is not None
    done = c.post(
        "/outbox/login",
        data={"name": "olga@example.com", "password": PASSWORD, "nonce": nonce.group(1)},
        headers={"Sec-Fetch-Site": "same-origin"},
    )
    assert done.status_code == 303
    assert done.headers["location"] == "/outbox/"
    assert "Path=/outbox" in done.headers["set-cookie"]
    assert c.get("/outbox/messages").status_code == 200
    assert f'href="/outbox/messages/{mid}"' in c.get("/outbox/messages").text


def test_mounted_in_flask_through_a2wsgi(engine, console):
    flask = Flask(__name__)

    @flask.get("/")
    def home() -> str:
        return "the app's own page"

    flask.wsgi_app = DispatcherMiddleware(flask.wsgi_app, {"/outbox": ASGIMiddleware(console)})  # type: ignore[method-assign]
    c = Client(flask)
    assert c.get("/").get_data(as_text=True) == "the app's own page"
    page = c.get("/outbox/login")
    assert page.status_code == 200
    text = page.get_data(as_text=True)
    assert 'action="/outbox/login"' in text
    nonce = NONCE.search(text)
    assert nonce is not None
    done = c.post(
        "/outbox/login",
        data={"name": "olga@example.com", "password": PASSWORD, "nonce": nonce.group(1)},
        headers={"Sec-Fetch-Site": "same-origin"},
    )
    assert done.status_code == 303
    assert done.headers["location"] == "/outbox/"
    assert c.get("/outbox/").status_code == 200
