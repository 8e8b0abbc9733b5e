"""The examples, run as a user runs them: the Flask and FastAPI shops through their test
clients on PostgreSQL, then the relay in-process until idle; and the quickstart without its
extra installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from examples.fastapi_shop import app as fastapi_shop
from examples.flask_shop import app as flask_shop
from outbox import Email
from outbox.schema import messages
from relay.testing import FakeSender, run_until_idle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shop_tables(postgres_backend):
    metadatas = (flask_shop.db.metadata, fastapi_shop.Base.metadata)
    for metadata in metadatas:
        metadata.create_all(postgres_backend.engine)
    yield postgres_backend
    for metadata in metadatas:
        metadata.drop_all(postgres_backend.engine)


def outbox_rows(engine):
    columns = (messages.c.id, messages.c.idempotency_key, messages.c.category, messages.c.status)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*columns, messages.c.payload).order_by(messages.c.id))
        return [(*row[:4], Email.from_payload(row.payload)) for row in rows]


def assert_shop_run(engine, signup, checkout):
    """Sign up two users, check out once; a failing checkout leaves nothing behind."""
    ada = signup("ada@example.com")
    bob = signup("bob@example.com")
    order = checkout(ada, "teapot")
    rows = outbox_rows(engine)
    assert [(key, category, status) for _, key, category, status, _ in rows] == [
        (f"welcome:{ada}", "transactional", "pending"),
        (f"welcome:{bob}", "transactional", "pending"),
        (f"order-confirmation:{order}", "transactional", "pending"),
    ]
    assert [(email.to, email.subject) for *_, email in rows] == [
        (("ada@example.com",), "Welcome to the shop"),
        (("bob@example.com",), "Welcome to the shop"),
        (("ada@example.com",), f"Order {order} confirmed"),
    ]

    sender = run_until_idle(engine)
    assert sorted(sender.called_ids) == [row[0] for row in rows]
    assert {m.email.subject for m in sender.calls} == {
        "Welcome to the shop",
        f"Order {order} confirmed",
    }
    assert [row[3] for row in outbox_rows(engine)] == ["sent"] * 3
    assert run_until_idle(engine, FakeSender()).called_ids == []  # nothing is sent twice


def test_flask_shop_enqueues_in_its_transactions_and_the_relay_delivers(shop_tables):
    app = flask_shop.create_app(shop_tables.url)
    client = app.test_client()

    def signup(address):
        answer = client.post("/signup", json={"email": address})
        assert answer.status_code == 201, answer.text
        return answer.json["id"]

    def checkout(user_id, item):
        answer = client.post("/checkout", json={"user_id": user_id, "item": item})
        assert answer.status_code == 201, answer.text
        return answer.json["id"]

    try:
        assert client.post("/checkout", json={"user_id": 999, "item": "x"}).status_code == 404
        assert_shop_run(shop_tables.engine, signup, checkout)
    finally:
        with app.app_context():
            flask_shop.db.session.remove()
            flask_shop.db.engine.dispose()


def test_fastapi_shop_enqueues_in_its_async_transactions_and_the_relay_delivers(shop_tables):
    app = fastapi_shop.create_app(shop_tables.async_url)
    with TestClient(app) as client:

        def signup(address):
            answer = client.post("/signup", json={"email": address})
            assert answer.status_code == 201, answer.text
            return answer.json()["id"]

        def checkout(user_id, item):
            answer = client.post("/checkout", json={"user_id": user_id, "item": item})
            assert answer.status_code == 201, answer.text
            return answer.json()["id"]

        assert client.post("/checkout", json={"user_id": 999, "item": "x"}).status_code == 404
        assert_shop_run(shop_tables.engine, signup, checkout)


def test_quickstart_without_its_extra_says_what_to_install():
    code = (
        "import runpy, sys; sys.modules['moto'] = None; sys.argv = ['quickstart.py']; "
        f"runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert 'pip install -e ".[quickstart]"' in line
